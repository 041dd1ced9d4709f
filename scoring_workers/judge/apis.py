"""The judge server APIs: request payloads and answer parsing for OpenAI and SGLang.

Each adapter is one HTTP call through a :class:`~scoring_workers.judge.client.JudgeClient`
and knows only its API's wire format:

* :func:`openai_chat` — ``/v1/chat/completions`` (the server applies its chat template);
* :func:`sglang_generate_text` — SGLang ``/generate`` on a rendered prompt, with
  OpenClaw-RL's sampling parameters;
* :func:`sglang_input_logprobs` — SGLang ``/generate`` teacher forcing (``max_new_tokens
  = 0``) for the OPD teacher's log-probs.

:class:`JudgeEndpoint` picks one of the first two by ``api`` and carries the model and
sampling settings (one :class:`~scoring_workers.judge.settings.ModelSettings`, which the
first two adapters read too), so the scorers only say "ask the judge these messages".

What text is parsed (as OpenClaw-RL): its SGLang judge parses the raw generation,
thinking included. An OpenAI-compatible server with a reasoning parser moves the thinking
into ``message.reasoning_content`` (or ``reasoning``); :func:`openai_chat` returns it
followed by ``content`` (``include_reasoning=True``, the default), so a ``\\boxed{}``
that appears only in the thinking still counts and the *last* box still decides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from scoring_workers.judge.client import JudgeClient
from scoring_workers.judge.errors import JudgeRequestError
from scoring_workers.judge.settings import ModelSettings

__all__ = ["JudgeEndpoint", "openai_chat", "sglang_generate_text", "sglang_input_logprobs"]

_DEFAULTS = ModelSettings()
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
    settings: ModelSettings,
    *,
    deadline: float | None = None,
    extra: Mapping[str, Any] | None = None,
    affinity: str | None = None,
) -> str:
    """One OpenAI-compatible ``/v1/chat/completions`` call; returns the answer text.

    ``settings``' ``top_p`` / ``top_k`` are sent unless ``None`` (``top_k`` is an
    extension that vLLM and SGLang accept and OpenAI's own API refuses). The text is the
    reasoning (when the server split it off and ``include_reasoning``) then the content
    (module docstring).
    """
    payload: dict[str, Any] = {
        "model": settings.model,
        "messages": [dict(m) for m in messages],
        "temperature": settings.temperature,
        "max_tokens": settings.max_tokens,
        "stream": False,
    }
    if settings.top_p is not None:
        payload["top_p"] = settings.top_p
    if settings.top_k is not None:
        payload["top_k"] = settings.top_k
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
    return _answer_text(message, settings.include_reasoning)


async def sglang_generate_text(
    client: JudgeClient,
    text: str,
    settings: ModelSettings,
    *,
    deadline: float | None = None,
    affinity: str | None = None,
) -> str:
    """One SGLang ``/generate`` call on a rendered prompt: ``settings``' temperature and
    ``max_tokens``, OpenClaw-RL's other sampling parameters."""
    payload = {
        "text": text,
        "sampling_params": {
            "temperature": settings.temperature,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": settings.max_tokens,
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
    by ``chat_template``, default ChatML as used by Qwen judges), as ``settings`` say.

    ``chat_template`` is a callable (resolve import paths from config with
    :func:`scoring_workers.prm.resolve.resolve_import` first).
    """

    def __init__(
        self,
        client: JudgeClient,
        settings: ModelSettings = _DEFAULTS,
        *,
        chat_template: Callable[[Sequence[Mapping[str, Any]]], str] | None = None,
    ) -> None:
        if not isinstance(settings, ModelSettings):
            raise TypeError(f"settings must be a ModelSettings, got {type(settings).__name__}")
        if chat_template is not None and not callable(chat_template):
            raise TypeError(f"chat_template must be callable, got {chat_template!r}")
        self.client = client
        self.settings = settings
        if chat_template is None:
            from scoring_workers.scorers.conversation import render_chatml

            chat_template = render_chatml
        self.chat_template = chat_template

    @property
    def api(self) -> str:
        return self.settings.api

    @property
    def model(self) -> str:
        return self.settings.model

    @property
    def temperature(self) -> float:
        return self.settings.temperature

    async def complete(
        self, messages: Sequence[Mapping[str, Any]], *, deadline: float | None = None, affinity: str | None = None
    ) -> str:
        """The judge's answer text; ``affinity`` (a session id) keeps one session on one
        replica of a pool (:meth:`JudgeClient.post_json`)."""
        if self.settings.api == "openai":
            return await openai_chat(self.client, messages, self.settings, deadline=deadline, affinity=affinity)
        text = self.chat_template(messages)
        if not isinstance(text, str):
            raise TypeError(f"chat_template must return a string, got {type(text).__name__}")
        return await sglang_generate_text(self.client, text, self.settings, deadline=deadline, affinity=affinity)
