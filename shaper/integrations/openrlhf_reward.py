"""OpenRLHF's in-process reward hook: ``--reward.remote_url /path/to/openrlhf_reward.py``.

OpenRLHF (0.11.2, ``openrlhf/utils/agent.py``) loads a ``--reward.remote_url`` that ends
in ``.py`` by file path and calls its ``reward_func(queries, prompts, labels)`` in a
worker thread (``asyncio.to_thread``), one query per call. This file answers exactly what
the gateway's ``POST /openrlhf`` answers (docs/integrations/openrlhf.md), without an HTTP
hop: each query becomes a trajectory published to Kafka and the call blocks until its
group's verdict.

Why a background event loop: the Kafka clients are asyncio objects bound to one loop,
while OpenRLHF calls from many threads at once. One daemon thread runs one loop with one
:class:`~shaper.reward_client.RewardClient` for the whole process; each call hands its
coroutine to that loop and waits. The config is ``$PRM_CONFIG`` (set it in the rollout
actors' environment) unless :func:`configure` was called first.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any

from infra.config import PipelineConfig, load_config
from shaper.reward_client import RewardClient, SampleReward
from shaper.text_rewards import load_tokenizer, openrlhf_answer, reward_summary, samples_from_queries

__all__ = ["VerdictTimeout", "close", "configure", "reward_func", "samples_from_queries", "score_queries"]


class VerdictTimeout(TimeoutError):
    """No verdict within ``gateway.verdict_timeout_s`` (the HTTP route answers 504)."""


async def score_queries(client: RewardClient, cfg: PipelineConfig, tokenizer: Any, queries: Sequence[Any],
                        prompts: Sequence[Any], labels: Sequence[Any] | None = None) -> dict[str, Any]:
    """Score OpenRLHF's lists; the answer has the gateway's ``/openrlhf`` shape.

    Grouping (``gateway.grouping``) and the scalar (``gateway.process_reduction``) are the
    config's, as for the gateway. ``labels`` are accepted and not used (the scorers see
    the prompt and the response).
    """
    if not queries:
        raise ValueError("query must not be empty")
    if labels is not None and len(labels) != len(queries):
        raise ValueError("labels must have one item per query")
    samples = samples_from_queries(queries, prompts, tokenizer)
    groups = [samples] if cfg.gateway.grouping == "per_request" else [[s] for s in samples]
    scored: list[list[SampleReward]] = await asyncio.gather(
        *(client.score_group(g, group_id=f"openrlhf-{uuid.uuid4().hex}") for g in groups))
    late = next((rs[0] for rs in scored if rs[0].status == "timeout"), None)
    if late is not None:
        raise VerdictTimeout(late.reason + " (its trajectories are published; the workers may still decide it)")
    return openrlhf_answer([reward_summary(r, cfg.gateway.process_reduction) for rs in scored for r in rs])


class _Bridge:
    """One event loop in a daemon thread, owning the process's RewardClient."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.gateway.tokenizer)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="prm-openrlhf-reward", daemon=True)
        self.thread.start()
        try:
            self.client = self.run(self._make_client())
        except BaseException:  # Kafka unreachable: no thread left behind; the next call tries again
            self._stop_loop()
            raise

    async def _make_client(self) -> RewardClient:
        client = RewardClient(self.cfg, verdict_timeout_s=self.cfg.gateway.verdict_timeout_s,
                              decode=self.tokenizer.decode)
        await client.start()
        return client

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # waiting here would block the loop that must answer
            coro.close()
            raise RuntimeError("reward_func called from its own event loop; await score_queries instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        try:
            self.run(self.client.aclose())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


_lock = threading.Lock()
_config: PipelineConfig | None = None
_bridge: _Bridge | None = None


def configure(config: PipelineConfig | str | os.PathLike[str] | None) -> None:
    """Use ``config`` (a config or a YAML path) instead of ``$PRM_CONFIG``; closes a running client."""
    global _config
    close()
    with _lock:
        _config = config if isinstance(config, PipelineConfig) or config is None else load_config(config)


def close() -> None:
    """Flush and close the Kafka clients (also run at interpreter exit)."""
    global _bridge
    with _lock:
        bridge, _bridge = _bridge, None
    if bridge is not None:
        bridge.close()


def _get_bridge() -> _Bridge:
    global _bridge
    with _lock:
        if _bridge is None:
            _bridge = _Bridge(_config if _config is not None else load_config())
        return _bridge


def reward_func(queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any] | None = None,
                **kwargs: Any) -> dict[str, Any]:
    """OpenRLHF's hook: ``{"rewards", "scores", "extra_logs"}`` (plus ``status`` and ``reason``).

    ``rewards[i]`` = the query's outcome (0: text carries none) + the configured reduction
    of its process rewards (0 unless its group was accepted). A rejected group is an
    answer with ``status`` ``rejected``; no verdict in time raises :class:`VerdictTimeout`
    (OpenRLHF logs it and leaves the reward ``None``, as after its HTTP retries).
    """
    bridge = _get_bridge()
    return bridge.run(score_queries(bridge.client, bridge.cfg, bridge.tokenizer, list(queries), list(prompts),
                                    None if labels is None else list(labels)))


atexit.register(close)
