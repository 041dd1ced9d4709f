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
settings from them. Names are exported lazily (PEP 562): importing
``scoring_workers.judge.hosts`` (the CLI's checks) loads no HTTP code.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "ClientSettings": "settings",
    "ConnectionSettings": "settings",
    "LimitSettings": "settings",
    "ModelSettings": "settings",
    "RequestSettings": "settings",
    "SpillPolicy": "settings",
    "JudgeClient": "client",
    "JudgeEndpoint": "apis",
    "JudgeQuota": "settings",
    "judge_quota": "limits",
    "judge_hosts_allowed": "hosts",
    "CircuitOpenError": "errors",
    "JudgeFailedError": "errors",
    "JudgeRequestError": "errors",
    "JudgeTimeoutError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
