"""Scenario 5 — a hypothesis-generated batch of malformed trajectory records.

Truncated msgpack, wrong types (top level and nested), huge arrays (token ids as msgpack
arrays, thousand-turn chains with a duplicate or dangling id, logprob/token mismatches,
random bytes beyond the dead-letter cap), NaN/inf rewards, cyclic parent links, duplicate
interaction ids, an ``output_len`` 0 turn, members disagreeing on ``group_size``, bad
headers and broken schema rules — drawn deterministically (tests/faults/malformed.py) and
published raw, in one batch, to two worker processes.

Every case must end exactly once, as expected: a dead letter whose headers name the
error class and reason (and carry the original bytes, or the first
``dead_letter_max_bytes`` of them with the original size) — plus one ``rejected`` /
``invalid_member`` verdict for the group its key names, citing the dead letter's
coordinates —, or one ``rejected`` verdict with the expected reason. Afterwards the same workers must accept a valid group and
exit cleanly: no malformed record may take a worker down.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest

from infra.config import PRMScorerConfig
from infra.kafka import ensure_topics, make_producer
from infra.schema import dead_letter_from_record
from prm_pipeline.demo.synthetic import make_group
from producers.publisher import TrajectoryPublisher
from tests.faults.common import (
    FaultWorkers,
    check_verdicts,
    fault_config,
    log_dir,
    reason_code,
    report,
)
from tests.faults.malformed import draw_cases
from tests.integration.harness import read_topic, wait_for_verdicts, write_config

pytestmark = pytest.mark.integration

DEAD_LETTER_CAP = 64 * 1024


async def test_malformed_records_end_in_dead_letters_or_rejections(kafka_bootstrap, redis_url, tmp_path) -> None:
    name = f"fuzz-{uuid.uuid4().hex[:8]}"
    cfg = fault_config(
        name,
        kafka_bootstrap,
        redis_url,
        dead_letter_max_bytes=DEAD_LETTER_CAP,
        scorers=[
            PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 24}),
        ],
    )
    await ensure_topics(cfg.kafka, cfg.topics)
    t_gen = time.monotonic()
    cases = draw_cases(name)
    gen_s = time.monotonic() - t_gen
    dead = {c.key: c for c in cases if c.expect.outcome == "dead"}
    rejected = {c.key: c for c in cases if c.expect.outcome == "rejected"}
    procs = FaultWorkers(write_config(cfg, tmp_path / "config.yaml"), log_dir(tmp_path), n=2)
    procs.start()
    try:
        t0 = time.monotonic()
        producer = make_producer(cfg.kafka)
        await producer.start()
        try:
            for case in cases:
                for value, headers in case.records:
                    await producer.send(cfg.topics.trajectories, value, key=case.key.encode(), headers=headers)
            await producer.flush()
        finally:
            await producer.stop()
        deadline = time.monotonic() + 90
        letters = await read_topic(
            cfg,
            cfg.topics.dead_letters,
            until=deadline,
            stop_when=lambda rs: dead.keys() <= {r.key.decode() for r in rs},
        )
        await wait_for_verdicts(cfg, set(rejected) | set(dead), timeout_s=max(5.0, deadline - time.monotonic()))
        outcomes_s = time.monotonic() - t0
        alive_after_batch = procs.alive()
        # the workers that digested the batch still score a valid group
        sentinel = f"{name}-valid"
        t1 = time.monotonic()
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many(make_group(sentinel, 3, turns=2, output_tokens=8))
        await wait_for_verdicts(cfg, [sentinel], timeout_s=30)
        sentinel_s = time.monotonic() - t1
        # one more full read of both topics, to catch late duplicates
        letters = await read_topic(cfg, cfg.topics.dead_letters)
        verdict_records = await read_topic(cfg, cfg.topics.verdicts)
    finally:
        procs.stop()

    check = check_verdicts(verdict_records, set(rejected) | set(dead) | {sentinel})
    by_key: dict[str, list] = {}
    for r in letters:
        by_key.setdefault(r.key.decode(), []).append(dead_letter_from_record(r.value, r.headers))
    problems: list[str] = []
    truncated = 0
    for key, case in dead.items():
        got = by_key.get(key, [])
        offsets = {dl.source_offset for dl in got}
        if len(offsets) != 1:
            problems.append(f"{case.category} / {case.note}: {len(offsets)} dead letters (expected 1)")
            continue
        dl = got[0]
        if dl.error_class != case.expect.what or case.expect.needle.lower() not in dl.error_message.lower():
            problems.append(
                f"{case.category} / {case.note}: dead letter {dl.error_class}: {dl.error_message[:150]!r}, "
                f"expected {case.expect.what} mentioning {case.expect.needle!r}"
            )
        original = case.records[0][0] or b""
        if len(original) > DEAD_LETTER_CAP:
            truncated += 1
            if dl.payload != original[:DEAD_LETTER_CAP] or dl.original_size != len(original):
                problems.append(
                    f"{case.category} / {case.note}: truncated dead letter is not the original's prefix "
                    f"({len(dl.payload)} bytes, original_size {dl.original_size})"
                )
        elif dl.payload != original or dl.original_size != -1:
            problems.append(f"{case.category} / {case.note}: dead letter does not carry the original bytes")
        verdict = check.verdicts.get(key)
        where = f"{dl.source_topic}:{dl.source_partition}@{dl.source_offset}"
        if verdict is not None and (
            verdict.status != "rejected" or reason_code(verdict) != "invalid_member" or where not in verdict.reason
        ):
            problems.append(
                f"{case.category} / {case.note}: its group's verdict is {verdict.status} "
                f"{verdict.reason[:120]!r}, expected rejected invalid_member citing {where}"
            )
    for key, case in rejected.items():
        verdict = check.verdicts.get(key)
        if verdict is None:
            continue  # reported by assert_exactly_once
        if (verdict.status, reason_code(verdict)) != ("rejected", case.expect.what):
            problems.append(
                f"{case.category} / {case.note}: verdict {verdict.status} {verdict.reason!r}, "
                f"expected rejected {case.expect.what}"
            )
        if key in by_key:
            problems.append(f"{case.category} / {case.note}: rejected but also dead-lettered")
    stray = sorted(set(by_key) - dead.keys())
    if stray:
        problems.append(f"dead letters for keys that should not have any: {stray[:5]}")

    report(
        "5. malformed-record fuzz (hypothesis, derandomized), 2 workers",
        cases=len(cases),
        records=sum(len(c.records) for c in cases),
        bytes_published=sum(c.payload_bytes for c in cases),
        by_category=dict(Counter(c.category for c in cases)),
        expected_dead_letters=len(dead),
        dead_letter_records=len(letters),
        dead_letter_classes=dict(Counter(dl.error_class for dls in by_key.values() for dl in dls[:1])),
        truncated_dead_letters=truncated,
        expected_rejections=len(rejected),
        rejection_reasons=dict(Counter(reason_code(check.verdicts[k]) for k in rejected if k in check.verdicts)),
        lost=len(check.missing) + sum(1 for k in dead if k not in by_key),
        verdict_duplicates_before_dedupe=check.duplicates,
        conflicting=len(check.conflicting),
        generate_s=round(gen_s, 2),
        all_outcomes_s=round(outcomes_s, 1),
        valid_group_after_batch=check.verdicts[sentinel].status if sentinel in check.verdicts else "missing",
        valid_group_s=round(sentinel_s, 2),
        workers_alive_after_batch=alive_after_batch,
        final_sigterm_exits=procs.final_exits(),
    )
    check.assert_exactly_once(procs.logs())
    assert not problems, "\n".join(problems)
    assert check.verdicts[sentinel].status == "accepted", check.verdicts[sentinel].reason
    assert all(alive_after_batch), f"a worker died on the batch\n{procs.logs()}"
    assert all(code == 0 for code, _ in procs.final_exits()), procs.logs()
