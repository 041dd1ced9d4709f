"""A branch conversation as the judge scorers read it: message text, the judged response,
the next state, and messages prepared for a chat template (all pure, no HTTP, no torch).

* :func:`message_text`, :func:`render_response_text` — a message's text (multimodal
  lists flattened) and the turn as our message view shows it to the judge;
* :func:`locate_next_state` — finding a turn's output and the environment's reply to it
  in the branch conversation (OpenClaw-RL's rule by default, ours as an option);
* :func:`normalize_template_messages`, :func:`render_chatml` — messages as OpenClaw-RL
  hands them to a chat template, and the ChatML rendering of an SGLang judge prompt.
"""

from __future__ import annotations

import copy
import json
import operator
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, get_args

from infra.config import ConfigError

__all__ = [
    "NEXT_STATE_RULES",
    "NextState",
    "NextStateRule",
    "locate_next_state",
    "message_text",
    "normalize_template_messages",
    "render_chatml",
    "render_response_text",
]


def render_chatml(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Render chat messages in ChatML (Qwen's template, which OpenClaw-RL's judge uses).

    Used to build the ``text`` of an SGLang ``/generate`` judge request when no
    ``chat_template`` callable is configured.
    """
    parts = [f"<|im_start|>{m.get('role', 'user')}\n{message_text(m)}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def message_text(message: Mapping[str, Any] | None) -> str:
    """A message's text: string content as is, multimodal lists joined (text parts only).

    As OpenClaw-RL's flattening: text parts joined by one space, a part without
    ``text`` counts as empty, ``None`` content is empty, anything else is ``str()``-ed.
    Two inputs upstream does not handle are accepted (docs/compatibility.md): a text
    part whose ``text`` is null (JSON ``null``) counts as empty, and a tuple of parts is
    flattened like a list.
    """
    if not message:
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = [
            "" if (text := item.get("text")) is None else str(text)
            for item in content
            if isinstance(item, Mapping) and item.get("type") == "text"
        ]
        return " ".join(parts)
    return "" if content is None else str(content)


def _tool_call_text(call: Any) -> str:
    if not isinstance(call, Mapping):
        return str(call)
    function = call.get("function")
    fn: Mapping[Any, Any] = function if isinstance(function, Mapping) else call
    name = fn.get("name", "")
    args = fn.get("arguments", "")
    if not isinstance(args, str):
        try:
            args = json.dumps(args, ensure_ascii=False, sort_keys=True, default=str)
        except (TypeError, ValueError):
            args = str(args)
    return f'<tool_call>{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args or "{}"}}}</tool_call>'


def render_response_text(output_messages: Sequence[Mapping[str, Any]]) -> str:
    """What the judge sees as "the assistant output": every output message's text plus
    its tool calls rendered as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``."""
    chunks: list[str] = []
    for message in output_messages:
        text = message_text(message)
        if text:
            chunks.append(text)
        for call in message.get("tool_calls") or ():
            chunks.append(_tool_call_text(call))
    return "\n".join(chunks)


class NextState(NamedTuple):
    """The environment's reply to a turn: ``conversation[position]`` with its role and text."""

    role: str
    text: str
    position: int


_SKIPPABLE_ROLES = frozenset({"system", "developer"})
_STATE_ROLES = frozenset({"user", "tool"})


def _same_message(a: Mapping[str, Any], b: Mapping[str, Any], *, strict_assistant: bool) -> bool:
    if a.get("role") != b.get("role"):
        return False
    if a.get("role") == "assistant" and not strict_assistant:
        # Agents often rewrite assistant history (reasoning stripped, tool calls
        # re-serialised); the role sequence plus every non-assistant message pins it.
        return True
    return message_text(a) == message_text(b)


def _output_matches(out: Sequence[Mapping[str, Any]], conv: Sequence[Mapping[str, Any]], at: int) -> bool:
    if at + len(out) > len(conv):
        return False
    return all(conv[at + i].get("role") == m.get("role") for i, m in enumerate(out))


NextStateRule = Literal["last", "first"]
"""Which message answers a turn (:func:`locate_next_state`)."""
NEXT_STATE_RULES: tuple[str, ...] = get_args(NextStateRule)


def locate_next_state(
    turn_messages: Sequence[Mapping[str, Any]],
    output_messages: Sequence[Mapping[str, Any]],
    conversation: Sequence[Mapping[str, Any]],
    rule: str = "last",
) -> tuple[bool, NextState | None]:
    """Find a turn's output in the branch ``conversation`` and the message that answers it.

    Returns ``(located, next_state)``. The turn's input ``turn_messages`` is the
    conversation *before* its output, so in a well-formed branch the output starts at
    ``len(turn_messages)`` (each later turn's messages extend the earlier ones).

    1. **Prefix rule** (the normal case): the first ``n = len(turn_messages)``
       conversation messages have the same roles as ``turn_messages`` and the same
       text for every non-assistant message (assistant history may be rewritten by
       the agent), and the output's roles follow at ``n``.
    2. **Search fallback** (history was truncated or summarised): the position of an
       assistant message whose text equals the output's first message; when several
       match, the one closest to ``n``.
    3. Otherwise the output is not in the conversation: ``(False, None)``.

    Then the next state, by ``rule``:

    * ``"last"`` (OpenClaw-RL): the **last** message before the next assistant message —
      the final message of the next request, whatever its role (``user``, ``tool``,
      ``system``..., role ``"user"`` when missing; an assistant message when nothing
      came between). No later assistant message (the branch's last turn: there is no
      next request) means no next state.
    * ``"first"`` (ours): skip ``system``/``developer`` messages after the output; the
      next message is the next state if its role is ``user`` or ``tool``, else none.
    """
    if rule not in NEXT_STATE_RULES:
        raise ConfigError(f"next-state rule must be one of {NEXT_STATE_RULES}, got {rule!r}")
    # Indexed as it is (the runner passes tuples): a long session's every turn would
    # otherwise copy the whole branch.
    conv = conversation if isinstance(conversation, (list, tuple)) else list(conversation)
    out = list(output_messages)
    n = len(turn_messages)
    start: int | None = None
    # Equal messages first: a session's turns share their history's message objects (an
    # expanded compact session, frozen once per run), which makes checking a long
    # session's every turn one C-level pointer comparison per message (a sequence
    # comparison tries identity before ``==``; ``map`` stops at the shorter one,
    # ``turn_messages``, as ``n <= len(conv)``).
    if (
        n <= len(conv)
        and (
            (
                conv[:n] == turn_messages
                if type(conv) is type(turn_messages)
                else all(map(operator.is_, conv, turn_messages))
            )
            or all(
                conv[i] is turn_messages[i] or _same_message(conv[i], turn_messages[i], strict_assistant=False)
                for i in range(n)
            )
        )
        and _output_matches(out, conv, n)
    ):
        start = n
    elif out:
        first_text = message_text(out[0])
        candidates = [
            j
            for j, message in enumerate(conv)
            if message.get("role") == out[0].get("role")
            and message_text(message) == first_text
            and _output_matches(out, conv, j)
        ]
        if candidates:
            start = min(candidates, key=lambda j: (abs(j - n), j))
    if start is None:
        return False, None
    i = start + len(out)
    if not out:  # no output messages recorded: skip the assistant run at ``start``
        while i < len(conv) and conv[i].get("role") == "assistant":
            i += 1
    if rule == "last":
        j = next((k for k in range(i, len(conv)) if conv[k].get("role") == "assistant"), None)
        if j is None or j == 0:
            return True, None
        last = conv[j - 1]
        return True, NextState(str(last.get("role") or "user"), message_text(last), j - 1)
    while i < len(conv) and conv[i].get("role") in _SKIPPABLE_ROLES:
        i += 1
    if i < len(conv) and conv[i].get("role") in _STATE_ROLES:
        return True, NextState(str(conv[i]["role"]), message_text(conv[i]), i)
    return True, None


def normalize_template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as OpenClaw-RL hands them to a chat template: ``developer`` becomes
    ``system`` and list contents are flattened to their text (:func:`message_text`).
    Returns copies; other keys (``tool_calls``, ``name``...) are kept."""
    out: list[dict[str, Any]] = []
    for message in messages:
        copy_ = copy.deepcopy(dict(message))
        if copy_.get("role") == "developer":
            copy_["role"] = "system"
        if isinstance(copy_.get("content"), (list, tuple)):
            copy_["content"] = message_text(copy_)
        out.append(copy_)
    return out
