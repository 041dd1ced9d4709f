"""``OpenClawJudgeScorer``: OpenClaw-RL's PRM judge as a prm-pipeline scorer.

For every turn the scorer finds the **next state** in the branch conversation
``ctx["messages"]`` — by default OpenClaw-RL's rule, the last message before the next
assistant turn (``next_state: first`` takes the first ``user``/``tool`` message instead;
see :func:`scoring_workers.scorers.conversation.locate_next_state`) — and asks an LLM judge
whether the output fulfilled the user's intent, with the next state as evidence
(OpenClaw-RL's role-aware prompt: a successful tool output is positive, a user change
request is negative). ``m`` votes (default 3) are combined by OpenClaw-RL's majority
rule into ``1.0``, ``0.0`` or ``-1.0``; with ``adaptive: true`` (the default) votes
are requested only while they can still change the majority (two agreeing votes of
three settle it) — the score is identical to asking all ``m`` (see
:mod:`scoring_workers.judge.voting`).

* A turn with no next state (the branch's last turn, or an assistant message follows)
  scores ``0.0`` and is observed as ``has_next_state = false``; no judge call is made.
* When **every** vote of a turn fails (transport error, timeout, open breaker or an
  answer without a valid ``\\boxed{}``), ``on_all_votes_failed: reject`` (default)
  raises :class:`~scoring_workers.judge.errors.JudgeFailedError` (``reason =
  "judge_failed"``), which rejects the trajectory; ``neutral`` reproduces
  OpenClaw-RL's ``0.0``. Either way ``judge_failed`` is observed, so a failed judge
  never looks like a real zero.

What the judge sees as the turn: with ``policy_tokenizer`` (the policy's
``tokenizer.json``) the turn's output tokens decoded with special tokens — OpenClaw-RL's
chat-template view, thinking and tool-call markup included; without it, the output
messages' text plus ``<tool_call>`` JSON (:func:`~scoring_workers.scorers.conversation.
render_response_text`).

Config (``kwargs`` of the scorer entry)::

    path: scoring_workers.scorers.openclaw.OpenClawJudgeScorer
    weight: 1.0
    kwargs:
      base_url: http://judge:30000      # server root
      # base_urls: [http://judge-0:30000, http://judge-1:30000]   # or a pool of replicas
      # spill_in_flight: 16             # pool: spill a session's call when its replica has this many
      # spill_ratio: 1.5                #   more unfinished calls than the least-loaded, and 1.5x as many
      api: openai                       # or sglang (/generate on a ChatML prompt)
      model: qwen3-8b
      temperature: 0.6
      max_tokens: 4096
      top_p: 1.0                        # openai api: OpenClaw-RL's sampling; null = not sent
      top_k: -1                         # openai api; null for servers that refuse top_k
      include_reasoning: true           # openai api: parse reasoning_content + content
      next_state: last                  # OpenClaw-RL; or first (ours)
      merge_tool_results: false         # next_state first only: join consecutive tool results
      policy_tokenizer: null            # path of the policy's tokenizer.json: template view
      m: 3
      adaptive: true
      max_votes: 3                      # > m escalates split votes (off by default)
      on_all_votes_failed: reject       # or neutral
      timeout_s: 30                     # one HTTP attempt
      total_timeout_s: 45               # one vote, retries included
      turn_timeout_s: null              # all votes of one turn (unfinished votes fail)
      max_retries: 2
      max_concurrency: 32               # shared by every client of base_url in the process
      rps: 0                            # 0 = no pacing
      breaker_failure_threshold: 5
      breaker_reset_s: 10
      api_key_env: null                 # env var holding a bearer token
      api_key_file: null                # or a file holding it (a mounted Secret)
      audit_sink: null                  # "module:callable" receiving audit records

Judge texts for audit travel on the result: :class:`JudgeScorerResult` is a
:class:`~scoring_workers.prm.PRMScorerResult` with an extra ``audit`` mapping
(strings only); ``audit_sink`` additionally hands every record to a callable.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, overload

import msgspec
from msgspec import Meta

from infra.config import ConfigError
from infra.modes import JUDGE_SCORER
from infra.types import Seconds, did_you_mean
from scoring_workers.judge.apis import JudgeEndpoint
from scoring_workers.judge.client import JudgeClient, normalize_base_urls
from scoring_workers.judge.errors import JudgeFailedError, JudgeRequestError
from scoring_workers.judge.prompts import build_prm_judge_messages, parse_boxed_score
from scoring_workers.judge.settings import ClientSettings, ModelSettings, Settings, from_values
from scoring_workers.judge.voting import Vote, VoteResult, run_votes
from scoring_workers.prm import BaseScorer, PRMMetricObservation, PRMScorerResult
from scoring_workers.prm.base import RawReward
from scoring_workers.prm.capabilities import RecordSettings
from scoring_workers.prm.resolve import ScorerArgumentError, resolve_callable
from scoring_workers.scorers.conversation import (
    NextState,
    NextStateRule,
    locate_next_state,
    message_text,
    render_response_text,
)
from scoring_workers.scorers.policy_tokenizer import load_policy_decoder
from scoring_workers.scorers.record_settings import (
    JUDGE_OPERATOR_ONLY,
    FailurePolicy,
    JudgeRecordSettings,
    OpenClawRecordSettings,
)

__all__ = ["JudgeScorerBase", "JudgeScorerResult", "OpenClawJudgeScorer"]

log = logging.getLogger(__name__)

_BOOL = ("count", "rate")
_FLOAT_SUM = ("sum", "mean")


class JudgingSettings(Settings, frozen=True):
    """The judge scorers' own settings (the judge component's are its client's and
    model's): which message is the next state, how many votes, what an all-failed turn
    gives, and the budget of one turn's votes."""

    next_state: NextStateRule = "last"
    merge_tool_results: bool = False
    m: Annotated[int, Meta(ge=1)] = 3
    on_all_votes_failed: FailurePolicy = "reject"
    turn_timeout_s: Seconds | None = None

    def _check(self) -> None:
        if self.merge_tool_results and self.next_state != "first":
            raise ConfigError(
                "merge_tool_results applies to next_state 'first' only (the 'last' rule takes the final message "
                "before the next assistant turn)"
            )


def _pick(settings: type[Settings], given: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments in ``given`` that are fields of ``settings``."""
    return {name: given[name] for name in settings.__struct_fields__ if name in given}


# Settings a judge scorer's YAML does not take: a key (``api_key_env`` / ``api_key_file`` say
# where it lives instead, so no key sits in a config file or a registry record) and two
# transport choices made in code (:class:`~scoring_workers.judge.client.JudgeClient`).
_CODE_ONLY = frozenset({"api_key", "trust_env", "retry_on_timeout"})
_SETTINGS: tuple[type[Settings], ...] = (JudgingSettings, ModelSettings, *ClientSettings.parts())
FLAT_SETTINGS: dict[str, type[Settings]] = {
    name: struct for struct in _SETTINGS for name in struct.__struct_fields__ if name not in _CODE_ONLY
}
"""Each flat keyword argument of a judge scorer (a YAML entry's ``kwargs``) and the settings
struct it belongs to; its default is that struct's."""


def _flat_signature(init: Any) -> inspect.Signature:
    """``init``'s signature with ``**settings`` spelled out as the :data:`FLAT_SETTINGS`, each
    with its struct's default: what ``help()``, the config check of a scorer entry's
    ``kwargs`` (:func:`~scoring_workers.prm.resolve.check_scorer_kwargs`) and the
    record-settable check read."""
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    flat = []
    for name, struct in FLAT_SETTINGS.items():
        info = next(f for f in msgspec.structs.fields(struct) if f.name == name)
        default = info.default_factory() if info.default is msgspec.NODEFAULT else info.default
        flat.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=info.type))
    return inspect.signature(init).replace(parameters=[*own, *flat])


@dataclass(frozen=True, slots=True)
class JudgeScorerResult(PRMScorerResult):
    """A :class:`PRMScorerResult` that also carries the judge's texts for audit.

    ``audit`` maps short keys to strings: ``score``, ``votes`` (e.g. ``"1,1"`` or
    ``"1,error,-1"``), ``next_state_role`` and ``vote_<i>`` — the full judge answer
    of every *deciding* vote (those equal to the majority; every valid vote on a
    tie). The runner ignores the field today; see ``docs/judge.md`` for wiring it.
    """

    audit: Mapping[str, str] = field(default_factory=dict)


def _obs(interaction_id: str, metric: str, value: bool | float) -> PRMMetricObservation:
    if isinstance(value, bool):
        return PRMMetricObservation(
            metric_id=metric,
            scope="turn",
            target_id=interaction_id,
            value=value,
            value_type="boolean",
            aggregations=_BOOL,
        )
    return PRMMetricObservation(
        metric_id=metric,
        scope="turn",
        target_id=interaction_id,
        value=float(value),
        value_type="float",
        aggregations=_FLOAT_SUM,
    )


def _vote_label(vote: Vote) -> str:
    if vote.error is not None:
        return "error"
    return "invalid" if vote.score is None else str(vote.score)


@overload
def _judge_urls(
    scorer: str, key: str, url: str | None, urls: Sequence[str] | None, *, required: Literal[True]
) -> str | tuple[str, ...]: ...


@overload
def _judge_urls(
    scorer: str, key: str, url: str | None, urls: Sequence[str] | None, *, required: bool
) -> str | tuple[str, ...] | None: ...


def _judge_urls(
    scorer: str, key: str, url: str | None, urls: Sequence[str] | None, *, required: bool
) -> str | tuple[str, ...] | None:
    """``<key>`` (one server) or ``<key>s`` (a pool): exactly one of them (or neither
    when not ``required``), checked as the client will use them."""
    if url is not None and urls is not None:
        raise ConfigError(f"scorer {scorer!r}: set {key} (one server) or {key}s (a pool), not both")
    if urls is not None:
        if isinstance(urls, str) or not isinstance(urls, Sequence) or not urls:
            raise ConfigError(f"scorer {scorer!r}: {key}s must be a non-empty list of URLs, got {urls!r}")
        try:
            return normalize_base_urls(urls)
        except ValueError as exc:
            raise ConfigError(f"scorer {scorer!r}: {key}s: {exc}") from None
    if url is None:
        if required:
            raise TypeError(f"scorer {scorer!r}: needs {key} (one judge server) or {key}s (a pool of replicas)")
        return None
    if not isinstance(url, str):
        raise ConfigError(f"scorer {scorer!r}: {key} must be one URL (a pool goes in {key}s), got {url!r}")
    return url


def _session_key(ctx: Mapping[str, Any]) -> str | None:
    """The affinity key of a trajectory's judge calls: its session id (None: balanced)."""
    session = ctx.get("session_id")
    return session if isinstance(session, str) and session else None


class JudgeScorerBase(BaseScorer):
    """Shared plumbing of the judge scorers: configuration, the owned
    :class:`JudgeClient` / :class:`JudgeEndpoint`, next-state lookup, the judged
    response text, failure policy, audit, ``aclose``.

    The keyword arguments stay flat (a YAML entry's ``kwargs``); the constructor hands
    each to the settings struct that owns it (:data:`FLAT_SETTINGS`), which holds its
    default and its bounds: :attr:`client_settings`
    (:class:`~scoring_workers.judge.settings.ClientSettings`: timeouts and retries, the
    endpoint's limits, headers and credentials, a pool's spill policy), the endpoint's
    :class:`~scoring_workers.judge.settings.ModelSettings` (api, model, sampling) and its
    own :attr:`judging` (:class:`JudgingSettings`: next state, votes, failure policy).
    The constructor's signature lists them all, with those defaults.

    ``next_state`` (default ``"last"``, OpenClaw-RL's rule) or ``"first"``: the first
    ``user``/``tool`` message after the output (system/developer skipped). With
    ``"first"``, ``merge_tool_results: true`` joins a run of consecutive ``tool``
    messages into one next state (parallel tool calls).

    ``base_url`` names one judge server; ``base_urls`` (instead) a pool of replicas of
    the same judge: each call goes to the session's preferred replica (rendezvous
    hashing on ``ctx["session_id"]``), spills to the least-loaded one when that is
    overloaded (``spill_in_flight``, ``spill_ratio``), skips replicas whose breaker is
    open and retries a failed call on another replica (docs/judge.md, "Judge pool")."""

    record_settings: ClassVar[type[RecordSettings] | None] = JudgeRecordSettings
    operator_only: ClassVar[Mapping[str, str]] = JUDGE_OPERATOR_ONLY
    streamable: ClassVar[bool] = True  # a turn, its next state, the session id (affinity): nothing else

    def __init__(
        self,
        weight: float = 1.0,
        enabled: bool = True,
        *,
        base_url: str | None = None,
        base_urls: Sequence[str] | None = None,
        policy_tokenizer: str | None = None,
        chat_template: Any = None,
        audit_sink: Any = None,
        **settings: Any,
    ) -> None:
        super().__init__(weight=weight, enabled=enabled)
        where = f"scorer {self.name!r}"
        unknown = sorted(set(settings) - set(FLAT_SETTINGS))
        if unknown:
            match = did_you_mean(unknown[0], FLAT_SETTINGS)
            raise ScorerArgumentError(
                f"{where}: unexpected keyword argument `{unknown[0]}`" + (f"; did you mean `{match}`?" if match else "")
            )
        urls = _judge_urls(self.name, "base_url", base_url, base_urls, required=True)
        self.judging = from_values(JudgingSettings, _pick(JudgingSettings, settings), where)
        if policy_tokenizer is not None and not isinstance(policy_tokenizer, str):
            raise TypeError(f"{where}: policy_tokenizer must be a path or null, got {policy_tokenizer!r}")
        self._decode = None if policy_tokenizer is None else load_policy_decoder(policy_tokenizer)
        self._audit_sink = None if audit_sink is None else resolve_callable(audit_sink, "audit_sink")
        self.counters: Counter[str] = Counter()
        """Process-lifetime counters (turns, judge_calls, judge_calls_saved, judge_failed,
        no_next_state, rejected) — handy for a Prometheus exporter."""
        self.client_settings = ClientSettings.from_flat(
            {k: v for k, v in settings.items() if k in ClientSettings.flat_fields()}, where
        )
        """How this scorer's judge clients are configured (the judge's and the teacher's)."""
        model_settings = from_values(ModelSettings, _pick(ModelSettings, settings), where)
        template = None if chat_template is None else resolve_callable(chat_template, "chat_template")
        self._clients: list[JudgeClient] = []
        client = self._new_client(urls)  # last but one: nothing after it can fail
        self.endpoint = JudgeEndpoint(client, model_settings, chat_template=template)

    __init__.__signature__ = _flat_signature(__init__)  # type: ignore[attr-defined]

    @property
    def deterministic(self) -> bool:  # type: ignore[override]
        """Only a greedy judge (``temperature: 0``) may be re-run by ``prm-pipeline
        audit``; for a sampling judge the audit checks the recorded results instead."""
        return self.endpoint.temperature == 0

    # ------------------------------------------------------------------ clients
    def _new_client(self, base_url: str | Sequence[str]) -> JudgeClient:
        urls = normalize_base_urls(base_url)
        for client in self._clients:
            if client.base_urls == urls:
                return client
        client = JudgeClient(base_url, self.client_settings)
        self._clients.append(client)
        return client

    def _release_unopened(self) -> None:
        """Undo client registrations when the constructor fails (nothing was opened yet)."""
        for client in self._clients:
            client.discard()
        self._clients.clear()

    @property
    def client(self) -> JudgeClient:
        return self.endpoint.client

    async def aclose(self) -> None:
        """Close the HTTP clients this scorer owns (idempotent)."""
        errors: list[BaseException] = []
        for client in reversed(self._clients):
            try:
                await client.aclose()
            except Exception as exc:  # noqa: BLE001 - close the others first
                errors.append(exc)
        if errors:
            raise errors[0]

    def next_state(self, interaction: Any, ctx: Mapping[str, Any]) -> tuple[bool, NextState | None]:
        """``(output_located, next_state)`` of ``interaction`` in the branch conversation."""
        conversation = self._conversation(ctx)
        located, state = locate_next_state(
            interaction.messages, interaction.output_message_list, conversation, self.judging.next_state
        )
        if state is not None and self.judging.merge_tool_results and state.role == "tool":
            texts = [state.text]
            j = state.position + 1
            while j < len(conversation) and conversation[j].get("role") == "tool":
                texts.append(message_text(conversation[j]))
                j += 1
            state = NextState(state.role, "\n\n".join(texts), state.position)
        return located, state

    def stream_key(self, interaction: Any, ctx: dict[str, Any]) -> object:
        """The turn's next state as :meth:`next_state` finds it: all a judge reads of the conversation."""
        return self.next_state(interaction, ctx)

    def response_text(self, interaction: Any) -> str:
        """The turn as the judge sees it: the decoded output tokens with ``policy_tokenizer``
        (OpenClaw-RL's template view), else the output messages' text and tool calls. A
        turn without recorded output tokens falls back to the messages' view."""
        response = interaction.model_response
        if self._decode is not None and response is not None and response.output_len:
            return self._decode(response.output_tokens.tolist())
        return render_response_text(interaction.output_message_list)

    # ------------------------------------------------------------------ helpers
    def _deadline(self) -> float | None:
        budget = self.judging.turn_timeout_s
        if budget is None:
            return None
        return asyncio.get_running_loop().time() + budget

    @staticmethod
    def _conversation(ctx: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        conversation = ctx.get("messages")
        if conversation is None:
            raise ValueError(
                "ctx['messages'] is missing: judge scorers need the branch's full conversation (PRMRunner provides it)"
            )
        return conversation

    async def _ask(
        self, messages: Sequence[Mapping[str, Any]], deadline: float | None, affinity: str | None = None
    ) -> tuple[str | None, str | None]:
        """One judge call: ``(text, None)`` or ``(None, error description)``. ``affinity``
        (the session id) keeps a session's calls on one replica of a pool."""
        try:
            return await self.endpoint.complete(messages, deadline=deadline, affinity=affinity), None
        except JudgeRequestError as exc:
            return None, f"{exc.kind}: {exc}"

    def _failed(self, interaction: Any, what: str, votes: Sequence[Vote]) -> JudgeFailedError:
        errors = sum(1 for v in votes if v.error is not None)
        invalid = len(votes) - errors
        last = next((v.error for v in reversed(votes) if v.error is not None), None)
        self.counters["rejected"] += 1
        return JudgeFailedError(
            f"scorer {self.name!r}: all {len(votes)} {what} for interaction {interaction.interaction_id!r} "
            f"failed ({errors} request errors, {invalid} answers without a valid score)"
            + (f"; last error: {last}" if last else ""),
            interaction_id=interaction.interaction_id,
            calls=len(votes),
            errors=errors,
            invalid=invalid,
            last_error=last,
        )

    async def _emit_audit(self, interaction: Any, ctx: Mapping[str, Any], audit: Mapping[str, str]) -> None:
        if self._audit_sink is None:
            return
        record = {
            "scorer": self.name,
            "version": self.version,
            "trajectory_id": ctx.get("trajectory_id"),
            "leaf_id": ctx.get("leaf_id"),
            "interaction_id": interaction.interaction_id,
            **audit,
        }
        try:
            outcome = self._audit_sink(record)
            if inspect.isawaitable(outcome):
                await outcome
        except Exception:
            log.exception("audit sink of scorer %r failed", self.name)


class OpenClawJudgeScorer(JudgeScorerBase):
    """OpenClaw-RL's PRM judge: ``m``-vote majority of ``\\boxed{1/0/-1}`` per turn.

    Extra kwargs beyond :class:`JudgeScorerBase`: ``adaptive`` (default ``True``) and
    ``max_votes`` (default ``m``; larger escalates split votes).

    Turn observations (stable schema): ``has_next_state``, ``output_located``,
    ``judge_failed`` (boolean: count, rate); ``judge_calls``, ``judge_calls_saved``,
    ``judge_call_errors``, ``judge_votes_invalid`` (float: sum, mean).
    """

    name = JUDGE_SCORER
    version = "1"
    record_settings = OpenClawRecordSettings

    def __init__(
        self,
        weight: float = 1.0,
        enabled: bool = True,
        *,
        adaptive: bool = True,
        max_votes: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(adaptive, bool):
            raise TypeError(f"scorer {self.name!r}: adaptive must be a bool, got {adaptive!r}")
        super().__init__(weight, enabled, **kwargs)
        m = self.judging.m
        if max_votes is not None and (isinstance(max_votes, bool) or not isinstance(max_votes, int) or max_votes < m):
            self._release_unopened()
            raise ConfigError(f"scorer {self.name!r}: max_votes must be an integer >= m ({m}), got {max_votes!r}")
        self.adaptive = adaptive
        self.max_votes = max_votes

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> RawReward | None:
        result = await self.evaluate_result(interaction, ctx)
        return None if result is None else result.reward

    async def evaluate_result(self, interaction: Any, ctx: dict[str, Any]) -> JudgeScorerResult:
        iid = interaction.interaction_id
        located, state = self.next_state(interaction, ctx)
        self.counters["turns"] += 1
        if state is None:
            self.counters["no_next_state"] += 1
            return JudgeScorerResult(
                0.0,
                (
                    _obs(iid, "has_next_state", False),
                    _obs(iid, "output_located", located),
                    _obs(iid, "judge_failed", False),
                    _obs(iid, "judge_calls", 0.0),
                    _obs(iid, "judge_calls_saved", 0.0),
                    _obs(iid, "judge_call_errors", 0.0),
                    _obs(iid, "judge_votes_invalid", 0.0),
                ),
                audit={"score": "0.0", "votes": "", "next_state_role": ""},
            )
        messages = build_prm_judge_messages(self.response_text(interaction), state.text, state.role)
        deadline = self._deadline()
        session = _session_key(ctx)

        async def request(_i: int) -> Vote:
            text, error = await self._ask(messages, deadline, session)
            return Vote(None if text is None else parse_boxed_score(text), text, error)

        result = await run_votes(request, self.judging.m, adaptive=self.adaptive, max_votes=self.max_votes)
        self.counters["judge_calls"] += result.calls
        self.counters["judge_calls_saved"] += result.saved
        failed = result.all_failed
        audit = self._audit(result, state)
        await self._emit_audit(interaction, ctx, audit)
        if failed:
            self.counters["judge_failed"] += 1
            if self.judging.on_all_votes_failed == "reject":
                raise self._failed(interaction, "judge votes", result.votes)
        return JudgeScorerResult(
            result.score,
            (
                _obs(iid, "has_next_state", True),
                _obs(iid, "output_located", True),
                _obs(iid, "judge_failed", failed),
                _obs(iid, "judge_calls", result.calls),
                _obs(iid, "judge_calls_saved", result.saved),
                _obs(iid, "judge_call_errors", result.errors),
                _obs(iid, "judge_votes_invalid", result.invalid),
            ),
            audit=audit,
        )

    @staticmethod
    def _audit(result: VoteResult, state: NextState) -> dict[str, str]:
        audit = {
            "score": repr(result.score),
            "votes": ",".join(_vote_label(v) for v in result.votes),
            "next_state_role": state.role,
        }
        for i in result.deciding():
            audit[f"vote_{i}"] = result.votes[i].text or ""
        errors = [f"{i}: {v.error}" for i, v in enumerate(result.votes) if v.error is not None]
        if errors:
            audit["errors"] = "\n".join(errors)
        return audit
