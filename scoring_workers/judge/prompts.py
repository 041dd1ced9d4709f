"""OpenClaw-RL's judge prompts and answer parsing, as plain functions (no HTTP, no torch).

* :func:`parse_boxed_score` — the PRM judge's ``\\boxed{}`` parsing exactly as
  OpenClaw-RL (``openclaw-rl/openclaw_api_server.py``: ``_parse_prm_score``).
* :func:`parse_hint_judgement`, :func:`select_best_hint`,
  :func:`append_hint_to_messages` — the OPD hint judge
  (``openclaw-opd/openclaw_opd_api_server.py``: ``_parse_judge_result``,
  ``_select_best_hint``, ``_append_hint_to_messages``).
* :func:`build_prm_judge_messages`, :func:`build_hint_judge_messages` — the two judge
  prompts (role-aware: a successful tool output is positive evidence, a user change
  request is negative evidence).

Combining the votes is :mod:`scoring_workers.judge.voting`; reading the branch
conversation (next state, response text, template messages) is
:mod:`scoring_workers.scorers.conversation`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from typing import Any

from scoring_workers.scorers.conversation import message_text

__all__ = [
    "HINT_JUDGE_SYSTEM",
    "HINT_SUFFIX_HEADER",
    "PRM_JUDGE_SYSTEM",
    "append_hint_to_messages",
    "build_hint_judge_messages",
    "build_prm_judge_messages",
    "parse_boxed_score",
    "parse_hint_judgement",
    "select_best_hint",
]

# --------------------------------------------------------------------------- parsing
# OpenClaw-RL's regex, character for character: ``\boxed{`` + one optional sign + one
# digit + ``}``. ``\d`` is Python's Unicode digit class, as in OpenClaw-RL (so a
# full-width "１" parses as 1, exactly like the reference implementation).
_BOXED_RE = re.compile(r"\\boxed\{([-+]?\d)\}")
_HINT_RE = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.DOTALL)

_PRM_VALUES = frozenset({1, 0, -1})
_HINT_VALUES = frozenset({1, -1})


def parse_boxed_score(text: str | None) -> int | None:
    """The judge's score: the last ``\\boxed{s}`` (``s`` = optional sign + one digit).

    Only ``1``, ``0`` and ``-1`` are valid; any other value of that last box gives
    ``None`` — an invalid last box never falls back to an earlier one. Boxes that are
    not ``sign? digit`` (``\\boxed{1.0}``, ``\\boxed{ 1 }``, ``\\boxed{10}``) are not
    candidates at all, as with OpenClaw-RL's ``findall``. No candidate -> ``None``.
    ``None`` text (an OpenAI-compatible answer with ``content: null``) -> ``None``, a
    failed vote; OpenClaw-RL's parser would raise ``TypeError``, but its SGLang and
    Tinker paths always have text (docs/compatibility.md).

    >>> parse_boxed_score("so \\\\boxed{+1}"), parse_boxed_score("\\\\boxed{-0}")
    (1, 0)
    >>> parse_boxed_score("\\\\boxed{1} then \\\\boxed{5}") is None
    True
    """
    if not text:
        return None
    matches = _BOXED_RE.findall(text)
    if not matches:
        return None
    value = int(matches[-1])
    return value if value in _PRM_VALUES else None


def parse_hint_judgement(text: str | None) -> tuple[int | None, str]:
    """``(score, hint)`` from a hint-judge answer.

    ``score`` is the last ``sign? digit`` box and must be ``1`` or ``-1`` (``0`` and
    anything else -> ``None``); ``hint`` is the stripped text of the last
    ``[HINT_START]...[HINT_END]`` block (may span lines), ``""`` if there is none.
    """
    if not text:
        return None, ""
    boxed = _BOXED_RE.findall(text)
    score: int | None = int(boxed[-1]) if boxed else None
    if score not in _HINT_VALUES:
        score = None
    hints = _HINT_RE.findall(text)
    return score, (hints[-1].strip() if hints else "")


def select_best_hint(judgements: Sequence[Any]) -> str | None:
    """The longest stripped hint among votes with score ``1`` and a stripped hint longer
    than 10 characters; ties -> the earliest; none -> ``None``.

    Items are ``(score, hint)`` pairs, mappings with ``"score"``/``"hint"`` keys, or
    ``None`` (a failed vote, skipped). A score counts when it equals ``1`` (``True``
    and ``1.0`` too), exactly OpenClaw-RL's ``v.get("score") == 1``.
    """
    best: str | None = None
    for item in judgements:
        if item is None:
            continue
        if isinstance(item, Mapping):
            score, hint = item.get("score"), item.get("hint")
        else:
            score, hint = item
        if score != 1 or not isinstance(hint, str):
            continue
        hint = hint.strip()
        if len(hint) > 10 and (best is None or len(hint) > len(best)):
            best = hint
    return best


# --------------------------------------------------------------------------- prompts
_ROLE_DOC = (
    "- role='user': A reply from the user.\n"
    "- role='tool': The return value of a tool the assistant invoked. "
    "This content was NOT available before the assistant's action — "
    "it exists BECAUSE the assistant called the tool. "
)

PRM_JUDGE_SYSTEM = (
    "You are a process reward model (PRM) evaluating an AI assistant.\n"
    "You will see the assistant's output and the subsequent next state.\n"
    "Your task: decide whether the assistant's output **successfully fulfilled** the user's intent "
    "at that step, using the next state as evidence.\n\n"
    "## Understanding the next state's role\n"
    + _ROLE_DOC
    + "A successful, non-error tool output means the assistant's action worked correctly "
    "and should be scored positively.\n\n"
    "## Scoring rules\n"
    "- \\boxed{1} (good): The next state shows the task progressed as expected — "
    "e.g. the user moves on, says thanks, the environment confirms success, "
    "or a tool returns a successful, non-error result.\n"
    "- \\boxed{-1} (bad): The next state signals the assistant's output was wrong, "
    "incomplete, or unwanted. **Key negative signals include:**\n"
    "  * The user asks the assistant to **redo, retry, or repeat** the same action "
    '("do it again", "try again", "one more time").\n'
    "  * The user requests a **correction or modification** to what the assistant just did "
    '("change X to Y", "no, I meant …", "not that, …", "please fix …").\n'
    "  * The user **rephrases or restates** the same request, implying the assistant "
    "did not understand or execute it correctly.\n"
    "  * The environment returns an **error, failure, or unexpected result** caused "
    "by the assistant's action.\n"
    "- \\boxed{0} (neutral): The next state is ambiguous — e.g. the user gives an "
    "unrelated follow-up that neither confirms nor denies success, or there is "
    "insufficient information to judge.\n\n"
    "## Important\n"
    "A change request IS negative feedback — it means the previous output did not "
    "meet the user's need. Do NOT treat it as a neutral new instruction.\n\n"
    "Think step-by-step, then give your final score inside \\boxed{}."
)
"""System prompt of the PRM judge (OpenClaw-RL's role-aware ``_build_prm_judge_prompt``)."""

HINT_JUDGE_SYSTEM = (
    "You are a process reward model used for hindsight hint extraction.\n"
    "You are given:\n"
    "1) The assistant response at turn t.\n"
    "2) The next state at turn t+1, along with its **role**.\n\n"
    "## Understanding the next state's role\n"
    "- role='user': A reply from the user (follow-up, correction, new request, etc.).\n"
    "- role='tool': The return value of a tool the assistant invoked. "
    "This content was NOT available before the assistant's action — "
    "it exists BECAUSE the assistant called the tool. "
    "A successful, non-error tool output generally means the assistant's "
    "action was appropriate; do NOT treat it as information the assistant "
    "should have already known.\n\n"
    "Your goal is to decide whether the next state reveals useful hindsight information\n"
    "that could have helped improve the assistant response at turn t.\n\n"
    "Output format rules (strict):\n"
    "- You MUST include exactly one final decision token: \\boxed{1} or \\boxed{-1}.\n"
    "- If and only if decision is \\boxed{1}, provide a concise, information-dense hint in 1-3 sentences,\n"
    "  wrapped between [HINT_START] and [HINT_END].\n"
    "- If decision is \\boxed{-1}, do not provide a hint block.\n"
    "- Hint must be concrete and actionable for improving the previous response."
)
"""System prompt of the OPD hint judge (OpenClaw-RL's ``_build_hint_judge_messages``)."""


def _judge_messages(
    system: str, response: tuple[str, str], next_state: tuple[str, str], ask: str
) -> list[dict[str, str]]:
    """``system``, then a user message: each ``(heading, text)`` section, then ``ask``."""
    user = "".join(f"{heading}\n{text}\n\n" for heading, text in (response, next_state)) + ask
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def build_prm_judge_messages(
    response_text: str, next_state_text: str, next_state_role: str = "user"
) -> list[dict[str, str]]:
    """Chat messages asking the judge to score ``response_text`` given the next state."""
    return _judge_messages(
        PRM_JUDGE_SYSTEM,
        ("## Assistant output", response_text),
        (f"## Next state [role: {next_state_role}]", next_state_text),
        "First, classify the next state: is it (a) positive progression, "
        "(b) a correction / redo / change request, or (c) ambiguous? "
        "Then assign \\boxed{1}, \\boxed{-1}, or \\boxed{0}.",
    )


def build_hint_judge_messages(
    response_text: str, next_state_text: str, next_state_role: str = "user"
) -> list[dict[str, str]]:
    """Chat messages asking the judge for a hindsight hint (``\\boxed{1}`` + hint block)."""
    return _judge_messages(
        HINT_JUDGE_SYSTEM,
        ("## Assistant response (turn t)", response_text),
        (f"## Next state (turn t+1) [role: {next_state_role}]", next_state_text),
        "Now output your decision and (if positive) the hint in the required format.",
    )


HINT_SUFFIX_HEADER = "[user's hint / instruction]"


def append_hint_to_messages(messages: Sequence[Mapping[str, Any]], hint: str) -> list[dict[str, Any]]:
    """A private copy of ``messages`` with ``hint`` appended to the last user message.

    As OpenClaw-RL: the suffix is ``"\\n\\n[user's hint / instruction]\\n" + hint`` and
    the content is flattened to text; with no user message the last message gets it;
    with no messages at all a single user message carrying the hint is returned.
    Input messages (possibly read-only) are never modified.
    """
    cloned = [copy.deepcopy(dict(m)) for m in messages]
    if not cloned:
        return [{"role": "user", "content": f"{HINT_SUFFIX_HEADER}\n{hint.strip()}"}]
    target = next((i for i in range(len(cloned) - 1, -1, -1) if cloned[i].get("role") == "user"), len(cloned) - 1)
    content = message_text(cloned[target])
    cloned[target]["content"] = (content + f"\n\n{HINT_SUFFIX_HEADER}\n{hint.strip()}").strip()
    return cloned
