"""The worker's experiments: declared, refused (keeping the last good declaration), retired, expired."""

from __future__ import annotations

import msgspec

from infra.config import PipelineConfig, PRMConfig, PRMScorerConfig, WorkerConfig
from infra.registry import ExperimentSpec, RegistryRecord
from infra.schema import DiscardGroup, ExperimentMismatch, InvalidMessage
from prm_pipeline.demo.synthetic import make_group
from scoring_workers.fleet import Fleet

LENGTH = PRMScorerConfig("examples.prm.scorers.LengthBudgetScorer")


def _spec(experiment_id: str, path: str = LENGTH.path, **fields) -> ExperimentSpec:
    return ExperimentSpec(experiment_id=experiment_id, prm=PRMConfig(scorers=[PRMScorerConfig(path)]), **fields)


def _fleet(refused: list[str] | None = None) -> Fleet:
    cfg = PipelineConfig(worker=WorkerConfig(group_timeout_s=60, allowed_scorer_modules=["scoring_workers.scorers"]))
    return Fleet(cfg, None, on_refused=lambda e, why: refused.append(f"{e}: {why}") if refused is not None else None)


async def test_a_declaration_builds_the_experiments_runner_and_adds_its_topic() -> None:
    fleet = _fleet()
    assert await fleet.apply(RegistryRecord("exp-a", _spec("exp-a", weight=3.0, group_timeout_s=5), 0))
    exp = fleet.get("exp-a")
    assert exp is not None and exp.runner is not None and (exp.weight, exp.group_timeout_s) == (3.0, 5)
    assert fleet.topics() == ["prm.trajectories", "prm.trajectories.exp-a"]
    assert fleet.of_topic("prm.trajectories.exp-a") is exp
    assert fleet.experiment_of("prm.trajectories.exp-a") == "exp-a"
    assert fleet.experiment_of("prm.trajectories") == "default"
    assert fleet.experiment_of("prm.trajectories.exp-gone") == "exp-gone"  # no longer served: still its own
    await fleet.aclose()


def test_the_topic_is_the_tenant_a_record_naming_another_experiment_is_refused() -> None:
    fleet = _fleet()
    (member,) = make_group("g", 1, turns=1, output_tokens=2)
    discard = DiscardGroup(group_id="g")
    for message in (member, discard):
        assert fleet.admit("prm.trajectories", message) is message  # names none: its topic's
        named_a = msgspec.structs.replace(message, experiment_id="exp-a")
        assert fleet.admit("prm.trajectories.exp-a", named_a) is named_a  # names its own topic's
        refused = fleet.admit("prm.trajectories.exp-b", named_a)  # on B's topic, naming A
        assert isinstance(refused, ExperimentMismatch) and isinstance(refused, InvalidMessage)
        assert "names experiment 'exp-a', but prm.trajectories.exp-b is the topic of experiment 'exp-b'" in str(refused)
        assert isinstance(fleet.admit("prm.trajectories", named_a), ExperimentMismatch)  # the default topic too
    assert fleet.admit("prm.trajectories", refused) is refused  # what did not decode stays what it was


async def test_a_refused_replacement_keeps_the_last_good_declaration() -> None:
    refused: list[str] = []
    fleet = _fleet(refused)
    await fleet.apply(RegistryRecord("exp-a", _spec("exp-a", weight=2.0), 0))
    changed = await fleet.apply(RegistryRecord("exp-a", _spec("exp-a", "os.path.join", weight=9.0), 1))
    assert not changed and fleet.get("exp-a").weight == 2.0
    assert len(refused) == 1 and "not under the allowed prefixes" in refused[0]
    assert not await fleet.apply(RegistryRecord("exp-x", None, 2, error="not JSON"))
    assert fleet.get("exp-x") is None and "not JSON" in refused[1]
    await fleet.aclose()


async def test_a_removed_experiment_retires_for_its_group_timeout_then_expires() -> None:
    fleet = _fleet()
    await fleet.apply(RegistryRecord("exp-a", _spec("exp-a", group_timeout_s=30), 0))
    await fleet.apply(RegistryRecord("exp-a", None, 1))
    exp = fleet.get("exp-a")
    assert exp is not None and exp.state == "retiring" and fleet.states() == {"active": 1, "retiring": 1}
    assert not fleet.expire(now=exp.retire_at - 1)
    assert fleet.expire(now=exp.retire_at + 1)
    assert fleet.get("exp-a") is None and fleet.topics() == ["prm.trajectories"]
    leftover = fleet.retired("exp-a")  # its last groups: the worker's timeout, no scorers named
    assert leftover.group_timeout_s == 60 and msgspec.msgpack.decode(leftover.scorers_blob) == []
    await fleet.aclose()


async def test_the_default_experiment_cannot_be_removed() -> None:
    fleet = _fleet()
    await fleet.apply(RegistryRecord("default", None, 0))
    assert fleet.get("default") is not None and fleet.get("default").retire_at is None


async def test_a_declared_judge_quota_reaches_the_experiments_judge_clients_and_a_new_one_replaces_it() -> None:
    from infra.registry import JudgeQuotaSpec
    from scoring_workers.judge.limits import all_quotas

    cfg = PipelineConfig(
        worker=WorkerConfig(allowed_scorer_modules=["scoring_workers.scorers"], allowed_judge_hosts=["127.0.0.1"])
    )
    fleet = Fleet(cfg, None)
    judge = PRMScorerConfig(
        "scoring_workers.scorers.openclaw.OpenClawJudgeScorer",
        kwargs={"base_url": "http://127.0.0.1:9/v1", "model": "judge"},
    )

    def spec(quota: JudgeQuotaSpec) -> ExperimentSpec:
        return ExperimentSpec(experiment_id="exp-q", prm=PRMConfig(scorers=[judge]), judge_quota=quota)

    await fleet.apply(RegistryRecord("exp-q", spec(JudgeQuotaSpec(max_in_flight=3, rps=50)), 0))
    (quota,) = [q for q in all_quotas() if q.scope == "exp-q"]
    assert (quota.quota.max_in_flight, quota.quota.rps) == (3, 50)
    await fleet.apply(RegistryRecord("exp-q", spec(JudgeQuotaSpec(max_in_flight=1)), 1))  # re-declared
    assert fleet.get("exp-q").spec.judge_quota.max_in_flight == 1
    await fleet.aclose()
    assert not [q for q in all_quotas() if q.scope == "exp-q"]  # released with the runners
