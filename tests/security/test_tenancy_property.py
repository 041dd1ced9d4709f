"""Property: whatever a record carries, every effect it has stays inside its topic's experiment.

Hypothesis draws records — ready trajectories and discards, on the topics of the default
experiment and of two declared ones, naming no experiment, their own, another declared
one or an undeclared one, with plain group ids or ids that forge a scope (``exp-a\\x1f…``),
hold a control character (a forged log line) or are too long — and sends them as a
producer of that topic can, past the publisher's checks. One real stack serves every
example (the embedded broker and Redis, one in-process worker). After each example,
once every record has its outcome (a verdict on its own topic's verdicts topic, or a
dead letter), the whole run so far must show:

* every verdict is on the verdicts topic of the experiment whose trajectories topic its
  group's records came from, and names that experiment;
* no topic exists beyond the declared experiments' (records create none);
* every ``experiment`` label value of the worker's metrics is a declared experiment's;
* no worker log line holds a control character (no forged lines, no scope separators).

Judge requests are covered where judges are (tests/security/, the judge egress rows of
docs/security.md): the scorer here calls none.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra.config import PipelineConfig
from infra.experiments import DEFAULT_EXPERIMENT, SCOPE_SEPARATOR, trajectories_topic, verdicts_topic
from infra.ids import MAX_ID_LENGTH
from infra.kafka import assign_from_start, make_consumer, make_producer
from infra.schema import DiscardGroup, GroupVerdict, dead_letter_from_record, decode_verdict, encode
from prm_pipeline.demo.synthetic import make_group
from tests.integration.harness import isolated_config, running_worker, with_scorers
from tests.integration.test_fleet import LENGTH, _declare, _serving, _spec
from tests.polling import eventually, poll_until
from tests.security.test_tenancy import label_values, topics_of

pytestmark = pytest.mark.integration

DECLARED = (DEFAULT_EXPERIMENT, "exp-a", "exp-b")
UNDECLARED = "exp-nobody"
CONTROL = {chr(c) for c in (*range(0x20), *range(0x7F, 0xA0))}


@dataclass(repr=False)
class Stack:
    """One worker for every example, and what it has done so far."""

    cfg: PipelineConfig
    worker: object
    consumer: object
    producer: object
    topic_experiment: dict[str, str]  # verdicts topic -> its experiment
    verdicts: list[tuple[str, GroupVerdict]] = field(default_factory=list)  # (topic, verdict)
    letters: set[tuple[str, int, int]] = field(default_factory=set)  # (source topic, partition, offset)
    sent: dict[str, str] = field(default_factory=dict)  # group id (as sent) -> its topic's experiment
    logs: list[logging.LogRecord] = field(default_factory=list)

    async def drain(self) -> None:
        for records in (await self.consumer.getmany(timeout_ms=50)).values():
            for r in records:
                if r.topic == self.cfg.topics.dead_letters:
                    d = dead_letter_from_record(r.value, r.headers)
                    self.letters.add((d.source_topic, d.source_partition, d.source_offset))
                else:
                    self.verdicts.append((r.topic, decode_verdict(r.value, r.headers)))


class _Collect(logging.Handler):
    def __init__(self, into: list[logging.LogRecord]) -> None:
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record)


@pytest.fixture(scope="module")
async def stack(kafka_bootstrap: str, redis_url: str):
    name = f"tenancy-prop-{uuid.uuid4().hex[:8]}"
    cfg = with_scorers(isolated_config(name, kafka_bootstrap, redis_url, partitions=1, group_timeout_s=30), LENGTH)
    logs: list[logging.LogRecord] = []
    handler, workers_log = _Collect(logs), logging.getLogger("scoring_workers")
    level = workers_log.level
    workers_log.addHandler(handler)
    workers_log.setLevel(logging.INFO)
    try:
        async with running_worker(cfg, "w-tenancy-property") as worker:
            for experiment_id in DECLARED[1:]:
                await _declare(cfg, _spec(experiment_id, LENGTH))
                await _serving(worker, experiment_id)
            consumer, producer = make_consumer(cfg.kafka, group_id=None), make_producer(cfg.kafka)
            await consumer.start()
            await producer.start()
            topics = {verdicts_topic(cfg.topics.verdicts, e): e for e in DECLARED}
            try:
                await assign_from_start(consumer, cfg.topics.dead_letters, *topics)
                stack = Stack(cfg, worker, consumer, producer, topics, logs=logs)
                await _warm_up(stack)
                yield stack
            finally:
                await consumer.stop()
                await producer.stop()
    finally:
        workers_log.removeHandler(handler)
        workers_log.setLevel(level)


async def _warm_up(stack: Stack) -> None:
    """One verdict on each verdicts topic and one dead letter before the first example: a
    topic's first write may wait for its partition leader (the embedded broker answers
    ``NotLeaderForPartition`` for a while), which is start-up, not the property."""
    cfg = stack.cfg
    for experiment_id in DECLARED:
        (member,) = make_group(f"warm-{experiment_id}", 1, turns=1, output_tokens=2)
        value, headers = encode(member)
        await stack.producer.send_and_wait(
            trajectories_topic(cfg.topics.trajectories, experiment_id),
            value,
            key=member.group_id.encode(),
            headers=headers,
        )
        stack.sent[member.group_id] = experiment_id
    await stack.producer.send_and_wait(cfg.topics.trajectories, b"warm-up garbage")
    await eventually(
        lambda: len(stack.verdicts) >= len(DECLARED) and bool(stack.letters),
        between=stack.drain,
        timeout_s=120,
        what="the stack warmed up (a verdict per declared experiment and a dead letter)",
    )


# --------------------------------------------------------------------------- records
GROUP_FORMS = st.sampled_from(["plain", "forged-scope", "newline", "escape", "too-long"])


@st.composite
def records(draw) -> list[tuple[str, str | None, str, str]]:
    """(topic's experiment, named experiment or None, kind, group id form), 1 to 4 of them."""
    out = []
    for _ in range(draw(st.integers(1, 4))):
        topic = draw(st.sampled_from(DECLARED))
        named = draw(st.sampled_from([None, topic, *DECLARED, UNDECLARED]))
        out.append((topic, named, draw(st.sampled_from(["ready", "discard"])), draw(GROUP_FORMS)))
    return out


def _group_id(form: str, plain: str, victim: str) -> str:
    return {
        "plain": plain,
        "forged-scope": f"{victim}{SCOPE_SEPARATOR}{plain}",
        "newline": f"{plain}\n2030-01-01 00:00:00,000 ERROR forged",
        "escape": f"{plain}\x1b[2J",
        "too-long": plain + "x" * MAX_ID_LENGTH,
    }[form]


# --------------------------------------------------------------------------- the property
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(drawn=records())
async def test_every_effect_of_a_record_stays_inside_its_topics_experiment(stack: Stack, drawn) -> None:
    cfg, nonce = stack.cfg, uuid.uuid4().hex[:8]
    del stack.logs[:]
    waiting: dict[tuple[str, int, int], tuple[str, str]] = {}  # record -> (its experiment, group id)
    for i, (topic_exp, named, kind, form) in enumerate(drawn):
        victim = next(e for e in DECLARED if e != topic_exp)
        group_id = _group_id(form, f"{nonce}-{i}", victim)
        message = (
            make_group(f"{nonce}-{i}", 1, turns=1, output_tokens=2)[0]
            if kind == "ready"
            else DiscardGroup(group_id="g", reason="drawn")
        )
        message = msgspec.structs.replace(
            message, group_id=group_id, experiment_id=msgspec.UNSET if named is None else named
        )
        value, headers = encode(message)
        topic = trajectories_topic(cfg.topics.trajectories, topic_exp)
        meta = await stack.producer.send_and_wait(topic, value, key=group_id.encode(), headers=headers)
        stack.sent[group_id] = topic_exp
        waiting[(topic, meta.partition, meta.offset)] = (topic_exp, group_id)

    def outstanding() -> dict:  # each record's outcome: its verdict, or a dead letter
        decided = {(stack.topic_experiment[t], v.group_id) for t, v in stack.verdicts}
        for where, (experiment_id, group_id) in list(waiting.items()):
            if where in stack.letters or (experiment_id, group_id) in decided:
                del waiting[where]
        return waiting

    await poll_until(lambda: not outstanding(), between=stack.drain, timeout_s=60)
    seen = [(stack.topic_experiment[t], v.experiment_id, v.group_id, v.status) for t, v in stack.verdicts]
    assert not waiting, f"no outcome within 60s for {sorted(waiting.values())}; verdicts so far {seen[-10:]}"

    for topic_exp, named_exp, group_id, status in seen:  # verdicts: their group's topic's experiment, only
        assert stack.sent.get(group_id) == topic_exp == named_exp, (
            f"verdict {status} for group {group_id!r} on {topic_exp}'s topic naming {named_exp}, "
            f"but that group was sent on {stack.sent.get(group_id)!r}'s topic"
        )
    declared_topics = {cfg.topics.dead_letters, cfg.topics.experiments} | {
        f(base, e)
        for e in DECLARED
        for f, base in ((trajectories_topic, cfg.topics.trajectories), (verdicts_topic, cfg.topics.verdicts))
    }
    assert await topics_of(cfg) <= declared_topics, "a record created a topic"
    assert label_values(stack.worker) <= {*DECLARED, "unknown"}, "a record created a metric label value"
    forged = [r.getMessage() for r in stack.logs if CONTROL & set(r.getMessage())]
    assert not forged, f"log lines holding control characters: {forged[:3]}"
