"""Config tests: one test per rule, each asserting the message names the key.

A rule that fails with a vague message costs an operator a debugging session, so the
key in the message is part of the contract. Every call passes ``environ=`` explicitly:
the real environment must never leak into these tests.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.config import (
    ConfigError,
    PipelineConfig,
    config_from_mapping,
    load_config,
)

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "config" / "demo.yaml"

AREAL_YAML = """\
rollout:
  _version: v1
  agent:
    chat_template_type: concat
    export_style: concat
    prm:
      enabled: true
      advantage_shaping:
        mode: process_weighted
      scorers:
        - path: examples.prm.scorers.LengthBudgetScorer
          weight: 1.0
          kwargs:
            max_output_tokens: 128
actor:
  token_rewards_as_adv: true
"""


def areal() -> dict[str, Any]:
    """AReaL's Process Rewards example config block (the spec's YAML, unchanged)."""
    return yaml.safe_load(AREAL_YAML)


def build(raw: dict[str, Any], **environ: str) -> PipelineConfig:
    return config_from_mapping(raw, environ=environ)


def refused(raw: dict[str, Any], *fragments: str, **environ: str) -> str:
    with pytest.raises(ConfigError) as info:
        build(raw, **environ)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def prm(raw: dict[str, Any]) -> dict[str, Any]:
    return raw["rollout"]["agent"]["prm"]


def shaping_additive(raw: dict[str, Any]) -> dict[str, Any]:
    """AReaL's block with the mode switched to additive, to isolate scorer-only rules."""
    prm(raw)["advantage_shaping"]["mode"] = "additive"
    return raw


# --------------------------------------------------------------------------- accepted as-is
def test_demo_yaml_loads() -> None:
    cfg = load_config(DEMO, environ={})
    assert cfg.prm.active and cfg.actor.token_rewards_as_adv
    assert cfg.prm.advantage_shaping.mode == "process_weighted"
    assert cfg.prm.scorers[0].path == "examples.prm.scorers.LengthBudgetScorer"
    assert cfg.prm.scorers[0].kwargs == {"max_output_tokens": 128}


def test_demo_yaml_contains_the_areal_block_unchanged() -> None:
    demo = yaml.safe_load(DEMO.read_text())
    assert {k: demo[k] for k in ("rollout", "actor")} == areal()
    assert AREAL_YAML in DEMO.read_text()  # verbatim, not merely equivalent


def test_demo_yaml_spells_out_our_defaults() -> None:
    demo = yaml.safe_load(DEMO.read_text())
    defaults = PipelineConfig()
    for section in ("kafka", "redis", "topics", "worker", "trainer"):
        assert getattr(build(demo), section) == getattr(defaults, section), section
        assert set(demo[section]) == {f for f in type(getattr(defaults, section)).__struct_fields__}, section


def test_areal_snippet_alone(tmp_path: Path) -> None:
    path = tmp_path / "areal.yaml"
    path.write_text(AREAL_YAML)
    cfg = load_config(path, environ={})
    assert cfg.prm.active and cfg.rollout.version == "v1"
    assert cfg.kafka.bootstrap == "127.0.0.1:9092"  # our sections fall back to defaults


def test_extra_areal_keys_are_ignored() -> None:
    raw = areal()
    raw["rollout"]["max_concurrent_rollouts"] = 64
    raw["rollout"]["agent"]["max_turns"] = 8  # not in our AReaL list either: a newer AReaL's key
    raw["actor"]["path"] = "Qwen/Qwen3-8B"
    raw["actor"]["optimizer"] = {"lr": 1e-6}
    raw["gconfig"] = {"n_samples": 8}  # a whole AReaL top-level section
    raw["defaults"] = ["_self_"]  # Hydra's, through which AReaL reads its YAML
    assert build(raw).prm.active


def test_a_whole_areal_grpo_config_loads() -> None:
    """Every top-level section of AReaL's GRPO/PPO experiment configs, with values."""
    raw = areal() | {
        "experiment_name": "gsm8k-grpo",
        "trial_name": "t1",
        "seed": 1,
        "total_train_epochs": 10,
        "allocation_mode": "sglang:d4+fsdp:d4",
        "tokenizer_path": "Qwen/Qwen3-1.7B",
        "cluster": {"n_nodes": 1, "n_gpus_per_node": 8},
        "gconfig": {"n_samples": 4, "max_new_tokens": 1024},
        "train_dataset": {"path": "openai/gsm8k", "batch_size": 256},
        "valid_dataset": None,
        "saver": {"freq_epochs": 1},
        "evaluator": {},
        "stats_logger": {"wandb": {"mode": "disabled"}},
        "recover": {"mode": "disabled"},
        "sglang": {"mem_fraction_static": 0.8},
        "vllm": {},
        "launcher": {},
        "ref": {"path": "Qwen/Qwen3-1.7B"},
        "critic": {},
        "scheduler": {},
        "async_training": True,
        "enable_offload": False,
        "teacher": {},
        "perf_tracer": None,
    }
    raw["rollout"] |= {
        "max_concurrent_rollouts": 256,
        "queue_size": None,
        "consumer_batch_size": 256,
        "max_head_offpolicyness": 2,
        "enable_rollout_tracing": False,
        "setup_timeout": 120,
    }
    raw["rollout"]["agent"] |= {"mode": "inline", "tool_call_parser": "qwen25", "turn_discount": 1.0}
    raw["actor"] |= {
        "path": "Qwen/Qwen3-1.7B",
        "group_size": 4,
        "ppo_n_minibatches": 1,
        "eps_clip": 0.4,
        "kl_ctl": 0.0,
        "adv_norm": {"mean_level": "group"},
        "mb_spec": {"max_tokens_per_mb": 10240},
        "optimizer": {"lr": 1.7e-5},
        "gradient_checkpointing": True,
        "dtype": "bfloat16",
    }
    assert build(raw).prm.active


# --------------------------------------------------------------------------- typos fail, naming the fix
@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.update(wroker={"concurrency": 3}), "unknown top-level key `wroker`; did you mean `worker`?"),
        (lambda r: r.update(trainner={}), "unknown top-level key `trainner`; did you mean `trainer`?"),
        (lambda r: r.update(kafak=None), "unknown top-level key `kafak`; did you mean `kafka`?"),  # even when empty
        (
            lambda r: prm(r)["scorers"][0].update(wieght=0.5),
            "rollout.agent.prm.scorers[0]: unknown key `wieght`; did you mean `weight`?",
        ),
        (
            lambda r: prm(r)["scorers"][0].update(enabeld=False),
            "rollout.agent.prm.scorers[0]: unknown key `enabeld`; did you mean `enabled`?",
        ),
        (lambda r: prm(r)["scorers"][0].update(timeout=3), "(a scorer's own arguments go under `kwargs`)"),
        (lambda r: prm(r).update(enabeld=False), "rollout.agent.prm: unknown key `enabeld`; did you mean `enabled`?"),
        (lambda r: prm(r).update(error_polcy="reject"), "did you mean `error_policy`?"),
        (
            lambda r: prm(r)["advantage_shaping"].update(negative_scal=0.1),
            "rollout.agent.prm.advantage_shaping: unknown key `negative_scal`; did you mean `negative_scale`?",
        ),
        (
            lambda r: r["actor"].update(token_reward_as_adv=True),
            "actor: unknown key `token_reward_as_adv`; did you mean `token_rewards_as_adv`?",
        ),
        (lambda r: r["rollout"]["agent"].update(export_styel="concat"), "did you mean `export_style`?"),
        (lambda r: r["rollout"]["agent"].update(pmr={}), "rollout.agent: unknown key `pmr`; did you mean `prm`?"),
        (lambda r: r["rollout"].update(version="v2"), "rollout: unknown key `version`; did you mean `_version`?"),
        (lambda r: r.update(worker={"concurency": 3}), "worker: unknown key `concurency`; did you mean `concurrency`?"),
        (lambda r: r.update(kafka={"bootstrap_servers": "x:1"}), "did you mean `bootstrap`?"),
    ],
)
def test_a_typo_anywhere_is_one_line_naming_the_closest_key(mutate: Any, message: str) -> None:
    raw = areal()
    mutate(raw)
    text = refused(raw, message)
    assert "\n" not in text


def test_an_unknown_top_level_key_with_no_close_match_lists_our_sections() -> None:
    refused(areal() | {"scoring": {}}, "unknown top-level key `scoring`", "kafka, local, redis")


def test_prm_config_mappings_built_in_python_are_strict_too() -> None:
    import msgspec

    from infra.config import PRMConfig

    with pytest.raises(msgspec.ValidationError, match="enabeld"):
        msgspec.convert({"enabeld": False}, PRMConfig)


def test_empty_sections_mean_defaults() -> None:
    raw = areal() | {"worker": None}  # ``worker:`` with every key commented out
    assert build(raw).worker.concurrency == 32


# --------------------------------------------------------------------------- our sections are strict
def test_unknown_key_in_our_section() -> None:
    refused(areal() | {"worker": {"concurency": 3}}, "concurency", "worker")


def test_wrong_type_in_our_section() -> None:
    refused(areal() | {"kafka": {"compression": "brotli"}}, "kafka.compression")


def test_worker_concurrency_positive() -> None:
    refused(areal() | {"worker": {"concurrency": 0}}, "worker.concurrency")


def test_worker_timeouts_positive() -> None:
    refused(areal() | {"worker": {"scorer_timeout_s": 0}}, "worker.scorer_timeout_s")
    refused(areal() | {"worker": {"group_timeout_s": math.inf}}, "worker.group_timeout_s")


def test_max_message_bytes_floor() -> None:
    refused(areal() | {"kafka": {"max_message_bytes": 10}}, "kafka.max_message_bytes")


# --------------------------------------------------------------------------- AReaL's config rules
def test_concat_export_required_with_active_scorers() -> None:
    raw = areal()
    raw["rollout"]["agent"]["export_style"] = "individual"
    refused(raw, "rollout.agent.export_style", "'concat'", "'individual'")


def test_concat_template_required_with_active_scorers() -> None:
    raw = areal()
    raw["rollout"]["agent"]["chat_template_type"] = "hf"
    refused(raw, "rollout.agent.chat_template_type", "'hf'")


def test_token_rewards_as_adv_required_with_active_scorers() -> None:
    raw = shaping_additive(areal())
    raw["actor"]["token_rewards_as_adv"] = False
    refused(raw, "actor.token_rewards_as_adv", "scorers are active")


def test_token_rewards_as_adv_required_with_gvpo() -> None:
    raw = areal()
    prm(raw).update(scorers=[], advantage_shaping={"mode": "gvpo"})
    raw["actor"]["token_rewards_as_adv"] = False
    refused(raw, "actor.token_rewards_as_adv", "'gvpo'")


def test_token_rewards_as_adv_required_with_process_weighted_without_scorers() -> None:
    raw = areal()
    prm(raw)["scorers"] = []
    raw["actor"]["token_rewards_as_adv"] = False
    refused(raw, "actor.token_rewards_as_adv", "'process_weighted'")


def test_process_weighted_refuses_mask_no_eos_with_zero() -> None:
    raw = areal()
    raw["actor"]["mask_no_eos_with_zero"] = True
    refused(raw, "actor.mask_no_eos_with_zero", "process_weighted")


def test_mask_no_eos_with_zero_fine_with_other_modes() -> None:
    raw = shaping_additive(areal())
    raw["actor"]["mask_no_eos_with_zero"] = True
    assert build(raw).actor.mask_no_eos_with_zero


def test_scorers_refused_with_api_url() -> None:
    raw = areal()
    raw["rollout"]["api_url"] = "http://external:8000/v1"
    raw["rollout"]["_version"] = "v2"
    refused(raw, "rollout.api_url", "rollout.agent.prm")


def test_api_url_fine_with_empty_scorers() -> None:
    raw = areal()
    raw["rollout"]["api_url"] = "http://external:8000/v1"
    prm(raw)["scorers"] = []
    assert build(raw).rollout.api_url == "http://external:8000/v1"


def test_api_url_fine_when_disabled() -> None:
    raw = areal()
    raw["rollout"]["api_url"] = "http://external:8000/v1"
    prm(raw)["enabled"] = False
    assert not build(raw).prm.active


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_version_v1_or_v2_accepted(version: str) -> None:
    raw = areal()
    raw["rollout"]["_version"] = version
    assert build(raw).rollout.version == version


def test_version_must_be_v1_or_v2() -> None:
    raw = areal()
    raw["rollout"]["_version"] = "v3"
    refused(raw, "rollout._version", "'v3'")


def test_unknown_shaping_mode() -> None:
    raw = areal()
    prm(raw)["advantage_shaping"]["mode"] = "process-weighted"
    refused(raw, "rollout.agent.prm.advantage_shaping.mode", "'process-weighted'", "process_weighted")


@pytest.mark.parametrize("key", ["negative_scale", "zero_penalty"])
@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf, -math.inf])
def test_shaping_coefficients_finite_non_negative(key: str, value: float) -> None:
    raw = areal()
    prm(raw)["advantage_shaping"][key] = value
    refused(raw, f"rollout.agent.prm.advantage_shaping.{key}", ">= 0")


def test_shaping_coefficients_zero_allowed() -> None:
    raw = areal()
    prm(raw)["advantage_shaping"].update(negative_scale=0.0, zero_penalty=0.0)
    assert build(raw).prm.advantage_shaping.zero_penalty == 0.0


def test_scorer_weight_finite() -> None:
    raw = areal()
    prm(raw)["scorers"][0]["weight"] = math.nan
    refused(raw, "rollout.agent.prm.scorers[0].weight")


def test_scorer_path_required() -> None:
    raw = areal()
    prm(raw)["scorers"][0]["path"] = ""
    refused(raw, "rollout.agent.prm.scorers[0].path")


# --------------------------------------------------------------------------- inactive PRM
def test_empty_scorer_list_is_inactive() -> None:
    raw = shaping_additive(areal())
    prm(raw)["scorers"] = []
    raw["rollout"]["agent"]["export_style"] = "individual"
    raw["actor"]["token_rewards_as_adv"] = False
    assert not build(raw).prm.active


def test_enabled_false_is_inactive_and_allows_individual_export() -> None:
    raw = areal()
    prm(raw)["enabled"] = False
    raw["rollout"]["agent"]["export_style"] = "individual"
    raw["rollout"]["agent"]["chat_template_type"] = "hf"
    cfg = build(raw)
    assert not cfg.prm.active and cfg.rollout.agent.export_style == "individual"


def test_no_prm_block_is_inactive() -> None:
    assert not build({}).prm.active


# --------------------------------------------------------------------------- environment
def test_env_kafka_bootstrap() -> None:
    assert build(areal(), PRM_KAFKA_BOOTSTRAP="broker-1:9092,broker-2:9092").kafka.bootstrap == (
        "broker-1:9092,broker-2:9092"
    )


def test_env_redis_url() -> None:
    assert build(areal(), PRM_REDIS_URL="redis://ledger:6380/2").redis.url == "redis://ledger:6380/2"


def test_env_float_parsed() -> None:
    value = build(areal(), PRM_WORKER_SCORER_TIMEOUT_S="2.5").worker.scorer_timeout_s
    assert value == 2.5 and isinstance(value, float)


def test_env_int_parsed() -> None:
    assert build(areal(), PRM_WORKER_CONCURRENCY="4").worker.concurrency == 4


def test_env_overrides_the_file() -> None:
    raw = areal() | {"worker": {"concurrency": 3, "scorer_timeout_s": 9.0}}
    cfg = build(raw, PRM_WORKER_CONCURRENCY="5")
    assert (cfg.worker.concurrency, cfg.worker.scorer_timeout_s) == (5, 9.0)


def test_env_string_fields_stay_strings() -> None:
    cfg = build(areal(), PRM_KAFKA_SASL_PASSWORD="12345", PRM_KAFKA_SASL_USERNAME="yes")
    assert (cfg.kafka.sasl_password, cfg.kafka.sasl_username) == ("12345", "yes")


def test_env_empty_value_is_null() -> None:
    assert build(areal() | {"worker": {"metrics_port": 9100}}, PRM_WORKER_METRICS_PORT="").worker.metrics_port is None


def test_env_unknown_field_refused() -> None:
    refused(areal(), "PRM_WORKER_FOO", "'foo'", "worker", PRM_WORKER_FOO="1")


def test_env_bad_value_refused() -> None:
    refused(areal(), "worker.concurrency", PRM_WORKER_CONCURRENCY="many")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"PRM_WORKER_SCORER_TIMEOUT_S": "abc"},
            "PRM_WORKER_SCORER_TIMEOUT_S='abc': worker.scorer_timeout_s: Expected `float`, got `str`",
        ),
        (
            {"PRM_KAFKA_MAX_MESSAGE_BYTES": "5"},
            "PRM_KAFKA_MAX_MESSAGE_BYTES='5': kafka.max_message_bytes: Expected `int` >= 1024",
        ),
        ({"PRM_TRAINER_EXPERIMENT": "a b"}, "PRM_TRAINER_EXPERIMENT='a b': trainer.experiment: experiment_id 'a b'"),
    ],
)
def test_a_bad_value_from_the_environment_names_its_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(areal(), **env)
    assert str(info.value).startswith(message), str(info.value)


def test_a_bad_value_from_the_file_is_not_blamed_on_the_environment() -> None:
    with pytest.raises(ConfigError) as info:
        build(areal() | {"worker": {"scorer_timeout_s": "abc"}}, PRM_WORKER_CONCURRENCY="4")
    assert "PRM_" not in str(info.value) and "worker.scorer_timeout_s" in str(info.value)


def test_env_unrelated_prm_variables_ignored() -> None:
    cfg = build(areal(), PRM_TEST_KAFKA="1", PRM_CONFIG="/nowhere.yaml", PRMX_WORKER_FOO="1")
    assert cfg.kafka == PipelineConfig().kafka


def test_env_does_not_mutate_input() -> None:
    raw = areal() | {"worker": {"concurrency": 3}}
    before = copy.deepcopy(raw)
    build(raw, PRM_WORKER_CONCURRENCY="5")
    assert raw == before


def test_prm_config_env_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "from-env.yaml"
    path.write_text(AREAL_YAML + "worker:\n  concurrency: 7\n")
    assert load_config(environ={"PRM_CONFIG": str(path)}).worker.concurrency == 7


def test_no_file_means_defaults() -> None:
    cfg = load_config(environ={})
    assert cfg == PipelineConfig() and not cfg.prm.active


# --------------------------------------------------------------------------- files
def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(missing, environ={})
    assert str(missing) in str(info.value)


def test_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("rollout:\n  agent: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_config(path, environ={})
    assert str(path) in str(info.value)


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(path, environ={})


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert load_config(path, environ={}) == PipelineConfig()


def test_secrets_never_appear_in_a_config_repr() -> None:
    from infra.config import KafkaConfig, PipelineConfig, RedisConfig

    cfg = PipelineConfig(
        kafka=KafkaConfig(security_protocol="SASL_SSL", sasl_username="svc", sasl_password="hunter2"),
        redis=RedisConfig(url="rediss://prm:s3cret@redis.internal:6380/0"),
    )
    text = repr(cfg)
    assert "hunter2" not in text and "s3cret" not in text
    assert "sasl_username='svc'" in text and "rediss://prm:***@redis.internal:6380/0" in text
    assert cfg.kafka.sasl_password == "hunter2"  # only the representation is masked


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"topics": {"replication_factor": 0}}, "topics.replication_factor"),
        ({"worker": {"poll_max_records": 0}}, "worker.poll_max_records"),
        ({"redis": {"ttl_s": 0}}, "redis.ttl_s"),
        ({"kafka": {"startup_timeout_s": -1}}, "kafka.startup_timeout_s"),
        ({"redis": {"startup_timeout_s": math.inf}}, "redis.startup_timeout_s"),
        ({"trainer": {"batch_groups": 0}}, "trainer.batch_groups"),
        ({"topics": {"partitions": 0}}, "topics.partitions"),
    ],
)
def test_declared_constraints_name_the_key(raw: dict[str, Any], key: str) -> None:
    refused(areal() | raw, key)


def test_command_line_counts_keep_the_config_constraint() -> None:
    from prm_pipeline.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["trainer", "--batch-groups", "3"]).batch_groups == 3
    for bad in ("0", "-2", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["trainer", "--batch-groups", bad])


def test_shaping_modes_come_from_one_registry() -> None:
    import infra.config
    import shaper.shaping
    from infra.modes import COMBINED_MODES, SHAPING_MODES, mode_info, registered_modes

    assert SHAPING_MODES == ("additive", "gvpo", "process_weighted")
    assert COMBINED_MODES == ("prm_gated_opd", "prm_weighted_opd", "openclaw_combine")
    assert infra.config.SHAPING_MODES is SHAPING_MODES and infra.config.COMBINED_MODES is COMBINED_MODES
    assert shaper.shaping.SHAPING_MODES is SHAPING_MODES
    assert {m.name for m in registered_modes()} == {*SHAPING_MODES, *COMBINED_MODES}
    # the rules config validation applies are attributes of the registry entries
    assert [m for m in SHAPING_MODES if mode_info(m).direct_advantages] == ["gvpo", "process_weighted"]
    assert [m for m in SHAPING_MODES if mode_info(m).unit_interval] == ["process_weighted"]
    assert mode_info("nope") is None


def test_an_error_naming_a_variable_never_shows_a_secret() -> None:
    """The variable is named, but a password (its own, or inside a URL) is never printed."""
    from infra.config import _env_shown

    with pytest.raises(ConfigError) as info:  # breaks a rule: two URLs without redis.cluster
        build(areal(), PRM_REDIS_URL="redis://user:s3cret-pw@a:1,redis://b:2")
    assert "PRM_REDIS_URL='redis://user:***@a:1,redis://b:2'" in str(info.value), str(info.value)
    assert (
        _env_shown("PRM_KAFKA_SASL_PASSWORD", {"PRM_KAFKA_SASL_PASSWORD": "s3cret-pw"})
        == "PRM_KAFKA_SASL_PASSWORD='***'"
    )


def test_a_config_file_with_a_byte_order_mark_loads_and_a_folder_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbfkafka:\n  bootstrap: broker-1:9092\n")
    assert load_config(path, environ={}).kafka.bootstrap == "broker-1:9092"
    with pytest.raises(ConfigError, match=r"is a folder, not a file$"):
        load_config(tmp_path, environ={})


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("localhost", "'localhost' has no port"),
        ("", "kafka.bootstrap is empty"),
        ("kafka://h:9092", "is a URL"),
        ("h:99999", "port must be a number from 1 to 65535"),
        ("a:1,,b:2", "an empty entry"),
        ("::1", "has no port"),
    ],
)
def test_a_malformed_bootstrap_is_a_config_error_naming_the_variable(value: str, why: str) -> None:
    refused(areal(), why, f"PRM_KAFKA_BOOTSTRAP={value!r}", PRM_KAFKA_BOOTSTRAP=value)


def test_bootstrap_servers_parses_hosts_ports_and_ipv6() -> None:
    from infra.config import bootstrap_servers

    assert bootstrap_servers(" a:1, [::1]:9092 ") == [("a", 1), ("::1", 9092)]
    assert build(areal(), PRM_KAFKA_BOOTSTRAP="[::1]:9092").kafka.bootstrap == "[::1]:9092"  # no YAML flow list


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("localhost:6379", "has no redis://, rediss:// or unix:// scheme"),
        ("", "redis.url is empty"),
        ("redis://u:pw@h:x/0", "malformed port"),
        ("redis:///0", "names no host"),
    ],
)
def test_a_malformed_redis_url_is_a_config_error_naming_the_variable(value: str, why: str) -> None:
    message = refused(areal(), why, "PRM_REDIS_URL=", PRM_REDIS_URL=value)
    assert "://?" not in message and "pw@" not in message  # never mangled, never the password


def test_online_samples_need_openclaws_recipe() -> None:
    """The online mode's samples are groups of one: only OpenClaw-RL's recipe trains them."""
    with pytest.raises(
        ConfigError, match="trainer.online_samples .* needs trainer.recipe 'openclaw_turns', got 'grpo'"
    ):
        build(areal() | {"trainer": {"online_samples": True}})
    cfg = build(areal() | {"trainer": {"online_samples": True, "recipe": "openclaw_turns"}})
    assert cfg.trainer.online_samples and cfg.trainer.recipe == "openclaw_turns"
