"""The demo's learning curves: read from verdicts and from the trainer log, compared with the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prm_pipeline.demo.curves import (
    Curve,
    check_run,
    curves_from_trainer_log,
    curves_from_verdicts,
    group_id,
    parse_group_id,
    verdict_text,
)
from prm_pipeline.demo.rollout_proxy import Environment

# run -> per update -> per group -> session outcomes
OUTCOMES = {
    "outcome": [[[0, 0, 1, 0], [0, 0, 0, 0]], [[0, 1, 0, 0], [0, 0, 0, 1]], [[1, 0, 0, 0], [0, 0, 0, 1]]],
    "process": [[[0, 0, 1, 0], [0, 0, 0, 0]], [[1, 1, 0, 0], [0, 1, 0, 1]], [[1, 1, 1, 0], [1, 0, 1, 1]]],
}


def _verdicts() -> list[dict]:
    out = [
        {"group_id": "it0-filtered", "status": "discarded", "sessions": []},
        {"group_id": "it0-lost", "status": "rejected", "sessions": [{"outcome_reward": 1.0}]},
    ]
    for run, updates in OUTCOMES.items():
        for it, groups in enumerate(updates):
            for k, sessions in enumerate(groups):
                out.append(
                    {
                        "group_id": group_id(run, it, k),
                        "status": "accepted",
                        "sessions": [
                            {"session_id": f"s{i}", "outcome_reward": float(x)} for i, x in enumerate(sessions)
                        ],
                    }
                )
    return out


def _trainer_log() -> list[dict]:
    return [
        {
            "step": it + 1,
            "run": run,
            "groups": {group_id(run, it, k): [float(x) for x in s] for k, s in enumerate(groups)},
        }
        for it in range(3)
        for run, updates in OUTCOMES.items()
        for groups in [updates[it]]
    ]


def _write_run(tmp: Path, log: list[dict] | None = None, report: dict | None = None) -> Path:
    (tmp / "verdicts.jsonl").write_text("".join(json.dumps(v) + "\n" for v in _verdicts()))
    log = _trainer_log() if log is None else log
    (tmp / "trainer-log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in log))
    if report is None:
        report = {"curves": [c.as_dict() for c in curves_from_trainer_log(log).values()]}
    (tmp / "learning-curves.json").write_text(json.dumps(report))
    return tmp


def test_group_ids_name_run_and_update() -> None:
    assert parse_group_id(group_id("process", 11, 3)) == ("process", 11)
    assert parse_group_id("it0-lost") is None and parse_group_id("demo-warmup") is None
    assert parse_group_id("other-it1-p0") is None  # not one of the two runs


def test_curves_from_verdicts_and_trainer_log_agree() -> None:
    a, b = curves_from_verdicts(_verdicts()), curves_from_trainer_log(_trainer_log())
    assert {k: v.as_dict() for k, v in a.items()} == {k: v.as_dict() for k, v in b.items()}
    assert a["process"].mean == [0.125, 0.5, 0.75]  # mean over groups of each group's mean
    assert a["outcome"].mean == [0.125, 0.25, 0.25]
    assert a["process"].sd[1] == pytest.approx(0.0) and a["outcome"].sd[0] == pytest.approx(0.125)


def test_check_run_passes_on_a_consistent_run(tmp_path: Path) -> None:
    assert check_run(_write_run(tmp_path)) == []


def test_check_run_catches_a_trainer_log_that_differs_from_the_verdicts(tmp_path: Path) -> None:
    log = _trainer_log()
    log[-1]["groups"][group_id("process", 2, 0)] = [0.0, 0.0, 0.0, 0.0]  # trained on other outcomes
    problems = check_run(
        _write_run(tmp_path, log=log, report={"curves": [c.as_dict() for c in curves_from_trainer_log(log).values()]})
    )
    assert problems and all("verdicts vs trainer log" in p for p in problems)


def test_check_run_catches_a_report_that_differs_from_the_trainer_log(tmp_path: Path) -> None:
    curves = [c.as_dict() for c in curves_from_trainer_log(_trainer_log()).values()]
    curves[0]["mean"] = [*curves[0]["mean"][:-1], 0.9]  # a hand-polished last point
    assert check_run(_write_run(tmp_path, report={"curves": curves})) == [
        f"trainer log vs report: run 'outcome' mean outcome {[0.125, 0.25, 0.25]} != {[0.125, 0.25, 0.9]}"
    ]
    assert any("missing" in p for p in check_run(_write_run(tmp_path, report={"curves": curves[1:]})))


def test_verdict_text_is_computed_from_the_curves() -> None:
    curves = curves_from_trainer_log(_trainer_log())
    text = verdict_text(curves, [0.2, 0.4], window=2)
    assert text.startswith(
        "Process rewards helped: with process rewards the mean outcome reached 0.62 after 3 "
        "updates (mean of the last 2 updates; first reached 0.5 at update 2); with the outcome "
        "alone, 0.25 (never reached 0.5). The difference, +0.38, is larger than the spread "
        "between groups over the last 2 updates (s.d. 0.12 with process rewards, 0.00 without"
    )
    assert "Both started at 0.12 (same seed" in text and "30% of the advantage" in text
    swapped = {
        "outcome": Curve("outcome", curves["process"].groups),
        "process": Curve("process", curves["outcome"].groups),
    }
    assert verdict_text(swapped, window=2).startswith(
        "Process rewards did not help here: with process rewards the mean outcome reached 0.25"
    )
    assert verdict_text({}) == "Not enough updates in both runs to compare them."


def test_verdict_text_claims_a_difference_only_beyond_the_spread_between_groups() -> None:
    # the last 2 updates: process group means 0.75/0.25 and 0.5/0.5 (mean 0.5, s.d. 0.18);
    # outcome 0.25/0.25 twice (0.25, s.d. 0): a difference of 0.25, larger than 0.18
    wide = {
        "process": Curve("process", [{"a": 0.0}, {"a": 0.75, "b": 0.25}, {"a": 0.5, "b": 0.5}]),
        "outcome": Curve("outcome", [{"a": 0.0}, {"a": 0.25, "b": 0.25}, {"a": 0.25, "b": 0.25}]),
    }
    assert verdict_text(wide, window=2).startswith("Process rewards helped")
    # the same means, but the process run's groups spread wider than the difference (s.d. 0.40 > 0.25)
    wider = {**wide, "process": Curve("process", [{"a": 0.0}, {"a": 1.0, "b": 0.0}, {"a": 0.75, "b": 0.25}])}
    text = verdict_text(wider, window=2)
    assert text.startswith(
        "No difference beyond the spread between groups: with process rewards the mean outcome reached 0.50"
    )
    assert (
        "The difference, +0.25, is not larger than the spread between groups over the last 2 updates (s.d. 0.40 "
        "with process rewards, 0.00 without" in text
    )
    swapped = {
        "process": Curve("process", wider["outcome"].groups),
        "outcome": Curve("outcome", wider["process"].groups),
    }
    assert verdict_text(swapped, window=2).startswith("No difference beyond the spread")  # symmetric


def test_the_task_outcome_is_sparse_and_the_turn_check_is_what_the_environment_answers() -> None:
    good, bad = "12 34 56", "hello"
    env = Environment()
    assert Environment.passes(good) and not Environment.passes(bad) and Environment.passes("calc 3*4")
    assert env.respond(0, good)["content"].startswith("thanks") and env.respond(1, bad)["content"].startswith("wrong")
    assert env.respond(0, "calc 3*4") == {"role": "tool", "content": "result: 12 (success)"}
    assert Environment.outcome([good, good, good]) == 1.0
    assert Environment.outcome([good, bad, good]) == 0.0  # one failed turn fails the session
    assert Environment.outcome([]) == 0.0
