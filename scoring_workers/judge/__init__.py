"""The LLM judge: the HTTP client, its limits and routing, the judge APIs and OpenClaw-RL's
judging logic — one component, configured by frozen settings structs.

==================  ==================================================================
module              what it holds
==================  ==================================================================
``settings``        :class:`ClientSettings` (its parts: requests, limits, connection,
                    spill policy) and :class:`ModelSettings`: msgspec structs, bounded
``client``          :class:`JudgeClient`: timeouts, retries, pool routing, limits
``transport``       HTTP/1.1 keep-alive connections on asyncio protocols (llhttp)
``limits``          per-endpoint concurrency cap, pacing, circuit breaker; quotas per
                    experiment; one way through both (a slot, then pacing)
``pool``            choosing a pool's endpoint: affinity, spill-over, failover
``hosts``           ``worker.allowed_judge_hosts``: which hosts may get trajectories
``apis``            OpenAI chat completions and SGLang ``/generate``: :class:`JudgeEndpoint`
``prompts``         OpenClaw-RL's judge prompts and answer parsing
``voting``          majority and adaptive voting
``errors``          :class:`JudgeRequestError` and kin, :class:`JudgeFailedError`
==================  ==================================================================

The scorers that use it (:mod:`scoring_workers.scorers.openclaw`,
:mod:`scoring_workers.scorers.opd`) keep their flat keyword arguments and build the
settings from them. Import names from their modules; the package itself imports none, so
importing ``scoring_workers.judge.hosts`` (the CLI's checks) loads no HTTP code.
"""
