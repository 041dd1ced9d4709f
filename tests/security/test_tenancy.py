"""The topic is the tenant: a producer on one experiment's topic reaches no other experiment.

Against the real embedded broker and Redis, with an in-process worker serving the default
experiment and two declared ones (A and B). Each attack was measured to work before the
rule existed:

* a group id holding the scope separator (``exp-a\\x1f<group>``) on the default topic named
  a group of experiment A: it got an accepted verdict on A's topic, and a forged discard
  keyed like it decided A's real group;
* a record on B's topic naming ``experiment_id: A`` was scored into A's verdicts;
* every forged scope created a verdicts topic and a metric label value of its own.

Now the first is an invalid record (the id grammar, :mod:`infra.ids`), the second an
``ExperimentMismatch``; both are dead-lettered, and nothing a record carries creates a
topic or a label value.
"""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from infra.config import PipelineConfig
from infra.experiments import SCOPE_SEPARATOR, trajectories_topic, verdicts_topic
from infra.kafka import make_admin, make_producer
from infra.schema import DiscardGroup, GroupVerdict, dead_letter_from_record, decode_verdict, encode
from prm_pipeline.demo.synthetic import make_group
from tests.integration.harness import read_topic, running_worker, with_scorers
from tests.integration.test_fleet import LENGTH, _declare, _publish, _serving, _spec, _verdicts

pytestmark = pytest.mark.integration

A, B = "exp-a", "exp-b"


async def send_raw(cfg: PipelineConfig, experiment_id: str, messages, *, keys=None) -> None:
    """Send ``messages`` as they are (no publisher's checks) to ``experiment_id``'s topic, keyed
    by their group ids (or ``keys``): what a producer allowed on that topic can write."""
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for i, message in enumerate(messages):
            value, headers = encode(message)
            key = keys[i] if keys is not None else message.group_id
            await producer.send_and_wait(
                trajectories_topic(cfg.topics.trajectories, experiment_id), value, key=key.encode(), headers=headers
            )
    finally:
        await producer.stop()


async def dead_letters(cfg: PipelineConfig, n: int, timeout_s: float = 30) -> list:
    records = await read_topic(
        cfg, cfg.topics.dead_letters, until=time.monotonic() + timeout_s, stop_when=lambda rs: len(rs) >= n
    )
    assert len(records) >= n, f"{len(records)} dead letters within {timeout_s}s, expected {n}"
    return [dead_letter_from_record(r.value, r.headers) for r in records]


async def all_verdicts(cfg: PipelineConfig, experiment_id: str) -> list[GroupVerdict]:
    records = await read_topic(cfg, verdicts_topic(cfg.topics.verdicts, experiment_id))
    return [decode_verdict(r.value, r.headers) for r in records]


async def topics_of(cfg: PipelineConfig) -> set[str]:
    """This test's topics on the broker (they all carry the test's name)."""
    admin = make_admin(cfg.kafka)
    await admin.start()
    try:
        name = cfg.topics.trajectories.split(".", 1)[1]
        return {t for t in await admin.list_topics() if name in t}
    finally:
        await admin.close()


def label_values(worker, label: str = "experiment") -> set[str]:
    """Every value the worker's metrics give ``label``."""
    families = text_string_to_metric_families(generate_latest(worker.telemetry.registry).decode())
    return {s.labels[label] for f in families for s in f.samples if label in s.labels}


@pytest.fixture
def cfg(pipeline_config: PipelineConfig) -> PipelineConfig:
    return with_scorers(pipeline_config, LENGTH)


async def _two_experiments(cfg: PipelineConfig, worker) -> None:
    for experiment_id in (A, B):
        await _declare(cfg, _spec(experiment_id, LENGTH))
        await _serving(worker, experiment_id)


async def test_a_forged_scope_in_a_group_id_reaches_no_other_experiment(cfg) -> None:
    real = f"real-{uuid.uuid4().hex[:6]}"
    first, second = make_group(real, 2)
    forged_member = msgspec.structs.replace(make_group("ghost", 1)[0], group_id=f"{A}{SCOPE_SEPARATOR}{real}-x")
    forged_discard = DiscardGroup(group_id=f"{A}{SCOPE_SEPARATOR}{real}", reason="forged")
    async with running_worker(cfg, "w-tenancy-scope") as worker:
        await _two_experiments(cfg, worker)
        await _publish(cfg, A, [first])
        await send_raw(cfg, "default", [forged_member, forged_discard])  # a producer of the default topic
        letters = await dead_letters(cfg, 2)
        await _publish(cfg, A, [second])
        verdicts = await _verdicts(cfg, A, {real})
        on_a = await all_verdicts(cfg, A)
    # both forged records are invalid: dead-lettered, and their key (the forged scope) named no group
    assert sorted(d.error_class for d in letters) == ["InvalidMessage", "InvalidMessage"]
    assert all("group_id: " in d.error_message and SCOPE_SEPARATOR not in d.error_message for d in letters)
    # A's real group is untouched: accepted with both members, the only verdict on A's topic
    assert verdicts[real].status == "accepted" and len(verdicts[real].sessions) == 2, verdicts[real].reason
    assert [(v.group_id, v.status) for v in on_a] == [(real, "accepted")]


async def test_a_record_on_one_experiments_topic_naming_another_is_dead_lettered(cfg) -> None:
    gid = f"cross-{uuid.uuid4().hex[:6]}"
    async with running_worker(cfg, "w-tenancy-mismatch") as worker:
        await _two_experiments(cfg, worker)
        await _publish(cfg, A, make_group(gid, 2)[:1], topic_of=B)  # on B's topic, naming A
        (letter,) = await dead_letters(cfg, 1)
        rejected = (await _verdicts(cfg, B, {gid}))[gid]
        on_a = await all_verdicts(cfg, A)
    assert letter.error_class == "ExperimentMismatch"
    assert f"names experiment '{A}'" in letter.error_message and f"experiment '{B}'" in letter.error_message
    assert letter.source_topic == trajectories_topic(cfg.topics.trajectories, B)
    # the record's group is B's (its topic's), rejected there as any invalid member's; A sees nothing
    assert (rejected.status, rejected.reason_code, rejected.experiment_id) == ("rejected", "invalid_member", B)
    assert on_a == []


async def test_forged_scopes_create_no_topics_and_no_label_values(cfg) -> None:
    n = 20
    forged = [
        msgspec.structs.replace(m, group_id=f"ghost{i}{SCOPE_SEPARATOR}g")
        for i, m in enumerate(m for i in range(n) for m in make_group(f"g{i}-{uuid.uuid4().hex[:4]}", 1))
    ]
    async with running_worker(cfg, "w-tenancy-labels") as worker:
        await _two_experiments(cfg, worker)
        before = await topics_of(cfg)
        await send_raw(cfg, "default", forged)
        letters = await dead_letters(cfg, n)
        after = await topics_of(cfg)
        labels = label_values(worker)
    assert {d.error_class for d in letters} == {"InvalidMessage"}
    assert after == before, f"topics created by records: {sorted(after - before)}"
    assert labels <= {"default", A, B, "unknown"}, labels
    assert not any(name.startswith("ghost") for name in after | labels)
