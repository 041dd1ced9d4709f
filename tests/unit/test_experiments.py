"""Experiment ids scope group ids without touching the default experiment's keys."""

from __future__ import annotations

import pytest

from infra.experiments import (
    DEFAULT_EXPERIMENT,
    check_experiment_id,
    scoped_group,
    split_scoped,
    trajectories_topic,
    verdicts_topic,
)
from infra.schema import DiscardGroup, GroupVerdict, decode_message, decode_verdict, encode


def test_default_experiment_keeps_bare_group_ids_and_topics() -> None:
    assert scoped_group(DEFAULT_EXPERIMENT, "g-1") == "g-1"
    assert split_scoped("g-1") == (DEFAULT_EXPERIMENT, "g-1")
    assert trajectories_topic("prm.trajectories", DEFAULT_EXPERIMENT) == "prm.trajectories"
    assert verdicts_topic("prm.verdicts", DEFAULT_EXPERIMENT) == "prm.verdicts"


def test_same_group_id_in_two_experiments_gives_two_keys_that_split_back() -> None:
    a, b = scoped_group("exp-a", "g-1"), scoped_group("exp-b", "g-1")
    assert a != b != "g-1"
    assert split_scoped(a) == ("exp-a", "g-1") and split_scoped(b) == ("exp-b", "g-1")
    assert trajectories_topic("prm.trajectories", "exp-a") == "prm.trajectories.exp-a"
    assert verdicts_topic("prm.verdicts", "exp-a") == "prm.verdicts.exp-a"


@pytest.mark.parametrize("bad", ["", "a b", "-lead", "x" * 65, "slash/no", "ü"])
def test_malformed_experiment_ids_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="experiment_id"):
        check_experiment_id(bad)


def test_wire_messages_carry_the_experiment_and_default_when_absent() -> None:
    scoped = decode_message(*encode(DiscardGroup(group_id="g", experiment_id="exp-a")))
    assert scoped.experiment == "exp-a"
    plain_bytes, headers = encode(DiscardGroup(group_id="g"))
    assert b"experiment_id" not in plain_bytes  # the default experiment's records keep their bytes
    assert decode_message(plain_bytes, headers).experiment == DEFAULT_EXPERIMENT
    verdict = decode_verdict(*encode(GroupVerdict(group_id="g", status="accepted", experiment_id="exp-a")))
    assert verdict.experiment_id == "exp-a"
    with pytest.raises(ValueError, match="experiment_id"):
        DiscardGroup(group_id="g", experiment_id="bad id")


def test_the_example_experiment_file_is_valid_and_is_the_one_docs_fleet_md_shows() -> None:
    import re
    from pathlib import Path

    import yaml

    from infra.registry import load_spec_file

    root = Path(__file__).resolve().parents[2]
    spec = load_spec_file(root / "config" / "experiment.example.yaml")
    assert (spec.experiment_id, spec.weight, spec.max_in_flight) == ("math-rl", 2.0, 16)
    assert spec.judge_quota is not None and spec.judge_quota.rps == 20
    shown = re.search(
        r"```yaml\n# config/experiment.example.yaml\n(.*?)```", (root / "docs" / "fleet.md").read_text(), re.S
    )
    assert shown is not None
    assert yaml.safe_load(shown.group(1)) == yaml.safe_load((root / "config" / "experiment.example.yaml").read_text())
