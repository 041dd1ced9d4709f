"""``prm-pipeline audit`` against the real pipeline: two worker processes, real broker and Redis.

The workers score a handful of groups (accepted, branched, rejected by a failing
scorer, discarded, with a redelivered trajectory); the audit re-scores everything
in-process and must find it all identical. Then a forged verdict (same group id and
verdict_version, one token reward changed) is published: the audit must report exactly
that group as differing and exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import time
import uuid

import msgspec
import pytest

from infra.config import (
    PipelineConfig,
    PRMScorerConfig,
)
from infra.kafka import make_producer
from infra.schema import TokenRewards, encode
from prm_pipeline.audit import AuditOptions, add_audit_parser, audit
from prm_pipeline.demo.synthetic import make_group, make_session
from prm_pipeline.verdict_dump import _dump, parse_time
from producers.publisher import TrajectoryPublisher
from tests.integration.harness import (
    isolated_config,
    read_topic,
    wait_for_verdicts,
    worker_processes,
    write_config,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cfg(kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    name = f"audit-{uuid.uuid4().hex[:8]}"
    return isolated_config(
        name,
        kafka_bootstrap,
        redis_url,
        scorer_timeout_s=5,
        group_timeout_s=30,
        scorers=[
            PRMScorerConfig("examples.prm.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 32}),
            PRMScorerConfig("tests.scorers.FailOnMarkerScorer"),
        ],
    )


@pytest.fixture(scope="module")
async def workers(cfg: PipelineConfig, tmp_path_factory: pytest.TempPathFactory):
    async with worker_processes(cfg, tmp_path_factory.mktemp("audit-workers")) as procs:
        yield procs


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prm-pipeline")
    parser.add_argument("--config")
    add_audit_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


async def test_audit_finds_nothing_then_exactly_the_forged_verdict(cfg, workers, tmp_path) -> None:
    run = uuid.uuid4().hex[:6]
    # mixed lengths (1.0 and 0.0 turns); plain1 has 16-token turns (all 1.0): the one forged below
    plain = [make_group(f"plain{i}-{run}", 2, turns=2, output_tokens=16 if i == 1 else (8, 48)) for i in range(3)]
    gb = f"branch-{run}"
    branched = [
        make_session(
            trajectory_id=f"{gb}-x",
            session_id=f"{gb}-x",
            group_id=gb,
            group_size=1,
            turns=3,
            branch_at=0,
            output_tokens=16,
        )
    ]
    gr = f"rej-{run}"
    rejected = [
        make_session(
            trajectory_id=f"{gr}-ok", session_id=f"{gr}-ok", group_id=gr, group_size=2, turns=2, output_tokens=16
        ),
        make_session(
            trajectory_id=f"{gr}-bad", session_id=f"{gr}-FAIL", group_id=gr, group_size=2, turns=2, output_tokens=16
        ),
    ]
    gd = f"disc-{run}"
    groups = [m[0].group_id for m in plain] + [gb, gr, gd]
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        await pub.discard_group(gd, "prompt filtered")
        for members in (*plain, branched, rejected):
            await pub.publish_many(members)
        await pub.publish_many([plain[0][0]])  # a redelivered member: acknowledged, not re-verdicted
        await pub.publish_many(make_group(gd, 1, turns=1, output_tokens=16))  # after its discard: dropped
    verdicts = {v.group_id: v for v in await wait_for_verdicts(cfg, groups)}
    assert verdicts[gr].status == "rejected" and verdicts[gd].status == "discarded"
    assert all(verdicts[g].status == "accepted" for g in groups[:4])

    # ---- 1. the audit re-scores everything and finds it identical
    out = io.StringIO()
    report = await audit(cfg, AuditOptions(progress=False), stdout=out, stderr=out)
    found = report.by_group()
    assert set(found) == set(groups), out.getvalue()
    assert report.counts == {
        "identical": len(groups),
        "differs": 0,
        "not_rescorable": 0,
        "verdict_without_trajectory": 0,
        "trajectory_without_verdict": 0,
    }, [(f.group_id, f.outcome, f.differences[:2], f.notes[:2]) for f in report.findings if f.outcome != "identical"]
    assert report.exit_code == 0
    assert found[gr].sessions == {"identical": 2}  # the failed member failed again, with the same code
    assert found[gd].status == "discarded" and found[gd].sessions == {}  # discarded before members arrived
    assert any("in no verdict" in note for note in found[gd].notes)  # the late member is noted, not a finding
    assert "identical" in out.getvalue() and "--from-offsets" in out.getvalue()

    # ---- 2. forge a verdict for one group: same key, one token reward changed
    before_forgery_ms = int(time.time() * 1000)
    await asyncio.sleep(0.05)
    target = plain[1][0].group_id
    original = verdicts[target]
    session = original.sessions[0]
    branch = session.branches[0]
    turn = branch.path[-1]
    values = branch.token_rewards[turn].to_numpy().copy()
    values[-1] += 0.25
    forged_branch = msgspec.structs.replace(
        branch, token_rewards={**branch.token_rewards, turn: TokenRewards.from_array(values)}
    )
    forged = msgspec.structs.replace(
        original,
        sessions=[
            msgspec.structs.replace(session, branches=[forged_branch, *session.branches[1:]]),
            *original.sessions[1:],
        ],
    )
    assert forged.group_id == original.group_id and forged.verdict_version == original.verdict_version
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        value, headers = encode(forged)
        await producer.send_and_wait(cfg.topics.verdicts, value, key=target.encode(), headers=headers)
    finally:
        await producer.stop()
    await read_topic(cfg, cfg.topics.verdicts)  # published and visible

    # ---- 3. the audit, through its command-line entry point, reports exactly that group
    report_path = tmp_path / "report.jsonl"
    config_path = write_config(cfg, tmp_path / "config.yaml")
    args = _cli(["--config", str(config_path), "audit", "--out", str(report_path), "--quiet"])
    code = await asyncio.to_thread(args.func, args)
    assert code == 1
    lines = [json.loads(line) for line in report_path.read_text().splitlines()]
    assert sorted(line["group_id"] for line in lines) == sorted(groups)  # one line per group
    differing = [line for line in lines if line["outcome"] != "identical"]
    assert [line["group_id"] for line in differing] == [target], differing
    (finding,) = differing
    assert finding["outcome"] == "differs" and finding["distinct_verdicts"] == 2
    assert finding["max_abs_diff"] == pytest.approx(0.25)
    by_kind = {d["kind"]: d for d in finding["differences"]}
    assert set(by_kind) == {"token_rewards", "conflicting_verdicts"}
    diff = by_kind["token_rewards"]
    assert (diff["trajectory_id"], diff["session_id"], diff["leaf_id"], diff["turn"]) == (
        session.trajectory_id,
        session.session_id,
        branch.leaf_id,
        turn,
    )
    assert diff["scorer"] == "length_budget"  # the only scorer with a nonzero share of that turn
    assert diff["index"] == len(values) - 1 and diff["max_abs_diff"] == pytest.approx(0.25)
    assert diff["variant"] == 1  # the second distinct verdict of (group, version 1): the forged one

    # ---- 4. --groups narrows the audit (the forged group alone still differs)
    narrow = await audit(cfg, AuditOptions(groups=[target, gb], progress=False), stdout=out, stderr=out)
    assert {f.group_id: f.outcome for f in narrow.findings} == {target: "differs", gb: "identical"}
    assert narrow.exit_code == 1

    # ---- 5. --since: only records from TIME on; the forged verdict alone has no trajectories in range
    recent = await audit(cfg, AuditOptions(since_ms=before_forgery_ms, progress=False), stdout=out, stderr=out)
    assert [(f.group_id, f.outcome) for f in recent.findings] == [(target, "verdict_without_trajectory")]
    assert recent.exit_code == 0 and recent.records["verdict_records"] == 1

    # ---- 6. `verdicts --since`: the same time filter on the dump (the embedded broker's
    # offsets_for_times answers 0 for times after its last record; the filter still holds)
    dumped = io.StringIO()
    assert (
        await _dump(cfg, dumped, from_beginning=False, max_count=None, timeout_s=1.0, since_ms=before_forgery_ms) == 1
    )
    assert json.loads(dumped.getvalue())["group_id"] == target
    assert (
        await _dump(cfg, io.StringIO(), from_beginning=False, max_count=None, timeout_s=1.0, since_ms=parse_time("10m"))
        >= len(groups) + 1
    )  # + the forgery (+ any redelivery)
