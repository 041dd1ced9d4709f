"""Malformed records at scale (``prm-pipeline bench faults``, ``make faults``).

Publishes ``--records`` (default 10,000) bad ``prm.trajectories`` records of every class
in tests/faults/malformed.py — truncated msgpack, wrong types, unknown version/kind,
missing headers, tombstones, NaN/inf, huge arrays under the limit, byte lengths not a
multiple of 4, mismatched lengths, cycles, duplicate ids, dangling parents, inconsistent
and absurd group sizes, non-UTF-8 text, trees that are not concat export, empty outputs —
plus two size classes (records just under ``kafka.max_message_bytes``, whose dead letter
must be capped to fit, and groups whose verdict cannot fit), mixed with ``--valid-groups``
valid groups, raw, to ``--workers`` worker processes on the embedded stack.

Then it accounts for every case: a dead letter with the expected error class and reason
(plus the ``invalid_member`` rejection of the group its key names), or one ``rejected``
verdict with the expected reason; every valid group ``accepted`` exactly once (after the
trainer's dedupe); every worker alive throughout and exiting 0. It prints the accounting
table and exits 1 on any loss or mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from infra.config import (
    ActorConfig,
    AgentConfig,
    KafkaConfig,
    PipelineConfig,
    PRMConfig,
    PRMScorerConfig,
    RedisConfig,
    RolloutConfig,
    TopicsConfig,
    WorkerConfig,
)
from infra.kafka import assign_from_start, ensure_topics, make_consumer, make_producer, max_record_size, record_size
from infra.local import BROKERS, LocalStack
from infra.schema import GroupVerdict, dead_letter_from_record, decode_verdict, encode
from prm_pipeline.demo.processes import WorkerProcesses, write_config
from prm_pipeline.demo.synthetic import make_group
from tests.faults.malformed import READY_HEADERS, Case, Expect, draw_cases
from tests.perf.stack_load import workers_assigned
from tests.polling import poll_until

LIMIT = 1_048_576  # kafka.max_message_bytes (the default) == worker.dead_letter_max_bytes (the default)

# Share of the bad records per class; "huge arrays" and the two size classes are few
# (megabytes each), the rest fill the 10,000.
WEIGHTS = {
    "truncated msgpack": 10,
    "wrong types": 16,
    "NaN/inf rewards": 8,
    "cyclic parent links": 6,
    "duplicate interaction ids": 6,
    "output_len 0": 4,
    "mismatched group sizes": 3,
    "bad headers": 10,
    "broken rules": 10,
    "dangling parents": 6,
    "mismatched lengths": 6,
    "non-UTF-8 text": 6,
}
FIXED = {"huge arrays": 24, "absurd group sizes": 24}
NEAR_LIMIT, TOO_LARGE_VERDICTS = 4, 2


def _config(stack: LocalStack, name: str, group_timeout_s: float) -> PipelineConfig:
    return PipelineConfig(
        rollout=RolloutConfig(
            agent=AgentConfig(
                prm=PRMConfig(
                    scorers=[
                        PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 24}),
                    ]
                )
            )
        ),
        actor=ActorConfig(token_rewards_as_adv=True),
        kafka=KafkaConfig(
            bootstrap=stack.kafka_bootstrap, **stack.client_settings, linger_ms=5, max_message_bytes=LIMIT
        ),
        redis=RedisConfig(url=stack.redis_url, key_prefix=f"faults:{name}", ttl_s=600),
        topics=TopicsConfig(
            trajectories=f"traj.{name}",
            verdicts=f"verd.{name}",
            dead_letters=f"dlq.{name}",
            experiments=f"exp.{name}",
            partitions=8,
        ),
        # inline verdicts: the "verdict too large" cases check that path (with the default `auto` such a
        # group would be sent by reference and accepted)
        worker=WorkerConfig(
            group_id=f"workers.{name}",
            concurrency=64,
            group_timeout_s=group_timeout_s,
            dead_letter_max_bytes=LIMIT,
            drain_timeout_s=5,
            verdict_tokens="inline",
        ),
    )


def _size_cases(prefix: str, start: int) -> list[Case]:
    """Records just under the limit (dead letter must be capped) and groups whose verdict
    is over it (rejected ``verdict_too_large``)."""
    import numpy as np

    cases = []
    rng = np.random.default_rng(7)
    for i in range(NEAR_LIMIT):
        key = f"{prefix}-{start + i:05d}"
        # just under what the limit lets a record be once zstd frames it (a broker that enforces
        # max.message.bytes, noida, refuses the record itself if it is sized to LIMIT)
        room = max_record_size(LIMIT) - record_size(key.encode(), b"", READY_HEADERS) - 8  # 8: the varints grow
        value = rng.bytes(room - 16 * i)
        assert record_size(key.encode(), value, READY_HEADERS) <= max_record_size(LIMIT)
        cases.append(
            Case(
                "near-limit record",
                Expect.dead("InvalidMessage", ""),
                [(value, READY_HEADERS)],
                key,
                f"{len(value)} bytes",
                len(value),
            )
        )
    for i in range(TOO_LARGE_VERDICTS):
        key = f"{prefix}-{start + NEAR_LIMIT + i:05d}"
        members = make_group(key, 4, turns=1, output_tokens=40_000, rng=np.random.default_rng(i))
        records = [encode(m) for m in members]
        assert all(record_size(key.encode(), v, h) <= LIMIT for v, h in records)
        cases.append(
            Case(
                "verdict too large",
                Expect.rejected("verdict_too_large"),
                records,
                key,
                "4 members of ~320 KB",
                sum(len(v) for v, _ in records),
            )
        )
    return cases


def _counts(records: int) -> dict[str, int]:
    """Cases per class so that the batch holds about ``records`` records."""
    per_case = {"output_len 0": 2.0, "mismatched group sizes": 3.0}  # mean records per case
    room = records - sum(FIXED.values()) - NEAR_LIMIT - 4 * TOO_LARGE_VERDICTS
    total_weight = sum(WEIGHTS[c] * per_case.get(c, 1.0) for c in WEIGHTS)
    counts = {c: max(1, round(room * w / total_weight)) for c, w in WEIGHTS.items()}
    return {**counts, **FIXED}


class _Tail:
    """Reads the dead-letter and verdict topics from the start, keyed by group/case key."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.letters: dict[str, list[Any]] = defaultdict(list)
        self.verdicts: dict[str, list[tuple[bytes, GroupVerdict]]] = defaultdict(list)
        self.stop = asyncio.Event()

    async def run(self) -> None:
        consumer = make_consumer(self.cfg.kafka, group_id=None, fetch_max_wait_ms=50)
        await consumer.start()
        try:
            await assign_from_start(consumer, self.cfg.topics.dead_letters, self.cfg.topics.verdicts)
            while not self.stop.is_set():
                for tp, records in (await consumer.getmany(timeout_ms=100, max_records=2000)).items():
                    for r in records:
                        key = r.key.decode(errors="replace") if r.key else ""
                        if tp.topic == self.cfg.topics.dead_letters:
                            self.letters[key].append(dead_letter_from_record(r.value, r.headers))
                        else:
                            self.verdicts[key].append((r.value, decode_verdict(r.value, r.headers)))
        finally:
            await consumer.stop()


def _account(cases: list[Case], valid: list[str], tail: _Tail) -> tuple[list[list[Any]], list[str], dict[str, Any]]:
    rows: dict[str, Counter[str]] = defaultdict(Counter)
    problems: list[str] = []
    for case in cases:
        row = rows[case.category]
        row["cases"] += 1
        row["records"] += len(case.records)
        letters = {dl.source_offset: dl for dl in tail.letters.get(case.key, [])}
        verdicts = {v for v, _ in tail.verdicts.get(case.key, [])}
        decoded = [v for _, v in tail.verdicts.get(case.key, [])]
        if len(verdicts) > 1:
            problems.append(f"{case.category} {case.key}: {len(verdicts)} different verdicts")
        verdict = decoded[0] if decoded else None
        code = verdict.reason_code if verdict is not None else None
        if case.expect.outcome == "dead":
            if len(letters) != 1:
                row["lost" if not letters else "duplicated"] += 1
                problems.append(f"{case.category} {case.key} ({case.note}): {len(letters)} dead letters")
                continue
            (dl,) = letters.values()
            if dl.error_class != case.expect.what or case.expect.needle.lower() not in dl.error_message.lower():
                row["wrong reason"] += 1
                problems.append(
                    f"{case.category} {case.key} ({case.note}): dead letter {dl.error_class}: "
                    f"{dl.error_message[:100]!r}, expected {case.expect.what} ~ {case.expect.needle!r}"
                )
                continue
            row["dead-lettered"] += 1
            if dl.original_size >= 0:
                row["truncated"] += 1
            where = f"{dl.source_topic}:{dl.source_partition}@{dl.source_offset}"
            if (
                verdict is None
                or verdict.status != "rejected"
                or code != "invalid_member"
                or where not in verdict.reason
            ):
                row["group not rejected"] += 1
                problems.append(
                    f"{case.category} {case.key}: group verdict {verdict and verdict.reason[:80]!r}, "
                    f"expected invalid_member citing {where}"
                )
        else:
            if letters:
                problems.append(f"{case.category} {case.key}: unexpected dead letter")
            if verdict is None:
                row["lost"] += 1
                problems.append(f"{case.category} {case.key} ({case.note}): no verdict")
            elif (verdict.status, code) != ("rejected", case.expect.what):
                row["wrong reason"] += 1
                problems.append(
                    f"{case.category} {case.key} ({case.note}): {verdict.status} {verdict.reason[:100]!r}, "
                    f"expected rejected {case.expect.what}"
                )
            else:
                row["rejected"] += 1
    valid_status = Counter()
    for gid in valid:
        distinct = {v for v, _ in tail.verdicts.get(gid, [])}
        decoded = [v for _, v in tail.verdicts.get(gid, [])]
        if len(distinct) != 1 or tail.letters.get(gid):
            problems.append(
                f"valid group {gid}: {len(distinct)} distinct verdicts, {len(tail.letters.get(gid, []))} dead letters"
            )
        valid_status[decoded[0].status if decoded else "missing"] += 1
        if decoded and decoded[0].status != "accepted":
            problems.append(f"valid group {gid}: {decoded[0].status} {decoded[0].reason[:100]!r}")
    order = [*WEIGHTS, *FIXED, "near-limit record", "verdict too large"]
    table = [
        [
            c,
            rows[c]["cases"],
            rows[c]["records"],
            rows[c]["dead-lettered"],
            rows[c]["truncated"],
            rows[c]["rejected"],
            rows[c]["wrong reason"],
            rows[c]["lost"],
        ]
        for c in order
        if c in rows
    ]
    return table, problems, {"valid": valid_status}


async def _main(args: argparse.Namespace) -> int:
    import numpy as np

    t_gen = time.monotonic()
    name = uuid.uuid4().hex[:8]
    counts = _counts(args.records)
    cases = draw_cases(f"bad{name}", counts)
    short = args.records - sum(len(c.records) for c in cases) - NEAR_LIMIT - 4 * TOO_LARGE_VERDICTS
    if short > 0:  # multi-record classes vary in size: top up with single-record ones
        cases += draw_cases(f"bad{name}x", {"wrong types": short // 2, "truncated msgpack": short - short // 2})
    cases += _size_cases(f"big{name}", len(cases))
    valid_groups = [
        make_group(f"ok{name}-{i:03d}", 4, turns=2, output_tokens=(8, 24), rng=np.random.default_rng(i))
        for i in range(args.valid_groups)
    ]
    gen_s = time.monotonic() - t_gen
    n_bad = sum(len(c.records) for c in cases)
    print(
        f"batch: {n_bad} bad records in {len(cases)} cases ({len(counts) + 2} classes, "
        f"{sum(c.payload_bytes for c in cases) / 1e6:.1f} MB) + {args.valid_groups} valid groups x 4; "
        f"generated in {gen_s:.1f}s"
    )
    with (
        tempfile.TemporaryDirectory(prefix="prm-faults-") as tmp,
        LocalStack(Path(tmp) / "stack", broker=args.broker) as stack,
    ):
        cfg = _config(stack, name, args.group_timeout)
        await ensure_topics(cfg.kafka, cfg.topics)
        procs = WorkerProcesses(write_config(cfg, Path(tmp) / "config.yaml"), Path(tmp), n=args.workers)
        procs.start()
        await workers_assigned(procs)  # the group formed before the first record (noida-db needs it)
        tail = _Tail(cfg)
        tail_task = asyncio.create_task(tail.run())
        died: list[str] = []
        try:
            producer = make_producer(cfg.kafka)
            await producer.start()
            t0 = time.monotonic()
            try:
                every = max(1, len(cases) // max(1, len(valid_groups)))
                groups = iter(valid_groups)
                for i, case in enumerate(cases):
                    for value, headers in case.records:
                        await producer.send(cfg.topics.trajectories, value, key=case.key.encode(), headers=headers)
                    if i % every == 0 and (group := next(groups, None)) is not None:
                        for member in group:
                            value, headers = encode(member)
                            await producer.send(
                                cfg.topics.trajectories, value, key=member.group_id.encode(), headers=headers
                            )
                for group in groups:
                    for member in group:
                        value, headers = encode(member)
                        await producer.send(
                            cfg.topics.trajectories, value, key=member.group_id.encode(), headers=headers
                        )
                await producer.flush()
            finally:
                await producer.stop()
            publish_s = time.monotonic() - t0
            valid = [g[0].group_id for g in valid_groups]
            dead_keys = {c.key for c in cases if c.expect.outcome == "dead"}
            verdict_keys = {c.key for c in cases} | set(valid)

            def ended() -> bool:  # every outcome arrived, or a worker died
                if not all(procs.alive()):
                    died.extend(f"worker {i}" for i, a in enumerate(procs.alive()) if not a)
                    return True
                return dead_keys <= tail.letters.keys() and verdict_keys <= tail.verdicts.keys()

            await poll_until(ended, timeout_s=args.timeout, interval_s=0.25)
            outcomes_s = time.monotonic() - t0
            await asyncio.sleep(1.0)  # a grace for late duplicates before the books close (not a sync point)
        finally:
            tail.stop.set()
            await tail_task
            codes = procs.stop()
    table, problems, extra = _account(cases, valid, tail)
    if died:
        problems.insert(0, f"{', '.join(died)} died during the run")
    if any(code != 0 for code in codes):
        problems.append(f"worker exit codes {codes}")
    head = ["class", "cases", "records", "dead-lettered", "truncated", "rejected", "wrong", "lost"]
    widths = [max(len(str(r[i])) for r in [head, *table]) for i in range(len(head))]
    line = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    print()
    print(line.format(*head))
    for row in table:
        print(line.format(*row))
    totals = ["total", *(sum(r[i] for r in table) for i in range(1, len(head)))]
    print(line.format(*totals))
    print()
    letters = sum(map(len, tail.letters.values()))
    print(
        f"valid groups: {dict(extra['valid'])} of {len(valid)}; dead-letter records {letters} "
        f"({letters - totals[3]} redelivered duplicates), "
        f"verdict records {sum(map(len, tail.verdicts.values()))}; workers alive throughout: {not died}, "
        f"exit codes {codes}"
    )
    print(
        f"publish {publish_s:.1f}s, every outcome {outcomes_s:.1f}s after the first record "
        f"(group deadline {args.group_timeout:.0f}s)"
    )
    if problems:
        print(f"\n{len(problems)} PROBLEMS:")
        for p in problems[:30]:
            print(f"  {p}")
        return 1
    print("every bad record accounted for; every valid group accepted once")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench faults", description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=10_000, help="bad records, about (default 10000)")
    p.add_argument("--valid-groups", type=int, default=60)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--group-timeout", type=float, default=30.0, help="worker.group_timeout_s")
    p.add_argument("--timeout", type=float, default=600.0, help="give up waiting for outcomes after S seconds")
    p.add_argument(
        "--broker",
        choices=BROKERS,
        default="tansu",
        help="the embedded broker: tansu (the default stack's) or noida (noida-db, the 'bench' extra)",
    )
    return asyncio.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
