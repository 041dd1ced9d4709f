"""The demo's learning curves: mean outcome per update for each run, from two sources.

The demo trains two runs side by side (``outcome``: GRPO on the outcome alone;
``process``: the outcome advantage plus the process rewards). Their groups are named
``<run>-it<update>-p<prompt>``, so every accepted verdict says which run and which
update it fed. A curve can then be read

* from the **verdicts** (:func:`curves_from_verdicts`: the session ``outcome_reward``\\ s
  the workers passed on), and
* from the **trainer log** (:func:`curves_from_trainer_log`: the outcomes the trainer
  actually trained on at each step, one line per run and step).

The report draws the trainer log's numbers; :func:`check_run` reads a report directory
and says where the three (verdicts, trainer log, the report's ``learning-curves.json``)
disagree. :func:`verdict_text` is the report's one-paragraph reading of the curves,
computed from them. Pure Python: no torch, no matplotlib.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "RUNS",
    "Curve",
    "check_run",
    "curves_from_trainer_log",
    "curves_from_verdicts",
    "group_id",
    "parse_group_id",
    "reading_dict",
    "verdict_text",
]

RUNS: dict[str, str] = {"outcome": "outcome only", "process": "with process rewards"}
"""Run name -> the label the report uses."""

_GROUP = re.compile(r"^(?P<run>[a-z]+)-it(?P<it>\d+)-p(?P<prompt>\d+)$")
TOLERANCE = 1e-9


def group_id(run: str, update: int, prompt: int) -> str:
    """The id of ``run``'s ``prompt``-th group sampled for update ``update`` (0-based)."""
    return f"{run}-it{update}-p{prompt}"


def parse_group_id(gid: str) -> tuple[str, int] | None:
    """``(run, update)`` of a learning-run group id, None for any other group."""
    m = _GROUP.match(gid)
    if m is None or m["run"] not in RUNS:
        return None
    return m["run"], int(m["it"])


@dataclass(slots=True)
class Curve:
    """One run's mean outcome per update, with each update's per-group means."""

    run: str
    groups: list[dict[str, float]] = field(default_factory=list)  # per update: group id -> mean outcome

    @property
    def mean(self) -> list[float]:
        return [sum(g.values()) / len(g) if g else math.nan for g in self.groups]

    @property
    def sd(self) -> list[float]:
        """Standard deviation of the group means (the band)."""
        out = []
        for g in self.groups:
            vals = list(g.values())
            mu = sum(vals) / len(vals) if vals else math.nan
            out.append(math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals)) if vals else math.nan)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "label": RUNS.get(self.run, self.run),
            "mean": self.mean,
            "sd": self.sd,
            "groups": self.groups,
        }


def _curves(per_group: Mapping[str, list[float]]) -> dict[str, Curve]:
    by_run: dict[str, dict[int, dict[str, float]]] = {}
    for gid, outcomes in per_group.items():
        parsed = parse_group_id(gid)
        if parsed is None or not outcomes:
            continue
        run, it = parsed
        by_run.setdefault(run, {}).setdefault(it, {})[gid] = sum(outcomes) / len(outcomes)
    curves = {}
    for run in RUNS:
        its = by_run.get(run, {})
        if its:
            curves[run] = Curve(run, [dict(sorted(its.get(i, {}).items())) for i in range(max(its) + 1)])
    return curves


def curves_from_verdicts(records: Iterable[Mapping[str, Any]]) -> dict[str, Curve]:
    """Curves from verdict JSON lines (``infra.jsonl.dump_verdict``): accepted groups only."""
    per_group: dict[str, list[float]] = {}
    for r in records:
        if r.get("status") == "accepted" and parse_group_id(str(r.get("group_id"))) is not None:
            per_group[r["group_id"]] = [float(s["outcome_reward"]) for s in r["sessions"]]
    return _curves(per_group)


def curves_from_trainer_log(lines: Iterable[Mapping[str, Any]]) -> dict[str, Curve]:
    """Curves from the demo's ``trainer-log.jsonl`` (``groups``: group id -> the session
    outcomes the trainer's batch held for it)."""
    per_group: dict[str, list[float]] = {}
    for line in lines:
        for gid, outcomes in line["groups"].items():
            per_group[gid] = [float(x) for x in outcomes]
    return _curves(per_group)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _diff(name: str, a: Mapping[str, Curve], b: Mapping[str, Any]) -> list[str]:
    problems = []
    for run in sorted(set(a) | set(b)):
        if run not in a or run not in b:
            problems.append(f"{name}: run {run!r} missing on one side")
            continue
        want = b[run] if isinstance(b[run], dict) else b[run].as_dict()
        got = a[run].as_dict()
        if got["groups"] != want["groups"] and not _close_groups(got["groups"], want["groups"]):
            problems.append(f"{name}: run {run!r} per-group outcomes differ")
        if len(got["mean"]) != len(want["mean"]) or any(
            abs(x - y) > TOLERANCE for x, y in zip(got["mean"], want["mean"])
        ):
            problems.append(f"{name}: run {run!r} mean outcome {got['mean']} != {want['mean']}")
    return problems


def _close_groups(a: Sequence[Mapping[str, float]], b: Sequence[Mapping[str, float]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(abs(x[k] - y[k]) <= TOLERANCE for k in x) for x, y in zip(a, b)
    )


def check_run(out_dir: str | Path) -> list[str]:
    """Compare a report directory's verdicts, trainer log and ``learning-curves.json``.

    Returns one line per disagreement (empty: the report's curves are the verdicts' and
    the trainer's). Every update must hold groups in every run.
    """
    out = Path(out_dir)
    from_verdicts = curves_from_verdicts(_jsonl(out / "verdicts.jsonl"))
    from_log = curves_from_trainer_log(_jsonl(out / "trainer-log.jsonl"))
    reported = {c["run"]: c for c in json.loads((out / "learning-curves.json").read_text())["curves"]}
    problems = _diff("verdicts vs trainer log", from_verdicts, {k: v.as_dict() for k, v in from_log.items()})
    problems += _diff("trainer log vs report", from_log, reported)
    for run, curve in from_log.items():
        if any(not g for g in curve.groups):
            problems.append(f"trainer log: run {run!r} has an update without groups")
    return problems


@dataclass(frozen=True, slots=True)
class Reading:
    """The numbers :func:`verdict_text` states, kept for tests and the JSON file."""

    updates: int
    window: int
    final: dict[str, float]
    first: dict[str, float]
    reached_half: dict[str, int | None]
    spread: dict[str, float]  # s.d. of the group means over the final window's updates (the bands there)


def _sd(values: Sequence[float]) -> float:
    if not values:
        return math.nan
    mu = sum(values) / len(values)
    return math.sqrt(sum((v - mu) ** 2 for v in values) / len(values))


def _reading(curves: Mapping[str, Curve], window: int = 3) -> Reading:
    means = {run: c.mean for run, c in curves.items()}
    n = min((len(m) for m in means.values()), default=0)
    w = max(1, min(window, n))
    final = {run: sum(m[n - w : n]) / w for run, m in means.items()} if n else {}
    first = {run: m[0] for run, m in means.items()} if n else {}
    reached = {run: next((i + 1 for i, x in enumerate(m[:n]) if x >= 0.5), None) for run, m in means.items()}
    spread = {run: _sd([x for g in c.groups[n - w : n] for x in g.values()]) for run, c in curves.items()} if n else {}
    return Reading(updates=n, window=w, final=final, first=first, reached_half=reached, spread=spread)


def verdict_text(curves: Mapping[str, Curve], shares: Sequence[float] = (), window: int = 3) -> str:
    """A short reading of the two curves, every number from the data."""
    r = _reading(curves, window)
    if r.updates == 0 or set(r.final) != set(RUNS):
        return "Not enough updates in both runs to compare them."
    p, o = r.final["process"], r.final["outcome"]
    p0, o0 = r.first["process"], r.first["outcome"]
    span = f"the last {r.window} updates" if r.window > 1 else "the last update"

    def half(run: str) -> str:
        k = r.reached_half[run]
        return f"first reached 0.5 at update {k}" if k is not None else "never reached 0.5"

    # a claim either way only when the difference is larger than the spread the curves' bands show
    spread = max(r.spread["process"], r.spread["outcome"])
    beyond = abs(p - o) > spread
    if not beyond:
        lead = "No difference beyond the spread between groups"
    elif p > o:
        lead = "Process rewards helped"
    else:
        lead = "Process rewards did not help here"
    text = (
        f"{lead}: with process rewards the mean outcome reached {p:.2f} after {r.updates} updates "
        f"(mean of {span}; {half('process')}); with the outcome alone, {o:.2f} ({half('outcome')}). "
        f"The difference, {p - o:+.2f}, is {'larger' if beyond else 'not larger'} than the spread between "
        f"groups over {span} (s.d. {r.spread['process']:.2f} with process rewards, "
        f"{r.spread['outcome']:.2f} without: the bands). "
        + (
            f"Both started at {p0:.2f} (same seed: the same first rollouts)."
            if p0 == o0
            else f"They started at {p0:.2f} / {o0:.2f}."
        )
    )
    if shares:
        text += (
            f" Process rewards were {100 * sum(shares) / len(shares):.0f}% of the advantage's magnitude "
            f"on average (range {100 * min(shares):.0f}–{100 * max(shares):.0f}%)."
        )
    return text


def reading_dict(curves: Mapping[str, Curve], window: int = 3) -> dict[str, Any]:
    return asdict(_reading(curves, window))
