"""The judge server APIs: request payloads and answer parsing for OpenAI and SGLang.

Each adapter is one HTTP call through a :class:`~scoring_workers.scorers.judge_http.
JudgeClient` and knows only its API's wire format:

* :func:`openai_chat` — ``/v1/chat/completions`` (the server applies its chat template);
* :func:`sglang_generate_text` — SGLang ``/generate`` on a rendered prompt, with
  OpenClaw-RL's sampling parameters;
* :func:`sglang_input_logprobs` — SGLang ``/generate`` teacher forcing (``max_new_tokens
  = 0``) for the OPD teacher's log-probs.

:class:`JudgeEndpoint` picks one of the first two by ``api`` and carries the sampling
settings, so the scorers only say "ask the judge these messages".

What text is parsed (as OpenClaw-RL): its SGLang judge parses the raw generation,
thinking included. An OpenAI-compatible server with a reasoning parser moves the thinking
into ``message.reasoning_content`` (or ``reasoning``); :func:`openai_chat` returns it
followed by ``content`` (``include_reasoning=True``, the default), so a ``\\boxed{}``
that appears only in the thinking still counts and the *last* box still decides.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from scoring_workers.scorers.judge_errors import JudgeRequestError
from scoring_workers.scorers.judge_http import JudgeClient

__all__ = ["JUDGE_APIS", "JudgeEndpoint", "openai_chat", "sglang_generate_text", "sglang_input_logprobs"]

JUDGE_APIS = ("openai", "sglang")
_REASONING_FIELDS = ("reasoning_content", "reasoning")


def _answer_text(message: Mapping[str, Any], include_reasoning: bool) -> str:
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    if not include_reasoning:
        return text
    reasoning = next((message[k] for k in _REASONING_FIELDS if isinstance(message.get(k), str) and message[k]), "")
    if not reasoning:
        return text
    return f"{reasoning}\n{text}" if text else reasoning


async def openai_chat(
    client: JudgeClient,
    messages: Sequence[Mapping[str, Any]],
    *,
    model: str,
    temperature: float,
    max_tokens: int,
    top_p: float | None = 1.0,
    top_k: int | None = -1,
    include_reasoning: bool = True,
    deadline: float | None = None,
    extra: Mapping[str, Any] | None = None,
    affinity: str | None = None,
) -> str:
    """One OpenAI-compatible ``/v1/chat/completions`` call; returns the answer text.

    ``top_p`` / ``top_k`` are sent unless ``None`` (``top_k`` is an extension that vLLM
    and SGLang accept and OpenAI's own API refuses). The text is the reasoning (when the
    server split it off and ``include_reasoning``) then the content (module docstring).
    """
    payload: dict[str, Any] = {
        "model": model,
        "messages": [dict(m) for m in messages],
        "temperature": temperature,
        "max_tokens": max_tokens,
        "stream": False,
    }
    if top_p is not None:
        payload["top_p"] = top_p
    if top_k is not None:
        payload["top_k"] = top_k
    if extra:
        payload.update(extra)
    data = await client.post_json("/v1/chat/completions", payload, deadline=deadline, affinity=affinity)
    try:
        message = data["choices"][0]["message"]
        if not isinstance(message, Mapping):
            raise TypeError
    except (KeyError, IndexError, TypeError):
        raise JudgeRequestError(
            f"{client.name}/v1/chat/completions: unexpected response shape: {str(data)[:200]!r}",
            kind="bad_response",
        ) from None
    return _answer_text(message, include_reasoning)


async def sglang_generate_text(
    client: JudgeClient,
    text: str,
    *,
    temperature: float,
    max_new_tokens: int,
    deadline: float | None = None,
    affinity: str | None = None,
) -> str:
    """One SGLang ``/generate`` call on a rendered prompt (OpenClaw-RL's sampling params)."""
    payload = {
        "text": text,
        "sampling_params": {
            "temperature": temperature,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": max_new_tokens,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        },
        "return_logprob": False,
    }
    data = await client.post_json("/generate", payload, deadline=deadline, affinity=affinity)
    raw = data.get("text") if isinstance(data, Mapping) else data
    if isinstance(raw, list):
        raw = raw[0] if raw else ""
    if isinstance(raw, Mapping):
        raw = raw.get("text", "")
    if not isinstance(raw, str):
        raise JudgeRequestError(
            f"{client.name}/generate: unexpected response shape: {str(data)[:200]!r}", kind="bad_response"
        )
    return raw


async def sglang_input_logprobs(
    client: JudgeClient,
    input_ids: Sequence[int],
    *,
    logprob_start_len: int,
    deadline: float | None = None,
    affinity: str | None = None,
) -> list[float | None]:
    """Teacher-force ``input_ids`` through SGLang ``/generate`` (``max_new_tokens=0``) and
    return the log-prob column of ``meta_info.input_token_logprobs`` (one entry per
    position from ``logprob_start_len`` on; a position without context is ``None``)."""
    payload = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": int(logprob_start_len),
    }
    data = await client.post_json("/generate", payload, deadline=deadline, affinity=affinity)
    if isinstance(data, list):
        data = data[0] if data else {}
    try:
        rows = data["meta_info"]["input_token_logprobs"]
    except (KeyError, TypeError):
        raise JudgeRequestError(
            f"{client.name}/generate: no meta_info.input_token_logprobs in the answer", kind="bad_response"
        ) from None
    out: list[float | None] = []
    for row in rows:
        value = row[0] if isinstance(row, (list, tuple)) else (row.get("logprob") if isinstance(row, Mapping) else row)
        out.append(None if value is None else float(value))
    return out


class JudgeEndpoint:
    """One judge model behind a :class:`JudgeClient`: turns chat messages into the
    judge's answer text through ``api="openai"`` (``/v1/chat/completions``; the server
    applies its chat template) or ``api="sglang"`` (``/generate`` on a prompt rendered
    by ``chat_template``, default ChatML as used by Qwen judges).

    ``chat_template`` is a callable (resolve import paths from config with
    :func:`scoring_workers.prm.resolve.resolve_import` first). ``top_p`` / ``top_k`` /
    ``include_reasoning`` apply to ``api="openai"`` (SGLang always gets OpenClaw-RL's
    ``top_p = 1``, ``top_k = -1`` and is parsed raw, thinking included).
    """

    def __init__(
        self,
        client: JudgeClient,
        *,
        api: str = "openai",
        model: str = "default",
        temperature: float = 0.6,
        max_tokens: int = 4096,
        top_p: float | None = 1.0,
        top_k: int | None = -1,
        include_reasoning: bool = True,
        chat_template: Callable[[Sequence[Mapping[str, Any]]], str] | None = None,
    ) -> None:
        if api not in JUDGE_APIS:
            raise ValueError(f"api must be one of {JUDGE_APIS}, got {api!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature >= 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        if top_p is not None and (
            isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1
        ):
            raise ValueError(f"top_p must be a number in (0, 1] or null, got {top_p!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k == 0 or top_k < -1):
            raise ValueError(f"top_k must be -1 (off), an integer >= 1, or null (not sent), got {top_k!r}")
        if not isinstance(include_reasoning, bool):
            raise TypeError(f"include_reasoning must be a bool, got {include_reasoning!r}")
        if chat_template is not None and not callable(chat_template):
            raise TypeError(f"chat_template must be callable, got {chat_template!r}")
        self.client = client
        self.api = api
        self.model = model
        self.temperature = float(temperature)
        self.max_tokens = max_tokens
        self.top_p = None if top_p is None else float(top_p)
        self.top_k = top_k
        self.include_reasoning = include_reasoning
        if chat_template is None:
            from scoring_workers.scorers.conversation import render_chatml

            chat_template = render_chatml
        self.chat_template = chat_template

    async def complete(
        self, messages: Sequence[Mapping[str, Any]], *, deadline: float | None = None, affinity: str | None = None
    ) -> str:
        """The judge's answer text; ``affinity`` (a session id) keeps one session on one
        replica of a pool (:meth:`JudgeClient.post_json`)."""
        if self.api == "openai":
            return await openai_chat(
                self.client, messages, model=self.model, temperature=self.temperature,
                max_tokens=self.max_tokens, top_p=self.top_p, top_k=self.top_k,
                include_reasoning=self.include_reasoning, deadline=deadline, affinity=affinity,
            )
        text = self.chat_template(messages)
        if not isinstance(text, str):
            raise TypeError(f"chat_template must return a string, got {type(text).__name__}")
        return await sglang_generate_text(
            self.client, text, temperature=self.temperature, max_new_tokens=self.max_tokens, deadline=deadline,
            affinity=affinity,
        )
