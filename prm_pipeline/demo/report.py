"""The demo's report: one self-contained ``index.html`` (pictures inline, no network).

:class:`DemoRecord` is what the demo measures while the loop runs; :func:`write_report`
turns it into matplotlib (Agg) figures, embeds them as base64 PNGs next to the token
views of :mod:`prm_pipeline.token_view`, and also leaves each PNG beside the page. The
sections (their ``id`` s are what the tests check) are :data:`SECTIONS`; the first is the
learning curves of the two runs. ``learning-curves.json`` beside the page holds the
curves' numbers (what :func:`prm_pipeline.demo.curves.check_run` compares with the
verdicts and the trainer log); ``streaming.json`` the end -> verdict latency
(:func:`end_to_verdict`) and the trajectories topic's records by kind.

Needs the ``demo`` extra (matplotlib), imported only when a report is written.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prm_pipeline.demo.curves import RUNS, Curve, reading_dict
from prm_pipeline.status.report import percentile

__all__ = [
    "SECTIONS",
    "STAGES",
    "DemoRecord",
    "IterationMarks",
    "end_to_verdict",
    "iteration_stages",
    "latency_figure",
    "write_report",
]

SECTIONS: dict[str, str] = {
    "learning": "Learning curves: outcome only vs with process rewards",
    "summary": "Summary",
    "statuses": "Verdict statuses over time",
    "latency": "Latency: end → verdict, and per stage",
    "rewards": "Reward distributions per scorer",
    "advantages": "Outcome vs shaped advantages",
    "training": "Loss, importance ratio and policy version per step",
    "token-views": "Token views",
}


STAGES: tuple[str, ...] = (
    "reload weights",
    "rollout",
    "publish",
    "scoring (publish -> verdicts)",
    "trainer consume",
    "train step",
    "publish weights",
    "hand-off",
)
"""The stages of one iteration, in the order they follow each other on the demo's clock."""


@dataclass(frozen=True, slots=True)
class IterationMarks:
    """One iteration's ``time.perf_counter()`` readings; each but ``start`` ends a stage.

    The trainer runs in the demo's event loop, beside the verdict tail: the two see the
    iteration's last verdict at different moments, and the tail can see it only after
    the train step (a synchronous callback) has run. So the marks are not ordered by
    construction; :func:`iteration_stages` orders them.
    """

    start: float  # the iteration began (proxies about to reload their weights)
    reloaded: float  # both proxies hold the newest weights
    sampled: float  # every group of the iteration is sampled
    published: float  # every record of the iteration is flushed to the broker
    last_verdict: float  # the demo's verdict tail saw the last of the iteration's groups
    batch_in: float  # the trainer's update callback got the batch (verdicts consumed, collated, shaped)
    trained: float  # the update callback returned: every run stepped and its weights published
    publish_weights_s: float  # the part of [batch_in, trained] spent writing the runs' weights
    seen: float  # the demo loop saw the step


def iteration_stages(m: IterationMarks) -> dict[str, float]:
    """Seconds per stage (:data:`STAGES`) of one iteration: consecutive, never negative, summing to its wall time.

    Each stage runs from the end of the one before to its own mark, marks taken in
    order of :data:`STAGES` and each held at or after the previous one. Scoring ends at
    the first sighting of the iteration's last verdict: by the tail (``last_verdict``)
    or, when the trainer got its batch first, at ``batch_in`` (the batch proves every
    verdict was there). The update callback's window is split into the weight writes it
    measured and the train step (the rest: PPO-clip, statistics, log lines); ``hand-off``
    is the demo loop waking up to the finished step.
    """
    ends = [m.reloaded, m.sampled, m.published, min(m.last_verdict, m.batch_in), m.batch_in, m.trained, m.seen]
    bounds = [m.start]
    for t in ends:
        bounds.append(max(bounds[-1], t))
    (reload, rollout, publish, scoring, consume, window, hand_off) = (b - a for a, b in zip(bounds, bounds[1:]))
    weights = min(max(0.0, m.publish_weights_s), window)
    return dict(zip(STAGES, (reload, rollout, publish, scoring, consume, window - weights, weights, hand_off)))


@dataclass(slots=True)
class DemoRecord:
    """Everything the report shows, filled in by the demo as it runs."""

    verdict_events: list[tuple[float, str, str]] = field(default_factory=list)  # (seconds, group, status)
    stages: list[dict[str, float]] = field(default_factory=list)  # per iteration: stage -> seconds
    scorer_turn_rewards: dict[str, list[float]] = field(default_factory=dict)  # scorer -> per-turn rewards
    advantages: list[tuple[float, float]] = field(default_factory=list)  # per token: (outcome, shaped)
    steps: list[dict[str, Any]] = field(default_factory=list)  # per run and step: update stats, policy_version
    curves: dict[str, Curve] = field(default_factory=dict)  # run -> mean outcome per update (trainer log)
    process_share: list[float] = field(default_factory=list)  # per step: |process| / (|outcome| + |process|)
    end_to_verdict: list[float] = field(default_factory=list)  # per session of the runs: seconds (end_to_verdict)
    group_end_to_verdict: list[float] = field(default_factory=list)  # per group: from its last member's end
    topic_records: dict[str, int] = field(default_factory=dict)  # the trajectories topic's records by kind
    learning_verdict: str = ""
    token_views_html: str = ""
    summary: list[str] = field(default_factory=list)


def end_to_verdict(rec: DemoRecord) -> list[dict[str, Any]]:
    """End -> verdict latency, p50 / p99 / max (nearest rank), in two rows.

    A session's figure runs from the moment the broker acknowledged its ``end`` (the
    proxy's flush after it returned) to the moment the demo's verdict tail (a group-less
    consumer of the verdicts topic, in the demo's process: one clock) first received its
    group's verdict. A group is decided only once its last member ended, so the first
    row's earlier members also wait for their siblings' rollouts; the second row, from
    each group's last ``end``, is the pipeline's own part: the work left at the end.
    """
    rows = []
    for label, over, values in (
        ("a session's end", "sessions", rec.end_to_verdict),
        ("its group's last end", "groups", rec.group_end_to_verdict),
    ):
        row: dict[str, Any] = {"end -> verdict, from": label, "over": over, "n": len(values)}
        for name, q in (("p50 (s)", 50.0), ("p99 (s)", 99.0), ("max (s)", 100.0)):
            value = percentile(values, q)
            row[name] = "" if value is None else value
        rows.append(row)
    return rows


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _statuses(rec: DemoRecord) -> bytes:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    events = sorted(rec.verdict_events)
    for status, colour in (("accepted", "tab:green"), ("rejected", "tab:red"), ("discarded", "tab:gray")):
        times = [t for t, _, s in events if s == status]
        if times:
            end = max(t for t, _, _ in events)
            ax.step(
                [0.0, *times, end],
                [0, *range(1, len(times) + 1), len(times)],
                where="post",
                label=status,
                color=colour,
                marker="o",
                markevery=list(range(1, len(times) + 1)),
                markersize=3,
            )
    ax.set_xlabel("seconds since the first publish")
    ax.set_ylabel("verdicts (cumulative)")
    ax.legend()
    ax.grid(alpha=0.3)
    return _png(fig)


def _latency(rec: DemoRecord) -> bytes:
    return _png(latency_figure(rec))


def latency_figure(rec: DemoRecord) -> Any:
    """The per-stage latency chart: one stacked bar per iteration (a matplotlib figure)."""
    import matplotlib.pyplot as plt

    # constrained layout keeps the legend (below the axes) and the tick labels inside the figure
    fig, ax = plt.subplots(figsize=(8, 4.2), layout="constrained")
    names = list(dict.fromkeys(k for s in rec.stages for k in s))
    bottom = [0.0] * len(rec.stages)
    xs = list(range(len(rec.stages)))
    for name in names:
        vals = [s.get(name, 0.0) for s in rec.stages]
        ax.bar(xs, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    step = -(-len(xs) // 20) or 1  # plain numbers, at most 20 of them: every iteration up to 20
    ax.set_xticks(xs[::step], [str(i) for i in xs[::step]])
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    if names:
        fig.legend(fontsize=8, loc="outside lower center", ncol=4, frameon=False)
    ax.grid(alpha=0.3, axis="y")
    return fig


def _rewards(rec: DemoRecord) -> bytes:
    import matplotlib.pyplot as plt

    names = sorted(rec.scorer_turn_rewards)
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(3.2 * max(1, len(names)), 3), squeeze=False)
    for ax, name in zip(axes[0], names):
        ax.hist(rec.scorer_turn_rewards[name], bins=20, color="tab:blue")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("per-turn reward (weighted)")
    axes[0][0].set_ylabel("turns")
    return _png(fig)


def _advantages(rec: DemoRecord) -> bytes:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    if rec.advantages:
        xs, ys = zip(*rec.advantages)
        ax.scatter(xs, ys, s=4, alpha=0.35)
        lo, hi = min(min(xs), min(ys)), max(max(xs), max(ys))
        ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8, ls="--", label="shaped = outcome")
        ax.legend(fontsize=8)
    ax.set_xlabel("outcome advantage (GRPO)")
    ax.set_ylabel("shaped advantage")
    ax.grid(alpha=0.3)
    return _png(fig)


_COLOURS = {"outcome": "tab:gray", "process": "tab:blue"}


def _learning(rec: DemoRecord) -> bytes:
    import matplotlib.pyplot as plt

    fig, (ax, share_ax) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    for run, curve in rec.curves.items():
        xs = list(range(len(curve.mean)))
        lo = [max(0.0, m - s) for m, s in zip(curve.mean, curve.sd)]
        hi = [min(1.0, m + s) for m, s in zip(curve.mean, curve.sd)]
        colour = _COLOURS.get(run)
        ax.plot(xs, curve.mean, marker="o", color=colour, label=RUNS.get(run, run))
        ax.fill_between(xs, lo, hi, color=colour, alpha=0.2)
    ax.set_xlabel("policy version that sampled the rollouts (= updates so far)")
    ax.set_ylabel("mean outcome (band: +-1 s.d. over groups)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    if rec.process_share:
        share_ax.plot(range(1, len(rec.process_share) + 1), rec.process_share, marker="o", color=_COLOURS["process"])
    share_ax.set_ylim(0, 1)
    share_ax.set_xlabel("update")
    share_ax.set_title("process-reward share of |advantage|", fontsize=10)
    share_ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def _training(rec: DemoRecord) -> bytes:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    runs = list(dict.fromkeys(str(s.get("run", "")) for s in rec.steps))
    for run in runs:
        rows = [s for s in rec.steps if str(s.get("run", "")) == run]
        steps = [int(s["step"]) for s in rows]
        label = RUNS.get(run, run or "policy")
        colour = _COLOURS.get(run)
        axes[0].plot(steps, [s["update/loss"] for s in rows], marker="o", color=colour, label=label)
        axes[1].plot(steps, [s["update/ratio_mean"] for s in rows], marker="o", color=colour, label=label)
        axes[1].fill_between(
            steps, [s["update/ratio_min"] for s in rows], [s["update/ratio_max"] for s in rows], alpha=0.2, color=colour
        )
        axes[2].step(steps, [s["policy_version"] for s in rows], where="post", marker="o", color=colour, label=label)
    axes[0].set_title("PPO-clip loss", fontsize=10)
    axes[1].set_title("importance ratio (mean, min..max)", fontsize=10)
    axes[2].set_title("policy version after the step", fontsize=10)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


_FIGURES = {
    "learning": _learning,
    "statuses": _statuses,
    "latency": _latency,
    "rewards": _rewards,
    "advantages": _advantages,
    "training": _training,
}


def _table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td>{v:.4g}</td>" if isinstance(v, float) else f"<td>{html.escape(str(v))}</td>"
            for v in (r.get(c, "") for c in cols)
        )
        + "</tr>"
        for r in rows
    )
    return f"<div style='overflow-x:auto'><table class='data'><tr>{head}</tr>{body}</table></div>"


def _curve_rows(rec: DemoRecord) -> list[dict[str, Any]]:
    """One row per update: each run's mean outcome and band, the process share."""
    n = max((len(c.mean) for c in rec.curves.values()), default=0)
    rows = []
    for i in range(n):
        row: dict[str, Any] = {"policy version": i}
        for run, c in rec.curves.items():
            if i < len(c.mean):
                row[f"{RUNS.get(run, run)}: mean outcome"] = c.mean[i]
                row[f"{RUNS.get(run, run)}: s.d. over groups"] = c.sd[i]
        if i < len(rec.process_share):
            row["process share"] = rec.process_share[i]
        rows.append(row)
    return rows


def write_report(rec: DemoRecord, out_dir: str | Path) -> Path:
    """Write ``out_dir/index.html`` (and one PNG per figure beside it); return the page's path."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts: dict[str, str] = {
        "summary": "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in rec.summary) + "</ul>",
        "token-views": "<p>Output tokens coloured by their process reward (the weighted sum over scorers: green "
        "positive, red negative; hover for the value); grey text is prompt and environment. Under "
        "each turn: every scorer's turn result and the judge's votes with their texts.</p>" + rec.token_views_html,
    }
    for key, draw in _FIGURES.items():
        png = draw(rec)
        (out / f"{key}.png").write_bytes(png)
        data = base64.b64encode(png).decode()
        parts[key] = f"<img alt='{html.escape(SECTIONS[key])}' src='data:image/png;base64,{data}'>"
    parts["learning"] = (
        f"<p class='verdict'>{html.escape(rec.learning_verdict)}</p>" + parts["learning"] + _table(_curve_rows(rec))
    )
    latency = end_to_verdict(rec)
    parts["latency"] = (
        "<p>Streamed sessions: each turn is published as it is sampled, the end with the outcome after the "
        "session's last turn; the workers judge turns as they arrive.</p>"
        + _table(latency)
        + parts["latency"]
        + _table(rec.stages)
    )
    parts["training"] += _table(rec.steps)
    curves = {
        "curves": [c.as_dict() for c in rec.curves.values()],
        "process_share": rec.process_share,
        "reading": reading_dict(rec.curves) if rec.curves else {},
        "verdict": rec.learning_verdict,
    }
    (out / "learning-curves.json").write_text(json.dumps(curves, indent=1), encoding="utf-8")
    streaming = {"end_to_verdict": latency, "trajectories_topic": rec.topic_records}
    (out / "streaming.json").write_text(json.dumps(streaming, indent=1), encoding="utf-8")
    body = "".join(
        f"<section id='{key}'><h2>{html.escape(title)}</h2>{parts[key]}</section>" for key, title in SECTIONS.items()
    )
    page = (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>prm-pipeline demo report</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto;padding:12px}"
        "table.data{border-collapse:collapse;font-size:12px}table.data td,table.data th{border:1px solid #ddd;"
        "padding:2px 6px}img{max-width:100%}p.verdict{font-size:1.1em;background:#f4f8ff;padding:8px}</style>"
        "</head><body><h1>prm-pipeline demo report</h1>"
        f"{body}</body></html>"
    )
    path = out / "index.html"
    path.write_text(page, encoding="utf-8")
    return path
