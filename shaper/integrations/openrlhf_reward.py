"""OpenRLHF's in-process reward hook: ``--reward.remote_url /path/to/openrlhf_reward.py``.

OpenRLHF (0.11.2, ``openrlhf/utils/agent.py``) loads a ``--reward.remote_url`` that ends
in ``.py`` by file path and calls its ``reward_func(queries, prompts, labels)`` in a
worker thread (``asyncio.to_thread``), one query per call. This file answers exactly what
the gateway's ``POST /openrlhf`` answers — both call :func:`shaper.integrations.core.openrlhf_scores`
(docs/integrations/openrlhf.md) — without an HTTP hop: each query becomes a trajectory
published to Kafka and the call blocks until its group's verdict.

OpenRLHF calls from many threads, and the Kafka clients are asyncio objects bound to one
loop: one :class:`~shaper.integrations.core.LoopClient` runs one client for the whole
process and every call waits on it. The config is ``$PRM_CONFIG`` (set it in the rollout
actors' environment) unless :func:`configure` was called first.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Sequence
from typing import Any

from infra.config import PipelineConfig, load_config
from shaper.integrations.core import LoopClient, ShapingInputError, TextScorer, VerdictTimeout, openrlhf_scores
from shaper.reward_client import RewardClient
from shaper.text_rewards import samples_from_queries

__all__ = ["VerdictTimeout", "close", "configure", "reward_func", "samples_from_queries", "score_queries"]


async def score_queries(
    client: RewardClient,
    cfg: PipelineConfig,
    tokenizer: Any,
    queries: Sequence[Any],
    prompts: Sequence[Any],
    labels: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Score OpenRLHF's lists; the answer has the gateway's ``/openrlhf`` shape.

    ``labels`` are accepted and not used (the scorers see the prompt and the response).
    """
    if not queries:
        raise ShapingInputError("query must not be empty")
    if labels is not None and len(labels) != len(queries):
        raise ShapingInputError("labels must have one item per query")
    return await openrlhf_scores(client, cfg.gateway, samples_from_queries(queries, prompts, tokenizer))


_config: PipelineConfig | None = None


async def _started() -> TextScorer:
    return await TextScorer.started(_config if _config is not None else load_config())


_hook: LoopClient[TextScorer] = LoopClient(_started, "prm-openrlhf-reward")


def configure(config: PipelineConfig | str | os.PathLike[str] | None) -> None:
    """Use ``config`` (a config or a YAML path) instead of ``$PRM_CONFIG``; closes a running client."""
    global _config
    close()
    _config = config if isinstance(config, PipelineConfig) or config is None else load_config(config)


def close() -> None:
    """Flush and close the Kafka clients (also run at interpreter exit)."""
    _hook.close(timeout=None)


def reward_func(
    queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any] | None = None, **kwargs: Any
) -> dict[str, Any]:
    """OpenRLHF's hook: ``{"rewards", "scores", "extra_logs"}`` (plus ``status``, ``reason_code`` and ``reason``).

    ``rewards[i]`` = the query's outcome (0: text carries none) + the configured reduction
    of its process rewards (0 unless its group was accepted). A rejected group is an
    answer with ``status`` ``rejected``; no verdict in time raises :class:`VerdictTimeout`
    (OpenRLHF logs it and leaves the reward ``None``, as after its HTTP retries).
    """
    return _hook.run(
        lambda s: score_queries(
            s.client, s.cfg, s.tokenizer, list(queries), list(prompts), None if labels is None else list(labels)
        )
    )


atexit.register(close)
