"""Rewards for trainers that speak text: tokenizers, OpenRLHF's query lists, one scalar per sample.

OpenRLHF and slime send text (OpenRLHF: ``query`` = prompt + response and ``prompts``;
slime: ``prompt`` and ``response``) and take one number per sample back. The gateway's
``/openrlhf`` and ``/slime`` routes and the in-process adapters
(:mod:`shaper.integrations.openrlhf_reward`, :mod:`shaper.integrations.slime_rm`) share
this module and the scoring functions of :mod:`shaper.integrations.core`, so a trainer
gets the same tokens and the same number whichever way it calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from infra.config import ConfigError
from shaper.errors import ShapingInputError
from shaper.reward_client import Sample, SampleReward, reduce_process


class ByteTokenizer:
    """UTF-8 bytes as token ids: needs no files, so the gateway works out of the box.

    Use a real tokenizer (``gateway.tokenizer: path/to/tokenizer.json``) whenever the
    scorers' token counts must match the policy's.
    """

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


class FileTokenizer:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` package), special tokens kept as text."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - depends on the install
            raise ConfigError(
                "gateway.tokenizer names a file, which needs the 'tokenizers' package "
                "(pip install 'prm-pipeline[tokenizer]')"
            ) from None
        if not Path(path).is_file():
            raise ConfigError(f"gateway.tokenizer: {path!r} is not a file (a tokenizer.json, or 'bytes')")
        self.name = Path(path).name
        self._tok = Tokenizer.from_file(path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str) -> ByteTokenizer | FileTokenizer:
    """``gateway.tokenizer``: ``bytes`` or a ``tokenizer.json`` path."""
    return ByteTokenizer() if spec == "bytes" else FileTokenizer(spec)


def prompt_messages(prompt: Any, field: str = "prompt") -> tuple[str, list[dict[str, Any]]]:
    """A prompt (slime sends a string or a message list) as text plus chat messages.

    Raises ValueError naming ``field`` for anything else.
    """
    if isinstance(prompt, str):
        return prompt, [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt):
        messages = [{"role": str(m.get("role", "user")), "content": m["content"]} for m in prompt]
        return "".join(m["content"] for m in messages), messages
    raise ShapingInputError(f"{field} must be a string or a list of messages with string 'content'")


def samples_from_queries(queries: Sequence[Any], prompts: Sequence[Any], tokenizer: Any) -> list[Sample]:
    """OpenRLHF's ``query`` (prompt + response text) and ``prompts`` as token-id samples.

    Raises ValueError naming the item that breaks OpenRLHF's shape.
    """
    if len(prompts) != len(queries):
        raise ShapingInputError(f"prompts has {len(prompts)} items for {len(queries)} queries")
    samples = []
    for i, (query, prompt) in enumerate(zip(queries, prompts)):
        if not isinstance(query, str) or not isinstance(prompt, str):
            raise ShapingInputError(f"query[{i}] and prompts[{i}] must be strings")
        if not query.startswith(prompt):
            raise ShapingInputError(f"query[{i}] does not start with prompts[{i}] (OpenRLHF sends prompt + response)")
        samples.append(
            Sample(
                prompt_ids=tokenizer.encode(prompt),
                response_ids=tokenizer.encode(query[len(prompt) :]),
                messages=[{"role": "user", "content": prompt}],
            )
        )
    return samples


def reward_summary(reward: SampleReward, how: str) -> dict[str, Any]:
    """``score`` = outcome + the reduced process rewards (0 unless accepted), with the parts, the status
    and why (``reason_code`` for programs, ``reason`` for people)."""
    process = reduce_process(reward, how)  # type: ignore[arg-type]
    return {
        "score": reward.outcome + process,
        "outcome": reward.outcome,
        "process": process,
        "status": reward.status,
        "reason_code": reward.reason_code,
        "reason": reward.reason,
        "group_id": reward.group_id,
    }


def openrlhf_answer(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """OpenRLHF's remote-RM answer (``rewards``, ``scores``, ``extra_logs``) plus status, reason code and
    reason per query."""
    return {
        "rewards": [s["score"] for s in summaries],
        "scores": [s["score"] for s in summaries],
        "extra_logs": {
            "prm_outcome": [s["outcome"] for s in summaries],
            "prm_process": [s["process"] for s in summaries],
            "prm_accepted": [float(s["status"] == "accepted") for s in summaries],
        },
        "status": [s["status"] for s in summaries],
        "reason_code": [s["reason_code"] for s in summaries],
        "reason": [s["reason"] for s in summaries],
    }
