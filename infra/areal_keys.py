"""The keys AReaL's own experiment config accepts, so that a whole AReaL YAML file loads.

A prm-pipeline config may be an AReaL training config (``rollout:`` / ``actor:`` next to
``gconfig:``, ``cluster:``...). :mod:`infra.config` refuses every key it does not know,
except these, which belong to AReaL and are accepted and ignored. The names are the
fields of the dataclasses in AReaL's ``areal/api/cli_args.py`` (``BaseExperimentConfig``
and its ``GRPOConfig`` / ``PPOConfig`` / ``SFTConfig`` / ``RWConfig`` / ``DPOConfig``
subclasses, ``InferenceEngineConfig``, ``AgentConfig``, ``PPOActorConfig``), united over
AReaL's history, plus Hydra's ``defaults`` / ``hydra`` (AReaL loads its YAML through
Hydra). Keys that AReaL's Process Rewards feature adds (``rollout.agent.prm``,
``actor.token_rewards_as_adv``...) are modelled in :mod:`infra.config` itself.

Inside ``rollout:``, ``rollout.agent:`` and ``actor:`` a key outside these lists is still
accepted unless it looks like a misspelling of a key prm-pipeline reads there (a newer
AReaL may add keys; a key we do not read cannot change what we do).
"""

from __future__ import annotations

AREAL_TOP_LEVEL_KEYS: frozenset[str] = frozenset({
    "actor", "allocation_mode", "async_training", "checkpointer", "cluster", "critic",
    "dynamic_bs", "enable_offload", "eval_gconfig", "evaluator", "experiment_name", "gconfig",
    "launcher", "memory_profiler", "model", "perf_tracer", "post_exit_hook", "recover", "ref",
    "rollout", "saver", "scheduler", "seed", "server_only", "sglang", "stats_logger", "teacher",
    "tokenizer_path", "total_train_epochs", "total_train_n_seqs", "total_train_steps",
    "train_dataset", "trial_name", "valid_dataset", "vllm", "weight_update_mode",
    # Hydra, through which AReaL reads its YAML
    "defaults", "hydra",
})

AREAL_ROLLOUT_KEYS: frozenset[str] = frozenset({
    "_version", "admin_api_key", "agent", "api_url", "backend", "check_trajectory_format",
    "consumer_batch_size", "deterministic_sampling", "dump_to_file", "enable_rollout_tracing",
    "experiment_name", "fileroot", "lora_name", "max_concurrent_rollouts",
    "max_head_offpolicyness", "model", "openai", "pause_grace_period", "poll_interval",
    "provider_api_key", "queue_size", "request_retries", "request_timeout",
    "return_routed_experts", "routing_strategy", "schedule_policy", "scheduling_spec",
    "scheduling_strategy", "serialize_group_samples", "setup_timeout", "tokenizer_path",
    "trial_name", "use_lora", "workers_ready_timeout",
})

AREAL_AGENT_KEYS: frozenset[str] = frozenset({
    "admin_api_key", "agent_cls_path", "chat_template_type", "drop_retry_orphans",
    "engine_max_tokens", "export_style", "message_preprocessors", "mode", "prefix_matcher",
    "reasoning_parser", "scheduling_spec", "session_timeout_seconds",
    "set_reward_finish_timeout", "subproc_max_workers", "tool_call_parser", "turn_discount",
})

AREAL_ACTOR_KEYS: frozenset[str] = frozenset({
    "_version", "admin_api_key", "adv_norm", "archon", "attn_impl", "backend",
    "behav_imp_weight_cap", "behave_imp_weight_cap", "behave_imp_weight_mode", "c_clip",
    "disable_dropout", "discount", "ds_auto_tp", "dtype", "dynamic_sampling",
    "enable_delta_weight_update", "enable_tree_training", "eps_clip", "eps_clip_higher",
    "experiment_name", "fsdp", "gae_lambda", "gae_lambda_kwargs", "gae_timestep_unit",
    "grad_reduce_dtype", "gradient_checkpointing", "group_adv_norm", "group_reward_norm",
    "group_size", "importance_sampling_level", "init_critic_from_actor", "init_from_scratch",
    "is_critic", "kl_ctl", "kl_estimator", "log_agent_stats", "log_agent_stats_keys", "log_level",
    "logprobs_chunk_size", "lora_alpha", "lora_rank", "m2_threshold", "mask_no_eos_with_zero",
    "max_new_tokens", "mb_spec", "megatron", "offload", "optimizer", "optimizer_dtype",
    "overlong_penalty_factor", "overlong_reward_penalty", "overlong_tokens", "pad_to_maximum",
    "path", "peft_type", "ppo_n_minibatches", "prox_logp_method", "recompute_logprob",
    "rejection_sampling", "request_timeout", "reward_bias", "reward_clip", "reward_norm",
    "reward_scaling", "sapo_tau_neg", "sapo_tau_pos", "scheduling_spec", "scheduling_strategy",
    "setup_timeout", "target_modules", "temperature", "trial_name", "use_cispo_loss",
    "use_decoupled_loss", "use_kernels", "use_lora", "use_sapo_loss",
    "weight_update_anchor_interval", "weight_update_delta_method", "weight_update_mode",
    "workers_ready_timeout",
})
