"""One experiment id end to end outside the worker (pure parts): the publisher's stamp and
topic, JSONL, the trainer's durable dedupe, the config, audit scoping, dead-letter
experiments and ``status --experiment``'s reading of the workers' metrics."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from infra.chunks import ChunkAssembler, reassembled, to_records
from infra.config import ConfigError, KafkaConfig, PRMConfig, TopicsConfig, TrainerConfig, config_from_mapping
from infra.experiments import experiment_of_topic
from infra.jsonl import JsonlError, dump, dump_verdict, parse
from infra.schema import DeadLetter, DiscardGroup, GroupVerdict, ReadyTrajectory, decode_message, encode
from prm_pipeline.audit import Auditor, ScoringScope, rescore
from prm_pipeline.dead_letter_tool import LetterRecord, Selection, plan_redrive
from prm_pipeline.demo.synthetic import make_group, make_session
from prm_pipeline.status.render import fleet_line
from prm_pipeline.status.report import ExperimentSummary, StatusReport, assess
from prm_pipeline.status.worker_metrics import experiment_metrics
from producers.publisher import TrajectoryPublisher
from scoring_workers.prm import PRMRunner
from scoring_workers.scorers import LengthBudgetScorer
from shaper.consumer import SqliteDedupeStore

TOPICS = TopicsConfig(trajectories="prm.trajectories", verdicts="prm.verdicts")


def _traj(**kw: object) -> ReadyTrajectory:
    (t,) = make_group("g1", 1, turns=2, output_tokens=4)
    return msgspec.structs.replace(t, created_at=1.0, **kw)


def _decoded(records: list) -> list:
    return [decode_message(value, headers) for value, headers in records]


# --------------------------------------------------------------------------- publisher
def test_default_publisher_keeps_the_topic_and_the_bytes() -> None:
    pub = TrajectoryPublisher(KafkaConfig(), TOPICS)
    traj = _traj()
    assert pub.topic == "prm.trajectories"
    assert pub.records(traj) == to_records(traj, KafkaConfig().max_message_bytes)
    # a record that names "default" explicitly is sent as if it named none
    assert pub.records(msgspec.structs.replace(traj, experiment_id="default")) == pub.records(traj)


def test_an_experiment_publisher_stamps_ready_and_discard_and_picks_its_topic() -> None:
    pub = TrajectoryPublisher(KafkaConfig(), TOPICS, experiment="exp-a")
    assert pub.topic == "prm.trajectories.exp-a"
    (ready,) = _decoded(pub.records(_traj()))
    assert ready.experiment_id == "exp-a" and ready.experiment == "exp-a"
    (discard,) = _decoded(pub.records(DiscardGroup(group_id="g1")))
    assert discard.experiment == "exp-a"
    named = msgspec.structs.replace(_traj(), experiment_id="exp-a")  # naming its own experiment is fine
    assert _decoded(pub.records(named))[0].experiment == "exp-a"


def test_a_chunked_trajectory_carries_the_stamp_inside_its_reassembled_value() -> None:
    big = make_session(
        trajectory_id="t-big",
        session_id="s",
        group_id="g-big",
        group_size=1,
        turns=6,
        output_tokens=4000,
        rng=np.random.default_rng(0),
    )
    pub = TrajectoryPublisher(
        msgspec.structs.replace(KafkaConfig(), max_message_bytes=16_384), TOPICS, experiment="exp-a"
    )
    records = pub.records(big)
    assert len(records) > 2
    assembler: ChunkAssembler[int] = ChunkAssembler()
    done = [d for i, chunk in enumerate(_decoded(records)) for d in assembler.add(None, chunk, i)]
    assert reassembled(done[0]).experiment == "exp-a"


def test_a_message_of_another_experiment_is_refused_before_anything_is_sent() -> None:
    pub = TrajectoryPublisher(KafkaConfig(), TOPICS, experiment="exp-a")
    with pytest.raises(ValueError, match=r"names experiment 'exp-b'.*publish --experiment exp-b"):
        pub.records(msgspec.structs.replace(_traj(), experiment_id="exp-b"))
    default_pub = TrajectoryPublisher(KafkaConfig(), TOPICS)
    with pytest.raises(ValueError, match="names experiment 'exp-b'"):
        default_pub.records(DiscardGroup(group_id="g", experiment_id="exp-b"))
    with pytest.raises(ValueError, match="must match"):
        TrajectoryPublisher(KafkaConfig(), TOPICS, experiment="no spaces")


# --------------------------------------------------------------------------- JSONL
def test_jsonl_lines_name_their_experiment_and_dump_it_back() -> None:
    line = dump(_traj())
    assert "experiment_id" not in line
    stamped = parse({**line, "experiment_id": "exp-a"})
    assert stamped.experiment == "exp-a" and dump(stamped)["experiment_id"] == "exp-a"
    discard = parse({"kind": "discard", "group_id": "g", "experiment_id": "exp-a"})
    assert discard.experiment == "exp-a" and dump(discard)["experiment_id"] == "exp-a"
    with pytest.raises(JsonlError, match="experiment_id 'a b' must match"):
        parse({**line, "experiment_id": "a b"})


def test_a_verdict_line_names_a_non_default_experiment_only() -> None:
    v = GroupVerdict(group_id="g", status="discarded", verdict_version=1, group_size=1)
    assert "experiment_id" not in dump_verdict(v)
    assert dump_verdict(msgspec.structs.replace(v, experiment_id="exp-a"))["experiment_id"] == "exp-a"


# --------------------------------------------------------------------------- trainer side
def test_the_durable_dedupe_store_keeps_experiments_apart_and_reads_old_files(tmp_path) -> None:
    path = tmp_path / "dedupe.sqlite"
    store = SqliteDedupeStore(path)
    store._db.execute(
        "INSERT INTO acknowledged VALUES ('g-old', 1, strftime('%s','now'))"
    )  # written before experiments
    store.add_many([("exp-a", "g1", 1)])
    assert store.contains(("exp-a", "g1", 1))
    assert not store.contains(("exp-b", "g1", 1)) and not store.contains(("default", "g1", 1))
    assert store.contains(("default", "g-old", 1))
    store.close()


def test_trainer_experiment_is_checked_and_names_its_consumer_group() -> None:
    assert TrainerConfig().consumer_group == "prm-trainer"
    assert TrainerConfig(experiment="exp-a").consumer_group == "prm-trainer.exp-a"
    cfg = config_from_mapping({}, environ={"PRM_TRAINER_EXPERIMENT": "exp-b"})
    assert cfg.trainer.experiment == "exp-b"
    with pytest.raises(ConfigError, match="trainer.experiment"):
        config_from_mapping({"trainer": {"experiment": "bad/id"}})


# --------------------------------------------------------------------------- audit
async def test_audit_matches_members_within_their_experiment_when_group_ids_collide() -> None:
    """Two experiments use group "g" and the same trajectory ids with different tokens: each
    verdict is compared with its own experiment's trajectories, never the other's."""
    scorer = LengthBudgetScorer(max_output_tokens=12)
    trajs = {
        exp: [
            msgspec.structs.replace(
                make_session(
                    trajectory_id=f"t{k}",
                    session_id=f"s{k}",
                    group_id="g",
                    group_size=2,
                    turns=1,
                    output_tokens=n,
                    rng=np.random.default_rng(k),
                ),
                experiment_id=exp,
            )
            for k in range(2)
        ]
        for exp, n in (("exp-a", 16), ("exp-b", 8))
    }
    runner = await PRMRunner.create(PRMConfig(scorers=[scorer]))  # type: ignore[list-item]
    try:
        verdicts = {
            exp: GroupVerdict(
                group_id="g",
                status="accepted",
                group_size=2,
                experiment_id=exp,
                worker_id="w",
                sessions=[await rescore(runner, t, timeout_s=10) for t in ts],
                scorers=runner.scorer_infos(),
            )
            for exp, ts in trajs.items()
        }
        assert verdicts["exp-a"].sessions != verdicts["exp-b"].sessions  # the collision would show
        reports = {}
        for only in (None, "exp-a"):
            auditor = Auditor(scope=ScoringScope.of(runner.scorer_infos()), runner=runner, experiment=only)
            for v in verdicts.values():
                auditor.feed_verdict(*encode(v))
            for t in [*trajs["exp-a"], *trajs["exp-b"]]:
                await auditor.feed_trajectory(*encode(t))
            reports[only] = await auditor.finish()
    finally:
        await runner.aclose()
    both = reports[None].by_scoped_group()
    assert {(f.experiment_id, f.group_id, f.outcome) for f in both.values()} == {
        ("exp-a", "g", "identical"),
        ("exp-b", "g", "identical"),
    }
    only_a = reports["exp-a"]
    assert [(f.experiment_id, f.outcome) for f in only_a.findings] == [("exp-a", "identical")]
    assert only_a.records["other_experiment_verdicts"] == 1 and only_a.records["other_experiment_trajectories"] == 2
    assert msgspec.json.decode(msgspec.json.encode(only_a.findings[0]))["experiment_id"] == "exp-a"


# --------------------------------------------------------------------------- dead letters
def _letter(offset: int, message: object, source_topic: str) -> LetterRecord:
    value, headers = encode(message) if message is not None else (b"\x00garbage", [])
    letter = DeadLetter(
        payload=value,
        error_class="ProcessingError",
        error_message="why",
        source_topic=source_topic,
        source_partition=0,
        source_offset=offset,
        original_headers={k: v.decode() for k, v in headers},
    )
    return LetterRecord("dlq", 0, offset, 0, None, letter)


def test_a_dead_letter_belongs_to_the_experiment_of_its_source_topic() -> None:
    assert experiment_of_topic("prm.trajectories", "prm.trajectories") == "default"
    assert experiment_of_topic("prm.trajectories", "prm.trajectories.exp-a") == "exp-a"
    assert experiment_of_topic("prm.trajectories", "other") is None
    (t,) = make_group("g1", 1, turns=1, output_tokens=2)
    a = _letter(0, msgspec.structs.replace(t, experiment_id="exp-a"), "prm.trajectories.exp-a")
    same_ids_b = _letter(1, msgspec.structs.replace(t, experiment_id="exp-b"), "prm.trajectories.exp-b")
    undecodable_b = _letter(2, None, "prm.trajectories.exp-b")
    default = _letter(3, t, "prm.trajectories")
    base = "prm.trajectories"
    assert [r.experiment(base) for r in (a, same_ids_b, undecodable_b, default)] == [
        "exp-a",
        "exp-b",
        "exp-b",
        "default",
    ]
    assert a.to_json(trajectories_base=base)["experiment_id"] == "exp-a"
    assert "experiment_id" not in default.to_json(trajectories_base=base)
    # one trajectory id in two experiments is two trajectories; each goes back to its own topic
    plan = plan_redrive([a, same_ids_b, default], Selection(trajectories_base=base))
    assert [(e.redrive, e.experiment) for e in plan] == [(True, "exp-a"), (True, "exp-b"), (True, "default")]
    assert "(experiment exp-b)" in plan[1].describe()
    only_b = plan_redrive(
        [a, same_ids_b, undecodable_b, default], Selection(experiment="exp-b", trajectories_base=base)
    )
    assert [e.record.offset for e in only_b] == [1, 2]


def test_a_dead_letter_belongs_to_its_topic_never_to_the_experiment_its_payload_names() -> None:
    (t,) = make_group("g1", 1, turns=1, output_tokens=2)
    forged = _letter(4, msgspec.structs.replace(t, experiment_id="exp-a"), "prm.trajectories.exp-b")
    forged = LetterRecord(
        "dlq", 0, 4, 0, b"g1", msgspec.structs.replace(forged.letter, error_class="ExperimentMismatch")
    )
    assert forged.experiment("prm.trajectories") == "exp-b"
    assert forged.to_json(trajectories_base="prm.trajectories")["experiment_id"] == "exp-b"
    (entry,) = plan_redrive([forged], Selection(trajectories_base="prm.trajectories"))
    assert not entry.redrive and "it would be refused again" in entry.why_skipped  # never laundered into A
    assert plan_redrive([forged], Selection(experiment="exp-a", trajectories_base="prm.trajectories")) == []


# --------------------------------------------------------------------------- status --experiment
METRICS_SAMPLE = """\
# HELP prm_worker_experiment_records_total Records consumed per experiment and kind
# TYPE prm_worker_experiment_records_total counter
prm_worker_experiment_records_total{experiment="exp-a",kind="ready"} 120.0
prm_worker_experiment_records_total{experiment="exp-a",kind="discard"} 3.0
prm_worker_experiment_records_total{experiment="exp-b",kind="ready"} 999.0
# HELP prm_worker_experiment_verdicts_total Verdicts published per experiment and status
# TYPE prm_worker_experiment_verdicts_total counter
prm_worker_experiment_verdicts_total{experiment="exp-a",status="accepted"} 40.0
prm_worker_experiment_verdicts_total{experiment="exp-a",status="rejected"} 2.0
# HELP prm_worker_experiment_in_flight Records being scored
# TYPE prm_worker_experiment_in_flight gauge
prm_worker_experiment_in_flight{experiment="exp-a"} 5.0
prm_worker_experiment_in_flight{experiment="exp-b"} 60.0
# HELP prm_worker_experiment_slots In-flight slots of the experiment's share
# TYPE prm_worker_experiment_slots gauge
prm_worker_experiment_slots{experiment="exp-a"} 16.0
# HELP prm_worker_records_total unrelated
# TYPE prm_worker_records_total counter
prm_worker_records_total{experiment="exp-a"} 7.0
"""


def test_status_sums_one_experiments_series_over_the_workers_metrics() -> None:
    second = METRICS_SAMPLE.replace("120.0", "30.0").replace("} 5.0", "} 1.0")
    fleet = experiment_metrics([METRICS_SAMPLE, second], "exp-a")
    assert fleet.present and fleet.sources == 2
    assert fleet.records == {"ready": 150.0, "discard": 6.0}
    assert fleet.verdicts == {"accepted": 80.0, "rejected": 4.0}
    assert fleet.in_flight == 6.0 and fleet.slots == 32.0
    line = fleet_line(fleet)
    assert "records discard 6, ready 150" in line and "in flight 6 of 32 slots" in line
    missing = experiment_metrics([METRICS_SAMPLE], "exp-c")
    assert not missing.present and missing.records == {} and missing.in_flight is None
    assert "no series of experiment exp-c" in fleet_line(missing)


def test_status_warns_about_unread_endpoints_and_an_experiment_no_worker_serves() -> None:
    fleet = ExperimentSummary("exp-c", sources=2, unreachable=["http://w3:9108/metrics: URLError: refused"])
    checks = {p.check: p.severity for p in assess(StatusReport(at=0, experiment="exp-c", fleet=fleet))}
    assert checks == {"worker_metrics_unreachable": "warning", "experiment_not_served": "warning"}
    served = ExperimentSummary("exp-a", sources=1, present=True)
    assert not assess(StatusReport(at=0, experiment="exp-a", fleet=served))


# --------------------------------------------------------------------------- command lines
def test_every_command_of_one_experiment_takes_experiment_and_checks_it(capsys) -> None:
    from prm_pipeline.cli import build_parser

    parser = build_parser()
    for argv in (
        ["publish", "f.jsonl"],
        ["trainer"],
        ["verdicts"],
        ["inspect"],
        ["audit"],
        ["dead-letters"],
        ["status"],
    ):
        assert parser.parse_args([*argv, "--experiment", "exp-a"]).experiment == "exp-a", argv
        assert parser.parse_args(argv).experiment is None, argv  # absent: trainer.experiment, or no filter
    with pytest.raises(SystemExit):
        parser.parse_args(["publish", "f.jsonl", "--experiment", "a/b"])
    assert "experiment_id 'a/b' must match" in capsys.readouterr().err
    args = parser.parse_args(["status", "--worker-metrics", "http://w0:9108/metrics"])
    assert args.func(args) == 2 and "--worker-metrics needs --experiment" in capsys.readouterr().err
    args = parser.parse_args(["status", "--experiment", "exp-a", "--worker-metrics", "w0:9108"])
    assert args.func(args) == 2 and "expected an http:// or https:// URL" in capsys.readouterr().err


def test_status_of_an_experiment_reads_its_topics_and_its_trainer_group() -> None:
    from prm_pipeline.status.collect import _roles

    cfg = config_from_mapping({})
    assert _roles(cfg) == [
        ("workers", "prm-scoring-workers", "prm.trajectories"),
        ("trainer", "prm-trainer", "prm.verdicts"),
    ]
    assert _roles(cfg, "exp-a") == [
        ("workers", "prm-scoring-workers", "prm.trajectories.exp-a"),
        ("trainer", "prm-trainer.exp-a", "prm.verdicts.exp-a"),
    ]


def test_status_reads_what_the_workers_telemetry_exports() -> None:
    """The names and labels status looks for are the worker's own (scoring_workers/telemetry.py)."""
    from prometheus_client import generate_latest

    from scoring_workers.telemetry import WorkerTelemetry

    t = WorkerTelemetry()
    t.experiment_records.labels("exp-a", "ready").inc(3)
    t.experiment_verdicts.labels("exp-a", "accepted").inc()
    t.experiment_in_flight.labels("exp-a").set(2)
    t.experiment_slots.labels("exp-a").set(8)
    fleet = experiment_metrics([generate_latest(t.registry).decode()], "exp-a")
    assert (fleet.present, fleet.records, fleet.verdicts, fleet.in_flight, fleet.slots) == (
        True,
        {"ready": 3.0},
        {"accepted": 1.0},
        2.0,
        8.0,
    )
