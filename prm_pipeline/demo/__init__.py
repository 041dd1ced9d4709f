"""Demo and test support: everything ``make demo``, the tests and the benchmarks need
that the product does not.

Kept apart so the production packages (``infra``, ``producers``, ``scoring_workers``,
``shaper`` and the rest of ``prm_pipeline``) never import it; nothing here is part of
the pipeline a user deploys.

========================  ==============================================================
``run``                   ``prm-pipeline demo``: the closed loop and its checks
``report``                the demo's HTML report (matplotlib)
``tiny_model``            a seeded tiny Llama + BPE tokenizer + chat template, weight store
``rollout_proxy``         the tiny policy in a toy multi-turn environment, published to Kafka
``policy_update``         a PPO-clip step on a :class:`~shaper.batch.TrainingBatch`
``model_server``          ``prm-pipeline model-server``: the tiny LM over SGLang/OpenAI HTTP
``fake_judge``            ``prm-pipeline fake-judge``: a scripted judge/teacher over real HTTP
``synthetic``             synthetic token-backed groups for tests and benchmarks
``processes``             ``prm-pipeline worker`` children for the demo, tests, benchmarks
========================  ==============================================================

This package's ``__init__`` imports nothing, so the torch-free and ``transformers``-free
modules (``synthetic``, ``processes``, ``fake_judge``) stay cheap to import.
"""
