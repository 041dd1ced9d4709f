"""The health rules of ``prm-pipeline status`` (prm_pipeline/status/report.py) and its exporter."""

from __future__ import annotations

from prometheus_client import generate_latest

from prm_pipeline.status.exporter import StatusCollector, status_registry
from prm_pipeline.status.report import (
    GroupLag,
    LedgerSummary,
    PartitionLag,
    RedisNode,
    StatusReport,
    WorkerBeat,
    WorkersSummary,
    assess,
    percentile,
)


def lag(
    role: str,
    total: int,
    *,
    growth: int | None = None,
    produced: int | None = None,
    members: int = 1,
    committed: int | None = 0,
) -> GroupLag:
    return GroupLag(
        role,
        f"{role}-group",
        f"{role}-topic",
        [PartitionLag(0, total, committed, total)],
        total,
        members,
        "Stable",
        growth,
        produced,
        2.0,
    )


def alive(*names: str) -> WorkersSummary:
    return WorkersSummary(15.0, [WorkerBeat(n, 1.0) for n in names], [])


def checks(report: StatusReport) -> dict[str, str]:
    return {p.check: p.severity for p in assess(report)}


def test_a_quiet_pipeline_is_healthy() -> None:
    report = StatusReport(
        at=0,
        lags=[lag("workers", 3, growth=1, produced=40), lag("trainer", 0, growth=0, produced=5)],
        workers=alive("w0"),
    )
    report.problems = assess(report)
    assert report.healthy and not report.problems


def test_lag_growing_beyond_slack_is_critical_within_it_not() -> None:
    assert "lag_growing" not in checks(
        StatusReport(at=0, lags=[lag("workers", 9, growth=9, produced=9)], workers=alive("w"))
    )
    # 10% of what was produced is tolerated too: a busy pipeline's lag wobbles
    assert "lag_growing" not in checks(
        StatusReport(at=0, lags=[lag("workers", 90, growth=90, produced=1000)], workers=alive("w"))
    )
    assert (
        checks(StatusReport(at=0, lags=[lag("workers", 50, growth=50, produced=50)], workers=alive("w")))["lag_growing"]
        == "critical"
    )


def test_no_live_worker_by_heartbeat_or_without_redis_by_membership() -> None:
    silent = WorkersSummary(15.0, [], [WorkerBeat("w0.1", 40.0)])
    report = StatusReport(at=0, lags=[lag("workers", 0, members=2)], workers=silent)
    problems = {p.check: p for p in assess(report)}
    assert (
        problems["no_live_worker"].severity == "critical"
        and "w0.1 silent for 40s" in problems["no_live_worker"].message
    )
    assert "no_live_worker" in checks(StatusReport(at=0, lags=[lag("workers", 0, members=0)]))
    assert "no_live_worker" not in checks(StatusReport(at=0, lags=[lag("workers", 0, members=1)]))


def test_one_silent_worker_among_live_ones_is_a_warning() -> None:
    beats = WorkersSummary(15.0, [WorkerBeat("w1", 2.0)], [WorkerBeat("w0", 30.0)])
    assert checks(StatusReport(at=0, workers=beats)) == {"worker_silent": "warning"}


def test_oldest_group_against_its_own_timeout() -> None:
    def ledger(age: float, timeout: float | None) -> LedgerSummary:
        return LedgerSummary(1, 1, 1, 0, 0, 600.0, "g", age, timeout)

    assert "group_near_timeout" not in checks(StatusReport(at=0, ledger=ledger(7.9, 10.0), workers=alive("w")))
    assert checks(StatusReport(at=0, ledger=ledger(8.0, 10.0), workers=alive("w")))["group_near_timeout"] == "critical"
    # no stored deadline: the configured worker.group_timeout_s
    assert "group_near_timeout" in checks(StatusReport(at=0, ledger=ledger(480.0, None), workers=alive("w")))


def test_warnings_do_not_make_it_unhealthy() -> None:
    led = LedgerSummary(5, 5, 0, 5, 0, 600.0, oldest_decided_age_s=45.0, memory=[RedisNode("r", 90, 100)])
    report = StatusReport(at=0, ledger=led, workers=alive("w"), lags=[lag("trainer", 7, members=0, committed=None)])
    report.problems = assess(report)
    assert {p.check for p in report.problems} == {"verdict_overdue", "redis_memory", "trainer_idle"}
    assert report.healthy


def test_unreachable_parts_are_critical() -> None:
    report = StatusReport(at=0, errors={"kafka": "no answer within 10s"})
    report.problems = assess(report)
    assert not report.healthy and report.problems[0].check == "kafka_unreachable"


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0


def test_exporter_serves_the_latest_report() -> None:
    collector = StatusCollector()
    registry = status_registry(collector)
    assert b'prm_pipeline_status_up{part="kafka"} 0.0' in generate_latest(registry)
    led = LedgerSummary(2, 2, 1, 1, 0, 600.0, "g", 12.5, 600.0, memory=[RedisNode("r", 1000, 0)])
    report = StatusReport(at=0, lags=[lag("workers", 4)], ledger=led, workers=alive("a", "b"))
    report.problems = assess(report)
    collector.update(report)
    text = generate_latest(registry).decode()
    assert (
        'prm_pipeline_consumer_lag{group="workers-group",partition="0",role="workers",topic="workers-topic"} 4.0'
        in text
    )
    assert "prm_pipeline_oldest_open_group_age_seconds 12.5" in text
    assert "prm_pipeline_workers_alive 2.0" in text
    assert 'prm_pipeline_unfinished_groups{state="decided"} 1.0' in text
    assert "prm_pipeline_healthy 1.0" in text


def test_a_missing_topic_is_named_not_taken_for_an_unreachable_kafka() -> None:
    import asyncio

    from infra.kafka import TopicMissing
    from prm_pipeline.status.collect import _bounded

    async def missing() -> None:
        raise TopicMissing("prm.verdicts.x")

    report = StatusReport(at=0)
    asyncio.run(_bounded(report, "kafka", missing(), 5))
    report.problems = assess(report)
    assert [(p.check, p.severity) for p in report.problems] == [("topic_missing", "critical")]
    assert "prm.verdicts.x" in report.problems[0].message and "topics create" in report.problems[0].message
    assert not report.healthy


def test_other_kafka_reads_run_while_the_lag_sample_waits(monkeypatch) -> None:
    """One report costs about --sample seconds plus its slowest read: the dead-letter and
    verdict reads start before the second lag sample, not after it."""
    import asyncio

    from prm_pipeline.status import collect as c
    from prm_pipeline.status.report import DeadLetterSummary, VerdictSummary

    events: list[str] = []

    async def sample_lag(cfg, **_):
        events.append("lag")
        return c.LagSample(0.0, {}, {})

    async def ledger_summary(cfg, **_):
        raise ConnectionError("no redis here")

    async def dead_letters(cfg, window_s, timeout_s, experiment=None):
        events.append("dead_letters")
        return DeadLetterSummary(window_s, 0, [], False)

    async def verdicts(cfg, window_s, timeout_s, experiment=None):
        events.append("verdicts")
        return VerdictSummary(
            window_s=window_s,
            count=0,
            per_second=0.0,
            by_status={},
            top_reasons=[],
            latency_p50_s=None,
            latency_p99_s=None,
            stage_p50_s={},
        )

    for name, fake in (
        ("sample_lag", sample_lag),
        ("ledger_summary", ledger_summary),
        ("dead_letter_summary", dead_letters),
        ("verdict_summary", verdicts),
    ):
        monkeypatch.setattr(c, name, fake)
    from infra.config import PipelineConfig

    report, _ = asyncio.run(c.collect(PipelineConfig(), sample_s=0.05))
    assert events[0] == "lag" and events[-1] == "lag" and sorted(events[1:3]) == ["dead_letters", "verdicts"]
    assert report.dead_letters is not None and report.verdicts is not None and "redis" in report.errors
