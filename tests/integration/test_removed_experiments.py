"""A removed experiment stays readable and auditable: ``experiment remove`` keeps its last
declaration in the registry, and ``verdicts``, ``inspect --group``, ``audit`` and
``dead-letters`` read its topics and say it is removed, while ``publish`` still refuses it.
``experiment forget`` drops the declaration only once its topics are deleted.

Real broker, real Redis, an in-process worker; the commands run in-process through
:func:`prm_pipeline.cli.main` as a user types them.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from infra.experiments import trajectories_topic, verdicts_topic
from infra.kafka import make_admin
from infra.registry import read_registry
from prm_pipeline.cli import main
from prm_pipeline.demo.processes import write_config
from prm_pipeline.demo.synthetic import make_group
from tests.integration.harness import running_worker, with_scorers
from tests.integration.test_fleet import LENGTH, _declare, _publish, _serving, _spec, _verdicts

pytestmark = pytest.mark.integration


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


async def test_a_removed_experiment_is_read_inspected_audited_and_listed_with_a_note(
    pipeline_config, tmp_path, capsys
) -> None:
    cfg = with_scorers(pipeline_config, LENGTH)
    config = str(write_config(cfg, tmp_path / "config.yaml"))
    gid = f"gone-{uuid.uuid4().hex[:6]}"
    spec = _spec("exp-gone", LENGTH)
    async with running_worker(cfg, "w-removed") as worker:
        await _declare(cfg, spec)
        await _serving(worker, "exp-gone")
        await _publish(cfg, "exp-gone", make_group(gid, 2))
        verdict = (await _verdicts(cfg, "exp-gone", {gid}))[gid]
    assert verdict.status == "accepted", verdict.reason

    code, out, err = await _cli(capsys, "--config", config, "experiment", "remove", "exp-gone")
    assert code == 0 and "experiment exp-gone removed" in out, err
    entry = (await read_registry(cfg, removed=True))["exp-gone"]
    assert entry.removal and entry.kept == spec  # the declaration, kept for audit
    assert "exp-gone" not in await read_registry(cfg)  # gone from what `experiment list` and the workers declare

    note = "note: experiment 'exp-gone' was removed from the registry"
    code, out, err = await _cli(
        capsys,
        "--config",
        config,
        "verdicts",
        "--experiment",
        "exp-gone",
        "--from-beginning",
        "--max",
        "1",
        "--idle-timeout",
        "10",
    )
    assert code == 0, err
    assert [json.loads(line)["group_id"] for line in out.splitlines()] == [gid]
    assert note in err

    code, out, err = await _cli(
        capsys, "--config", config, "inspect", "--experiment", "exp-gone", "--group", gid, "--wait", "10"
    )
    assert code == 0 and gid in out and note in err, err

    code, out, err = await _cli(capsys, "--config", config, "audit", "--experiment", "exp-gone", "--groups", gid)
    assert code == 0, err  # re-scored with the kept declaration: identical
    assert note in err and "members: identical 2" in out, out + err

    code, out, err = await _cli(capsys, "--config", config, "dead-letters", "--experiment", "exp-gone")
    assert code == 0 and note in err and "0 dead letters of experiment exp-gone" in err, err

    code, out, err = await _cli(
        capsys, "--config", config, "publish", "--experiment", "exp-gone", "examples/trajectories.jsonl"
    )
    assert code == 2 and "'exp-gone' has no declaration" in err and "removed at offset" in err, err

    code, out, err = await _cli(capsys, "--config", config, "experiment", "forget", "exp-gone")
    assert code == 1 and "still hold its records" in err, err  # its topics are there: the declaration stays
    assert (await read_registry(cfg, removed=True))["exp-gone"].kept == spec
    admin = make_admin(cfg.kafka)
    await admin.start()
    try:
        await admin.delete_topics(
            [trajectories_topic(cfg.topics.trajectories, "exp-gone"), verdicts_topic(cfg.topics.verdicts, "exp-gone")]
        )
    finally:
        await admin.close()
    code, out, err = await _cli(capsys, "--config", config, "experiment", "forget", "exp-gone")
    assert code == 0 and "experiment exp-gone forgotten" in out, err
    entry = (await read_registry(cfg, removed=True))["exp-gone"]
    assert entry.removal and entry.kept is None  # a tombstone: compaction drops the key in time
