"""OpenClaw-RL's LLM-judge logic as plain, dependency-free functions.

Everything here is pure (no HTTP, no torch) so it can be unit-tested exhaustively and
reused by any scorer:

* :func:`parse_boxed_score`, :func:`majority_vote` — the PRM judge's ``\\boxed{}``
  parsing and ``m``-vote majority exactly as OpenClaw-RL
  (``openclaw-rl/openclaw_api_server.py``: ``_parse_prm_score``, ``_majority_vote``).
* :func:`parse_hint_judgement`, :func:`select_best_hint`,
  :func:`append_hint_to_messages` — the OPD hint judge
  (``openclaw-opd/openclaw_opd_api_server.py``: ``_parse_judge_result``,
  ``_select_best_hint``, ``_append_hint_to_messages``).
* :func:`build_prm_judge_messages`, :func:`build_hint_judge_messages` — the two judge
  prompts (role-aware: a successful tool output is positive evidence, a user change
  request is negative evidence).
* :func:`decided_outcome`, :func:`votes_to_request`, :func:`run_votes` — **adaptive
  voting**: request judge votes in the smallest batches that can still change the
  outcome and stop as soon as the majority is decided. It is *exact*: for every
  possible sequence of votes over ``{1, 0, -1, None}`` the result equals
  ``majority_vote`` of all ``m`` votes (proved below and tested exhaustively).
Reading the branch conversation (next state, response text, template messages) lives in
:mod:`scoring_workers.scorers.conversation`.

Adaptive voting, why it is exact
--------------------------------
``majority_vote`` drops ``None`` (failed or unparseable votes), returns ``0.0`` when
nothing is left, the most common value when it is unique, and ``0.0`` on a tie for
the top count. After some votes with counts ``c[1], c[0], c[-1]`` and ``r`` votes
still to come, the outcome is **decided** iff it is the same for every completion of
the ``r`` remaining votes:

* it is certainly ``v in {1, -1}`` iff ``c[v] > c[w] + r`` for both other values
  ``w`` (the worst completion gives all ``r`` votes to one rival; ``None`` votes
  change no count);
* it is certainly ``0.0`` iff for both ``v in {1, -1}``,
  ``c[v] + r <= max(c[w] for w != v)`` (the completion most favourable to ``v``
  gives it all ``r`` votes; if ``v`` still does not beat every rival it never wins
  alone, and an outcome that is never ``1`` nor ``-1`` is always ``0.0``).

These two conditions are necessary and sufficient, so stopping when one holds never
changes the result. Among the strategies that look at votes one at a time, none
can stop earlier; :func:`votes_to_request` batches the votes that every such
strategy would have to request anyway (the fewest further votes after which the
outcome *could* be decided), so the number of calls equals the one-at-a-time
optimum while the latency is that of a few parallel rounds. For ``m = 3``: ask two;
if they agree (``1,1`` / ``0,0`` / ``-1,-1``) skip the third.
"""

from __future__ import annotations

import asyncio
import copy
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

from scoring_workers.scorers.conversation import message_text

__all__ = [
    "HINT_SUFFIX_HEADER",
    "JudgeFailedError",
    "Vote",
    "VoteResult",
    "append_hint_to_messages",
    "build_hint_judge_messages",
    "build_prm_judge_messages",
    "decided_outcome",
    "gather_or_cancel",
    "majority_vote",
    "parse_boxed_score",
    "parse_hint_judgement",
    "run_votes",
    "select_best_hint",
    "votes_to_request",
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


def majority_vote(votes: Sequence[int | None]) -> float:
    """OpenClaw-RL's majority: drop ``None``; none left -> ``0.0``; the most common
    value wins; a tie for the top count -> ``0.0``."""
    counter = Counter(v for v in votes if v is not None)
    if not counter:
        return 0.0
    (top_value, top_count), *_ = counter.most_common(1)
    if sum(1 for count in counter.values() if count == top_count) > 1:
        return 0.0
    return float(top_value)


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


def build_prm_judge_messages(
    response_text: str, next_state_text: str, next_state_role: str = "user"
) -> list[dict[str, str]]:
    """Chat messages asking the judge to score ``response_text`` given the next state."""
    user = (
        f"## Assistant output\n{response_text}\n\n"
        f"## Next state [role: {next_state_role}]\n{next_state_text}\n\n"
        "First, classify the next state: is it (a) positive progression, "
        "(b) a correction / redo / change request, or (c) ambiguous? "
        "Then assign \\boxed{1}, \\boxed{-1}, or \\boxed{0}."
    )
    return [{"role": "system", "content": PRM_JUDGE_SYSTEM}, {"role": "user", "content": user}]


def build_hint_judge_messages(
    response_text: str, next_state_text: str, next_state_role: str = "user"
) -> list[dict[str, str]]:
    """Chat messages asking the judge for a hindsight hint (``\\boxed{1}`` + hint block)."""
    user = (
        f"## Assistant response (turn t)\n{response_text}\n\n"
        f"## Next state (turn t+1) [role: {next_state_role}]\n{next_state_text}\n\n"
        "Now output your decision and (if positive) the hint in the required format."
    )
    return [{"role": "system", "content": HINT_JUDGE_SYSTEM}, {"role": "user", "content": user}]


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


# --------------------------------------------------------------------------- voting
class JudgeFailedError(RuntimeError):
    """Every judge vote of a turn failed (transport error or unparseable answer).

    Raised by the judge scorers when ``on_all_votes_failed="reject"`` (the default):
    a judge that could not decide must never look like a real ``0.0``. ``reason``
    is the stable rejection code the worker records (``getattr(exc, "reason")``).
    """

    reason = "judge_failed"

    def __init__(
        self,
        message: str,
        *,
        interaction_id: str | None = None,
        calls: int = 0,
        errors: int = 0,
        invalid: int = 0,
        last_error: str | None = None,
    ) -> None:
        super().__init__(message)
        self.interaction_id = interaction_id
        self.calls = calls
        self.errors = errors
        self.invalid = invalid
        self.last_error = last_error

    def __reduce__(self):  # keep the keyword-only fields when pickled
        return (
            _rebuild_judge_failed,
            (str(self), self.interaction_id, self.calls, self.errors, self.invalid, self.last_error),
        )


def _rebuild_judge_failed(message, interaction_id, calls, errors, invalid, last_error):
    return JudgeFailedError(
        message, interaction_id=interaction_id, calls=calls, errors=errors, invalid=invalid, last_error=last_error
    )


class Vote(NamedTuple):
    """One judge call: the parsed score (``None`` = no valid vote), the judge's text
    (``None`` when the call failed) and the error description (``None`` on success)."""

    score: int | None
    text: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class VoteResult:
    """Outcome of :func:`run_votes` (votes are in request order)."""

    score: float
    votes: tuple[Vote, ...]
    budget: int
    escalated: bool = False

    @property
    def calls(self) -> int:
        return len(self.votes)

    @property
    def saved(self) -> int:
        """Calls not made compared with always asking ``budget`` (= ``m``) votes."""
        return max(0, self.budget - len(self.votes))

    @property
    def errors(self) -> int:
        return sum(1 for v in self.votes if v.error is not None)

    @property
    def invalid(self) -> int:
        """Calls that answered but whose answer held no valid score."""
        return sum(1 for v in self.votes if v.error is None and v.score is None)

    @property
    def all_failed(self) -> bool:
        """No valid vote at all (every call errored or was unparseable)."""
        return all(v.score is None for v in self.votes)

    def deciding(self) -> tuple[int, ...]:
        """Indices of the votes that carry the outcome: those equal to a unique
        majority, or every valid vote when the outcome is a tie / no majority."""
        valid = [i for i, v in enumerate(self.votes) if v.score is not None]
        if not valid:
            return ()
        counter = Counter(self.votes[i].score for i in valid)
        top_value, top_count = counter.most_common(1)[0]
        if sum(1 for count in counter.values() if count == top_count) == 1:
            return tuple(i for i in valid if self.votes[i].score == top_value)
        return tuple(valid)


def _counts(votes: Sequence[int | None]) -> tuple[int, int, int]:
    c = Counter(v for v in votes if v is not None)
    return c[1], c[0], c[-1]


def decided_outcome(counts: tuple[int, int, int], remaining: int) -> float | None:
    """The outcome if it no longer depends on the ``remaining`` votes, else ``None``.

    ``counts`` are the numbers of valid ``(1, 0, -1)`` votes so far (see the module
    docstring for why the two conditions are exact).
    """
    c = {1: counts[0], 0: counts[1], -1: counts[2]}
    for v in (1, -1):
        if all(c[v] > c[w] + remaining for w in c if w != v):
            return float(v)
    if all(c[v] + remaining <= max(c[w] for w in c if w != v) for v in (1, -1)):
        return 0.0
    return None


@lru_cache(maxsize=4096)
def votes_to_request(counts: tuple[int, int, int], remaining: int) -> int:
    """The fewest further votes after which the outcome *could* be decided.

    ``0`` when it is decided already. Every vote-at-a-time strategy must make at
    least this many more calls, so requesting them in one parallel batch costs no
    extra call.
    """
    if decided_outcome(counts, remaining) is not None:
        return 0
    c1, c0, cm = counts
    for b in range(1, remaining + 1):
        for a1 in range(b + 1):
            for a0 in range(b - a1 + 1):
                for am in range(b - a1 - a0 + 1):  # the rest of the b votes are None
                    if decided_outcome((c1 + a1, c0 + a0, cm + am), remaining - b) is not None:
                        return b
    return remaining  # unreachable: with nothing remaining the outcome is decided


async def gather_or_cancel(coros: Sequence[Awaitable[Any]]) -> list[Any]:
    """Run ``coros`` concurrently; on the first exception cancel the rest, wait for them,
    and re-raise that exception itself (not wrapped in an ``ExceptionGroup``)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _is_split(votes: Sequence[int | None]) -> bool:
    counter = Counter(v for v in votes if v is not None)
    if not counter:
        return False
    top = counter.most_common(1)[0][1]
    return sum(1 for count in counter.values() if count == top) > 1


async def run_votes(
    request: Callable[[int], Awaitable[Vote | int | None]],
    m: int,
    *,
    adaptive: bool = True,
    max_votes: int | None = None,
) -> VoteResult:
    """Collect judge votes and return their majority.

    ``request(i)`` makes vote number ``i`` (0-based, in request order) and returns a
    :class:`Vote` (or a bare score / ``None``). It should turn transport failures
    into ``Vote(None, None, error)``; an exception it raises propagates as is (sibling
    requests of the same batch are cancelled).

    * ``adaptive=False``: ``m`` votes in parallel, ``majority_vote`` of them
      (OpenClaw-RL).
    * ``adaptive=True``: votes in batches of :func:`votes_to_request`, stopping as
      soon as :func:`decided_outcome` holds. Same result as the fixed mode for every
      vote sequence; fewer calls when the judge agrees with itself.
    * ``max_votes > m`` (escalation, optional, off by default): if after all ``m``
      votes the valid votes are *split* (several values share the top count — e.g.
      ``1, 0, -1`` — which would give ``0.0`` for lack of a majority), ask one more
      vote at a time until the split is broken or ``max_votes`` votes were made; the
      result is the majority of all votes. This deliberately differs from the fixed
      ``m``-vote rule (it resolves ties instead of zeroing them).
    """
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m must be an integer >= 1, got {m!r}")
    limit = m if max_votes is None else max_votes
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < m:
        raise ValueError(f"max_votes must be an integer >= m ({m}), got {max_votes!r}")

    votes: list[Vote] = []

    async def batch(k: int) -> None:
        start = len(votes)
        for value in await gather_or_cancel([request(start + j) for j in range(k)]):
            votes.append(value if isinstance(value, Vote) else Vote(value))

    if not adaptive:
        await batch(m)
    else:
        while True:
            need = votes_to_request(_counts([v.score for v in votes]), m - len(votes))
            if need == 0:
                break
            await batch(need)
    escalated = False
    while len(votes) < limit and _is_split([v.score for v in votes]):
        escalated = True
        await batch(1)
    score = majority_vote([v.score for v in votes])
    return VoteResult(score=score, votes=tuple(votes), budget=m, escalated=escalated)
