"""The demo report parses and holds every section; ``inspect`` renders a branching session."""

from __future__ import annotations

import argparse
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from prm_pipeline.demo.curves import Curve
from prm_pipeline.demo.fake_judge import FakeJudgeServer
from prm_pipeline.demo.report import SECTIONS, DemoRecord, end_to_verdict, write_report
from prm_pipeline.token_view import branch_views, cmd_inspect, load_audit, render_html, render_terminal, verdict_record
from scoring_workers.scorers.openclaw import OpenClawJudgeScorer
from tests import real_model
from tests.real_model import one_torch_thread  # noqa: F401 - autouse fixture


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, list[dict[str, str]]] = {}
        self.current: str | None = None
        self.external: list[str] = []
        self.token_spans = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "section":
            self.current = a["id"]
            self.sections[self.current] = []
        elif self.current is not None:
            self.sections[self.current].append({"tag": tag, **a})
        if tag in ("script", "link") or (a.get("src", "") and not a["src"].startswith("data:")):
            self.external.append(tag)
        if tag == "span" and a.get("title", "").startswith("reward"):
            self.token_spans += 1


@pytest.fixture(scope="module")
async def branching_verdict(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    proxy = real_model.proxy(seed=5)
    sessions = [
        proxy.session("g-view", 0, "compute 1 + 1", turns=3, branch=True),
        proxy.session("g-view", 1, "compute 1 + 1", turns=1, branch=False),
    ]
    audit: list[dict] = []
    with FakeJudgeServer() as judge:
        judge_scorer = OpenClawJudgeScorer(base_url=judge.base_url, m=3, temperature=0.0, audit_sink=audit.append)
        try:
            verdict = await real_model.verdict(
                "g-view", sessions, [real_model.TokenIdScorer(weight=0.01), judge_scorer]
            )
        finally:
            await judge_scorer.aclose()  # its judge limits stay registered (and in the metrics) until closed
    path = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in audit))
    assert audit, "the judge scored turns with a next state"
    return verdict_record(verdict), path


async def test_inspect_renders_both_branches_of_a_branching_session(branching_verdict, capsys) -> None:
    record, audit_path = branching_verdict
    views = branch_views(record, load_audit(audit_path))
    s0 = [v for v in views if v.session_id == "g-view-s0"]
    assert sorted(v.leaf_id for v in s0) == ["g-view-s0-t1b", "g-view-s0-t2"]
    assert all(v.branching for v in s0) and all(v.policy_version == 0 for v in s0)
    # the shared first turn is the same turn in both branches; the forks differ
    assert s0[0].turns[0].output_ids == s0[1].turns[0].output_ids
    # every output token is shown with its reward, and turns carry scorer results and votes
    html = render_html(s0)
    page = _Page()
    page.feed(html)
    assert page.token_spans == sum(len(t.output_ids) for v in s0 for t in v.turns)
    assert "openclaw_judge" in html and "token_id" in html and "votes" in html and "boxed" in html
    render_terminal(s0)
    out = capsys.readouterr().out
    assert "g-view-s0-t1b" in out and "openclaw_judge" in out


async def test_inspect_command_writes_html_from_a_verdict_file(branching_verdict, tmp_path: Path) -> None:
    record, audit_path = branching_verdict
    verdicts = tmp_path / "verdicts.jsonl"
    verdicts.write_text(json.dumps(record) + "\n")
    out = tmp_path / "view.html"
    args = argparse.Namespace(
        verdicts=str(verdicts),
        group=None,
        audit=str(audit_path),
        session="g-view-s0",
        max_groups=3,
        html=str(out),
        no_terminal=True,
        config=None,
        timeout=1.0,
    )
    assert cmd_inspect(args) == 0
    assert out.read_text().count('class="branch"') == 2
    without_tokens = dict(
        record, sessions=[{k: v for k, v in s.items() if k != "interactions"} for s in record["sessions"]]
    )
    verdicts.write_text(json.dumps(without_tokens) + "\n")
    assert cmd_inspect(args) == 1  # says it needs the token-backed interactions


async def test_report_parses_and_holds_every_section(branching_verdict, tmp_path: Path) -> None:
    record, audit_path = branching_verdict
    rec = DemoRecord(
        verdict_events=[
            (0.1, "a", "accepted"),
            (0.2, "b", "discarded"),
            (0.5, "c", "rejected"),
            (0.6, "d", "accepted"),
        ],
        stages=[
            {"rollout": 0.5, "scoring": 0.3, "train step": 0.1},
            {"rollout": 0.4, "scoring": 0.2, "train step": 0.1},
        ],
        scorer_turn_rewards={"openclaw_judge": [0.5, -0.5, 0.0], "opd_teacher": [0.01, -0.02]},
        advantages=[(1.0, 1.2), (-1.0, -1.3), (0.0, 0.1)],
        steps=[
            {
                "step": float(i),
                "run": run,
                "policy_version": float(i),
                "update/loss": 0.1,
                "update/ratio_mean": 1.0,
                "update/ratio_min": 0.9,
                "update/ratio_max": 1.1,
            }
            for i in (1, 2, 3)
            for run in ("outcome", "process")
        ],
        curves={
            "outcome": Curve(
                "outcome",
                [{"outcome-it0-p0": 0.25, "outcome-it0-p1": 0.0}, {"outcome-it1-p0": 0.25, "outcome-it1-p1": 0.25}],
            ),
            "process": Curve(
                "process",
                [{"process-it0-p0": 0.25, "process-it0-p1": 0.0}, {"process-it1-p0": 0.5, "process-it1-p1": 0.75}],
            ),
        },
        process_share=[0.3, 0.25],
        end_to_verdict=[0.9, 0.2, 0.4, 0.3],
        group_end_to_verdict=[0.2, 0.3],
        topic_records={"discard": 3, "end": 4, "turn": 12},
        learning_verdict="computed elsewhere",
        token_views_html=render_html(branch_views(record, load_audit(audit_path))),
        summary=["3 policy updates"],
    )
    path = write_report(rec, tmp_path / "report")
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    assert list(page.sections) == list(SECTIONS)
    assert list(SECTIONS)[0] == "learning"  # the first picture is the two learning curves
    for key in ("learning", "statuses", "latency", "rewards", "advantages", "training"):
        imgs = [e for e in page.sections[key] if e["tag"] == "img"]
        assert len(imgs) == 1 and imgs[0]["src"].startswith("data:image/png;base64,"), key
        assert (tmp_path / "report" / f"{key}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert page.external == []  # opens without network
    assert page.token_spans > 0
    saved = json.loads((tmp_path / "report" / "learning-curves.json").read_text())
    assert [c["run"] for c in saved["curves"]] == ["outcome", "process"]
    assert saved["curves"][1]["mean"] == [0.125, 0.625] and saved["process_share"] == [0.3, 0.25]
    assert saved["verdict"] == "computed elsewhere" and saved["reading"]["updates"] == 2
    streaming = json.loads((tmp_path / "report" / "streaming.json").read_text())
    assert streaming["trajectories_topic"] == {"discard": 3, "end": 4, "turn": 12}
    sessions, groups = streaming["end_to_verdict"]
    assert (sessions["n"], sessions["p50 (s)"], sessions["p99 (s)"]) == (4, 0.3, 0.9)
    assert (groups["n"], groups["p50 (s)"], groups["p99 (s)"]) == (2, 0.2, 0.3)
    tables = [e for e in page.sections["latency"] if e["tag"] == "table"]
    assert len(tables) == 2  # end -> verdict, then the stages per iteration
    latency = path.read_text(encoding="utf-8").split("<section id='latency'>")[1].split("</section>")[0]
    assert "end -&gt; verdict" in latency and "<td>0.9</td>" in latency


def test_end_to_verdict_is_nearest_rank_over_sessions_and_over_groups() -> None:
    rec = DemoRecord(end_to_verdict=[float(i) for i in range(1, 101)], group_end_to_verdict=[0.5])
    sessions, groups = end_to_verdict(rec)
    assert (sessions["over"], sessions["n"], sessions["p50 (s)"], sessions["p99 (s)"], sessions["max (s)"]) == (
        "sessions",
        100,
        50.0,
        99.0,
        100.0,
    )
    assert (groups["over"], groups["n"], groups["p50 (s)"], groups["p99 (s)"]) == ("groups", 1, 0.5, 0.5)
    empty, _ = end_to_verdict(DemoRecord())
    assert empty["n"] == 0 and empty["p50 (s)"] == ""
