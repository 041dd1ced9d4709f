"""The demo report's per-stage latency: stages bounded by timestamps, never negative; a readable chart;
the trainer's rows in an order that does not depend on when verdicts arrived."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from prm_pipeline.demo.curves import group_id
from prm_pipeline.demo.report import STAGES, DemoRecord, IterationMarks, iteration_stages, latency_figure
from prm_pipeline.demo.run import rows_by_run


def _marks(**kw: float) -> IterationMarks:
    base = dict(
        start=100.0,
        reloaded=100.1,
        sampled=100.6,
        published=100.7,
        last_verdict=103.0,
        batch_in=103.2,
        trained=104.0,
        publish_weights_s=0.1,
        seen=104.05,
    )
    return IterationMarks(**{**base, **kw})


def test_stages_follow_each_other_and_sum_to_the_iteration() -> None:
    stages = iteration_stages(_marks())
    assert list(stages) == list(STAGES)
    assert stages == pytest.approx(
        {
            "reload weights": 0.1,
            "rollout": 0.5,
            "publish": 0.1,
            "scoring (publish -> verdicts)": 2.3,
            "trainer consume": 0.2,
            "train step": 0.7,
            "publish weights": 0.1,
            "hand-off": 0.05,
        }
    )
    assert sum(stages.values()) == pytest.approx(104.05 - 100.0)


def test_a_tail_that_sees_the_last_verdict_after_the_train_step_makes_no_negative_stage() -> None:
    # The reported case: the trainer got its batch at 103.2 and trained until 104.0 in the event
    # loop, so the verdict tail recorded the last verdict only at 104.01. The old accounting
    # (time from the tail's verdict to the step, minus the whole train step) gave 0.04 - 0.8 < 0.
    stages = iteration_stages(_marks(last_verdict=104.01))
    assert min(stages.values()) >= 0.0
    assert stages["scoring (publish -> verdicts)"] == pytest.approx(103.2 - 100.7)  # ends when the batch proves it
    assert stages["trainer consume"] == 0.0
    assert stages["train step"] == pytest.approx(0.7) and stages["publish weights"] == pytest.approx(0.1)
    assert sum(stages.values()) == pytest.approx(104.05 - 100.0)


def test_stages_are_never_negative_whatever_the_order_of_the_marks() -> None:
    rng = random.Random(7)
    for _ in range(500):
        t = sorted(rng.uniform(0, 10) for _ in range(8))
        names = ["reloaded", "sampled", "published", "last_verdict", "batch_in", "trained", "seen"]
        values = t[1:]
        rng.shuffle(values)  # any of them early or late: two consumers, one event loop
        m = IterationMarks(start=t[0], publish_weights_s=rng.uniform(0, 3), **dict(zip(names, values)))
        stages = iteration_stages(m)
        assert min(stages.values()) >= 0.0, (m, stages)
        marks = dict(zip(names, values))
        del marks["last_verdict"]  # seen only through min(last_verdict, batch_in): the batch proves the verdicts
        assert sum(stages.values()) == pytest.approx(max(t[0], *marks.values()) - t[0])


def test_the_latency_chart_keeps_its_legend_and_labels_inside_and_apart() -> None:
    import matplotlib

    matplotlib.use("Agg")
    rec = DemoRecord(stages=[iteration_stages(_marks()) for _ in range(12)])
    fig = latency_figure(rec)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    legends = fig.legends + [a.get_legend() for a in fig.axes if a.get_legend() is not None]
    assert len(legends) == 1
    box = legends[0].get_window_extent(renderer)
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
    assert {t.get_text() for t in legends[0].get_texts()} == set(STAGES)
    ax = fig.axes[0]
    labels = [
        t
        for t in ax.get_xticklabels()
        if t.get_visible() and t.get_text() and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]
    ]
    assert len(labels) >= 6  # enough to read an iteration off the chart
    boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), "x tick labels overlap"
    assert all(page.x0 <= b.x0 and b.x1 <= page.x1 for b in boxes)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _batch(order: list[int]) -> SimpleNamespace:
    rows = [
        (group_id(run, 1, k), f"{run}{k}-s{s}", f"{run}{k}-s{s}", leaf)
        for run in ("outcome", "process")
        for k in range(2)
        for s in range(2)
        for leaf in ("a", "b")
    ]
    rows = [rows[i] for i in order]
    return SimpleNamespace(
        group_ids=[r[0] for r in rows],
        session_ids=[r[1] for r in rows],
        trajectory_ids=[r[2] for r in rows],
        leaf_ids=[r[3] for r in rows],
    )


def test_the_trainer_rows_do_not_depend_on_the_order_verdicts_arrived_in() -> None:
    ordered = _batch(list(range(16)))
    want = {
        run: [ordered.leaf_ids[i] + ordered.session_ids[i] for i in rows]
        for run, rows in rows_by_run(ordered, update=1, prompts=2).items()
    }
    assert list(want) == ["outcome", "process"] and all(len(v) == 8 for v in want.values())
    rng = random.Random(3)
    for _ in range(20):
        order = list(range(16))
        rng.shuffle(order)
        shuffled = _batch(order)
        got = {
            run: [shuffled.leaf_ids[i] + shuffled.session_ids[i] for i in rows]
            for run, rows in rows_by_run(shuffled, update=1, prompts=2).items()
        }
        assert got == want


def test_a_batch_that_is_not_exactly_the_updates_groups_stops_the_demo() -> None:
    batch = _batch(list(range(16)))
    with pytest.raises(RuntimeError, match="update 1: the batch holds groups"):
        rows_by_run(batch, update=0, prompts=2)  # groups of update 1 where update 0's were due
    with pytest.raises(RuntimeError, match=r"lacks \['outcome-it1-p2', 'process-it1-p2'\]"):
        rows_by_run(batch, update=1, prompts=3)
