"""VerdictConsumer against the real broker: status handling, dedupe, commit discipline.

Verdicts are hand-built and published straight to the verdicts topic (no workers), so
every expectation is exact. Waiting is always "poll until a condition, with a
deadline"; the only fixed waits are the idle timeouts that prove nothing more comes.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest

from infra.config import PipelineConfig, TrainerConfig
from infra.kafka import ensure_topics, make_producer
from infra.local import LOCAL_BROKER_CLIENT
from infra.schema import KIND_HEADER, SCHEMA_HEADER, GroupVerdict, encode
from shaper import SqliteDedupeStore, TrainingBatch, VerdictConsumer, run_trainer
from shaper.consumer import DedupeKey
from tests.polling import eventually
from tests.unit.test_batch import accepted_group, simple_session, verdict

pytestmark = pytest.mark.integration

DEADLINE_S = 30.0


def trainer_config(cfg: PipelineConfig, unique_name: str, **trainer: object) -> PipelineConfig:
    return msgspec.structs.replace(
        cfg,
        trainer=TrainerConfig(group_id=f"trainer.{unique_name}", **trainer),  # type: ignore[arg-type]
    )


async def publish(cfg: PipelineConfig, records: Sequence[GroupVerdict | tuple[bytes, list[tuple[str, bytes]]]]) -> None:
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for item in records:
            if isinstance(item, GroupVerdict):
                value, headers = encode(item)
                key = item.group_id.encode()
            else:
                (value, headers), key = item, b"garbage"
            await producer.send(cfg.topics.verdicts, value, key=key, headers=headers)
        await producer.flush()
    finally:
        await producer.stop()


async def collect(consumer: VerdictConsumer, groups: int) -> list[TrainingBatch]:
    """Batches until ``groups`` groups arrived (deadline-bounded)."""
    batches: list[TrainingBatch] = []

    async def read() -> None:
        batch = await consumer.next_batch(idle_timeout_s=1.0)
        if batch is not None:
            batches.append(batch)

    await eventually(
        lambda: sum(b.num_groups for b in batches) >= groups,
        between=read,
        timeout_s=DEADLINE_S,
        what=lambda: f"{groups} groups, not only {[b.group_ids for b in batches]}",
    )
    return batches


async def drain_until(consumer: VerdictConsumer, counter: str, value: float) -> None:
    """Poll (yielding no batch) until ``pipeline/<counter>`` reaches ``value``."""

    async def read_none() -> None:
        batch = await consumer.next_batch(idle_timeout_s=0.5)
        assert batch is None, f"unexpected batch {batch.group_ids}"

    await eventually(
        lambda: consumer.totals().get(f"pipeline/{counter}", 0.0),
        accept=lambda total: total >= value,
        between=read_none,
        timeout_s=DEADLINE_S,
        what=f"{counter} to reach {value}",
    )


def groups_of(batches: Sequence[TrainingBatch]) -> list[str]:
    return sorted(g for b in batches for g in dict.fromkeys(b.group_ids))


async def test_only_accepted_groups_reach_the_trainer_once_each(pipeline_config, unique_name) -> None:
    cfg = trainer_config(pipeline_config, unique_name, batch_groups=2)
    await ensure_topics(cfg.kafka, cfg.topics, [cfg.topics.verdicts])
    stats = {"rollout/prm_turn_reward/len": 0.5, "rollout/prm_turn_reward/len__count": 2.0}
    acc_a = accepted_group("acc-a", stats=stats)
    acc_b = accepted_group("acc-b")
    rejected = verdict(
        "rej", [simple_session("rej-ok", stats=stats)], status="rejected", reason="scorer_error: x", code="scorer_error"
    )
    discarded = verdict("dis", [], status="discarded", reason="environment crashed before turn 2", code="discarded")
    garbage = [(b"\x00not msgpack", [(SCHEMA_HEADER, b"1"), (KIND_HEADER, b"verdict")]), (b"no headers", [])]
    await publish(cfg, [acc_a, rejected, garbage[0], discarded, acc_b, acc_a, garbage[1]])

    async with VerdictConsumer(cfg) as consumer:
        batches = await collect(consumer, 2)
        await drain_until(consumer, "verdicts/undecodable", 2)
        await drain_until(consumer, "verdicts/duplicate", 1)
        totals = consumer.totals()

    assert groups_of(batches) == ["acc-a", "acc-b"]
    assert sum(b.batch_size for b in batches) == 4  # two members each, one branch each
    counters = {k: v for k, v in totals.items() if k.startswith("pipeline/")}
    assert counters["pipeline/verdicts/accepted"] == 2
    assert counters["pipeline/verdicts/rejected"] == 1
    assert counters["pipeline/verdicts/rejected/scorer_error"] == 1
    assert counters["pipeline/verdicts/discarded"] == 1
    assert counters["pipeline/verdicts/discarded/discarded"] == 1  # the code, never the discard's text
    assert not [k for k in counters if "environment" in k]
    assert counters["pipeline/verdicts/duplicate"] == 1
    assert counters["pipeline/verdicts/undecodable"] == 2
    # The rejected group's scored member counts in the metrics (seed), weighted by count.
    assert totals["rollout/prm_turn_reward/len__count"] == 6.0
    assert totals["rollout/prm_turn_reward/len"] == pytest.approx(0.5)
    batch = batches[0]
    assert str(batch.input_ids.dtype) == "torch.int64" and bool(batch.loss_mask.any())
    assert batch.metrics["pipeline/groups/batched"] == batch.num_groups


async def test_group_filter_and_unexportable_groups_are_dropped_and_counted(pipeline_config, unique_name) -> None:
    cfg = trainer_config(pipeline_config, unique_name, batch_groups=1, filter="filter_mixed_or_penalized_all_wrong")
    await ensure_topics(cfg.kafka, cfg.topics, [cfg.topics.verdicts])
    all_correct = accepted_group("all-correct", (1.0, 1.0))
    mixed = accepted_group("mixed", (1.0, 0.0))
    good = simple_session("broken-s0")
    broken = verdict(
        "broken",
        [
            msgspec.structs.replace(
                good, branches=[msgspec.structs.replace(good.branches[0], leaf_id="nope", path=["nope"])]
            )
        ],
    )
    await publish(cfg, [all_correct, broken, mixed])
    async with VerdictConsumer(cfg) as consumer:
        batches = await collect(consumer, 1)
        await drain_until(consumer, "groups/dropped/concat_export_error", 1)
        totals = consumer.totals()
    assert groups_of(batches) == ["mixed"]
    assert totals["pipeline/filter/rejected_by_all_correct"] == 1
    assert totals["pipeline/filter/accepted_mixed"] == 1
    assert totals["pipeline/groups/dropped/filtered"] == 1
    assert totals["pipeline/groups/dropped/concat_export_error/branch_mismatch"] == 1


async def test_redelivery_is_deduplicated_by_the_same_instance(pipeline_config, unique_name) -> None:
    cfg = trainer_config(pipeline_config, unique_name, batch_groups=2)
    await ensure_topics(cfg.kafka, cfg.topics, [cfg.topics.verdicts])
    await publish(cfg, [accepted_group("g1"), accepted_group("g2")])

    first = VerdictConsumer(cfg)
    await first.start()
    got = await collect(first, 2)
    assert groups_of(got) == ["g1", "g2"]
    await first.stop(commit=False)  # like a crash, for Kafka: nothing committed

    # Same instance, restarted: Kafka redelivers both, the seen-set drops them.
    await first.start()
    await drain_until(first, "verdicts/duplicate", 2)
    await first.aclose(commit=False)

    # A fresh instance without a durable store: unacknowledged work comes back
    # (at-least-once); acknowledging it commits the offsets.
    second = VerdictConsumer(cfg)
    await second.start()
    again = await collect(second, 2)
    assert groups_of(again) == ["g1", "g2"]
    await second.commit()
    await second.aclose(commit=False)

    # Committed: a third consumer in the group sees nothing.
    async with VerdictConsumer(cfg) as third:
        assert await third.next_batch(idle_timeout_s=3.0) is None
        assert third.totals().get("pipeline/verdicts/accepted", 0.0) == 0.0


async def test_asking_for_the_next_batch_acknowledges_the_previous(pipeline_config, unique_name) -> None:
    cfg = trainer_config(pipeline_config, unique_name, batch_groups=1)
    await ensure_topics(cfg.kafka, cfg.topics, [cfg.topics.verdicts])
    await publish(cfg, [accepted_group("g1"), accepted_group("g2")])

    consumer = VerdictConsumer(cfg)
    await consumer.start()
    first = await collect(consumer, 1)
    second = await collect(consumer, 1)  # acknowledges `first`, hands out `second`
    await consumer.aclose(commit=False)  # crash while training on `second`
    assert len(first) == len(second) == 1

    async with VerdictConsumer(cfg) as restarted:
        redo = await collect(restarted, 1)
        assert groups_of(redo) == groups_of(second)  # only the unfinished group comes back
        assert await restarted.next_batch(idle_timeout_s=2.0) is None


async def test_durable_store_dedupes_across_restarts(pipeline_config, unique_name, tmp_path) -> None:
    cfg = trainer_config(pipeline_config, unique_name, batch_groups=1)
    await ensure_topics(cfg.kafka, cfg.topics, [cfg.topics.verdicts])
    store_path = tmp_path / "dedupe.sqlite"
    g1 = accepted_group("g1")
    await publish(cfg, [g1])
    async with VerdictConsumer(cfg, dedupe_store=store_path) as consumer:
        assert groups_of(await collect(consumer, 1)) == ["g1"]
    # Leaving the block normally acknowledged g1: it is in the store.
    store = SqliteDedupeStore(store_path)
    key: DedupeKey = ("default", "g1", 1)
    assert store.contains(key) and len(store) == 1
    store.close()

    # A worker re-publishes g1 (its publisher died after sending); g2 is new.
    await publish(cfg, [g1, accepted_group("g2")])
    async with VerdictConsumer(cfg, dedupe_store=store_path) as consumer:
        got = await collect(consumer, 1)
        await drain_until(consumer, "verdicts/duplicate", 1)
    assert groups_of(got) == ["g2"]


async def test_run_trainer_steps_and_stops_when_idle(pipeline_config, unique_name) -> None:
    cfg = trainer_config(pipeline_config, unique_name, batch_groups=2, device="cpu")
    await ensure_topics(cfg.kafka, cfg.topics, [cfg.topics.verdicts])
    await publish(cfg, [accepted_group(f"g{k}", (1.0, 0.0), reward=0.5) for k in range(3)])
    reports = []
    summary = await run_trainer(cfg, idle_timeout_s=3.0, on_step=reports.append, mode="additive")
    assert summary.stop_reason == "idle"
    assert [r.groups for r in reports] == [2, 1]  # the last, partial batch is flushed on idle
    assert summary.groups == 3 and summary.rows == 6 and summary.steps == 2
    # GRPO outcome advantages are +-1 for a (1, 0) group; every trained token gets +0.5.
    assert reports[0].mean_outcome_advantage == pytest.approx(0.0, abs=1e-5)
    assert reports[0].mean_shaped_advantage == pytest.approx(0.5, abs=1e-5)
    assert summary.metrics["pipeline/groups/batched"] == 3


def test_cli_trainer_subcommand(pipeline_config, unique_name, tmp_path, capsys) -> None:
    """``prm-pipeline trainer`` as the lead wires it: parser options, config overrides, exit codes."""
    import argparse
    import asyncio

    import yaml

    from infra.config import ConfigError
    from prm_pipeline.cli import add_trainer_parser

    cfg = pipeline_config
    asyncio.run(ensure_topics(cfg.kafka, cfg.topics, [cfg.topics.verdicts]))
    asyncio.run(publish(cfg, [accepted_group(f"g{k}", (1.0, 0.0), reward=0.5) for k in range(3)]))
    path = tmp_path / "cfg.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "kafka": {"bootstrap": cfg.kafka.bootstrap, **LOCAL_BROKER_CLIENT},
                "topics": {"verdicts": cfg.topics.verdicts},
                "trainer": {"group_id": f"trainer.{unique_name}", "batch_groups": 8},
            }
        )
    )
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_trainer_parser(parser.add_subparsers(dest="command", required=True))

    args = parser.parse_args(
        [
            "--config",
            str(path),
            "trainer",
            "--batch-groups",
            "2",
            "--device",
            "cpu",
            "--mode",
            "additive",
            "--max-steps",
            "1",
            "--idle-timeout",
            "10",
        ]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "step 1 groups=2 rows=4" in out and "stopped (max_steps): 1 steps" in out

    bad = parser.parse_args(["--config", str(path), "trainer", "--filter", "no_such_filter"])
    with pytest.raises(ConfigError, match="no_such_filter"):
        bad.func(bad)
    # gvpo/process_weighted shape direct process advantages: the config rules still apply.
    gvpo = parser.parse_args(["--config", str(path), "trainer", "--mode", "gvpo"])
    with pytest.raises(ConfigError, match="token_rewards_as_adv"):
        gvpo.func(gvpo)
