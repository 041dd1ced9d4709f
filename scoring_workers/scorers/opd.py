"""``OPDTeacherScorer``: OpenClaw-RL's hindsight-hint on-policy distillation signal.

Per turn (OpenClaw-RL's OPD mode):

1. **Hint judge.** Find the next state (as :class:`~scoring_workers.scorers.openclaw.
   OpenClawJudgeScorer` does) and ask the judge ``m`` times (in parallel) with the
   hint prompt; parse each answer into ``(score, hint)``; keep the longest hint of a
   ``\\boxed{1}`` vote that is longer than 10 characters
   (:func:`~scoring_workers.judge.prompts.select_best_hint`).
2. **Teacher.** Append the hint to the turn's last user message
   (``"\\n\\n[user's hint / instruction]\\n<hint>"``), normalize the messages as
   OpenClaw-RL does for its template (``developer`` -> ``system``, list contents
   flattened: :func:`~scoring_workers.scorers.conversation.normalize_template_messages`),
   tokenize that prompt, append the
   rollout's *own* output tokens (``model_response.output_tokens`` — never
   re-tokenized text, so positions line up with ``output_logprobs``) and
   teacher-force it through SGLang ``/generate`` with ``max_new_tokens=0``,
   ``return_logprob=true``, ``logprob_start_len = len(prompt) - 1``; the last
   ``output_len`` entries of ``meta_info.input_token_logprobs`` are the teacher's
   log-probs of the output tokens. This deliberately differs from OpenClaw-RL, which
   starts at ``L - R`` and drops the first entry, so its teacher log-prob of the first
   output token is always ``0.0`` (an off-by-one); ours is the real one, the others
   are identical (docs/compatibility.md).
3. **Reward.** ``teacher_lp - rollout_lp`` per output token: a dense float32 tensor of
   shape ``[output_len]`` (OpenClaw-RL's per-token OPD advantage).

No next state or no accepted hint -> zeros, observed as ``has_next_state`` /
``hint_accepted`` false. OpenClaw-RL does not train such turns at all: set the
trainer's ``drop_unhinted_turns`` to leave them out of the loss (shaper/exclusion.py).
``model_response.output_logprobs`` is required (checked
before any call: :class:`MissingLogprobsError`). When every hint vote fails, or the
teacher/tokenizer call fails after an accepted hint, ``on_all_votes_failed: reject``
(default) raises :class:`~scoring_workers.judge.errors.JudgeFailedError` (reason
``judge_failed``); ``neutral`` gives zeros with ``judge_failed`` observed.

Tokenizing the hinted prompt (``tokenizer`` kwarg)
-------------------------------------------------
The teacher must see exactly the token ids the policy's chat template would produce
for the hinted conversation. Sending text and letting SGLang tokenize is *not* an
option: ``/generate`` takes either ``text`` or ``input_ids``, and re-tokenizing the
response text would break the alignment with ``output_logprobs``. So the prompt
is tokenized separately and pluggably:

``"remote"`` (default)
    ``POST {teacher_base_url}{tokenize_path}`` with ``{"model", "messages",
    "add_generation_prompt": true}`` and read ``{"tokens": [...]}`` — vLLM's
    ``/tokenize`` schema; the fake judge implements it. For SGLang deploy a tiny
    sidecar or use one of the options below.
``"module:callable"``
    a callable ``(messages) -> Sequence[int]`` (sync or async) — e.g. a wrapper over
    the policy's Hugging Face tokenizer ``apply_chat_template(messages,
    add_generation_prompt=True, tokenize=True)`` (tools included if your agent uses
    them; interactions do not record tool schemas).
``"hf:<name or path>"``
    exactly that wrapper, built lazily (needs ``transformers`` installed).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from infra.errors import ScoringError
from infra.modes import OPD_SCORER
from scoring_workers.judge.apis import sglang_input_logprobs
from scoring_workers.judge.client import JudgeClient
from scoring_workers.judge.errors import JudgeFailedError, JudgeRequestError
from scoring_workers.judge.prompts import (
    append_hint_to_messages,
    build_hint_judge_messages,
    parse_hint_judgement,
    select_best_hint,
)
from scoring_workers.judge.voting import Vote, gather_or_cancel
from scoring_workers.prm.base import RawReward
from scoring_workers.prm.resolve import resolve_callable
from scoring_workers.scorers.conversation import normalize_template_messages
from scoring_workers.scorers.openclaw import JudgeScorerBase, JudgeScorerResult, _judge_urls, _obs, _session_key
from scoring_workers.scorers.record_settings import OPD_OPERATOR_ONLY, OPDRecordSettings

__all__ = ["MissingLogprobsError", "OPDTeacherScorer", "hf_chat_tokenizer"]


class MissingLogprobsError(ScoringError, ValueError):
    """The turn has no ``model_response.output_logprobs``: OPD needs the rollout's log-probs."""


def hf_chat_tokenizer(
    name_or_path: str, *, trust_remote_code: bool = False
) -> Callable[[Sequence[Mapping[str, Any]]], list[int]]:
    """``messages -> prompt token ids`` with a Hugging Face tokenizer's chat template
    (``add_generation_prompt=True``). Loaded on first use; needs ``transformers``.

    ``trust_remote_code`` stays off unless the operator's own config turns it on by name
    (``trust_remote_code: true`` next to ``tokenizer``; a registry record cannot): a
    tokenizer whose files name Python code (``auto_map``) is refused instead of run."""
    state: dict[str, Any] = {}

    def tokenize(messages: Sequence[Mapping[str, Any]]) -> list[int]:
        tok = state.get("tok")
        if tok is None:
            try:
                from transformers import AutoTokenizer
            except ImportError as exc:
                raise RuntimeError("tokenizer 'hf:...' needs the transformers package") from exc
            tok = state["tok"] = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        ids = tok.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    return tokenize


class OPDTeacherScorer(JudgeScorerBase):
    """Dense OPD token rewards ``teacher_lp - rollout_lp`` from a hindsight-hinted teacher.

    Extra kwargs beyond :class:`~scoring_workers.scorers.openclaw.JudgeScorerBase`:
    ``teacher_base_url`` (default ``base_url``: the same SGLang server, as in
    OpenClaw-RL) or ``teacher_base_urls`` (a pool of teacher replicas, routed like the
    judge's: a session's teacher calls go to one replica), ``tokenizer (``"remote"``, ``"module:callable"`` or
    ``"hf:<path>"``; see the module docstring), ``tokenize_path`` (default
    ``/tokenize``).

    Turn observations: ``has_next_state``, ``hint_accepted``, ``judge_failed``
    (boolean: count, rate); ``judge_calls``, ``teacher_calls`` (float: sum, mean);
    ``opd_signal_mean`` (float: sum, mean; only on turns with an accepted hint).
    """

    name = OPD_SCORER
    version = "1"
    record_settings = OPDRecordSettings
    operator_only = OPD_OPERATOR_ONLY

    def __init__(
        self,
        weight: float = 1.0,
        enabled: bool = True,
        *,
        teacher_base_url: str | None = None,
        teacher_base_urls: Sequence[str] | None = None,
        tokenizer: Any = "remote",
        tokenize_path: str = "/tokenize",
        trust_remote_code: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(trust_remote_code, bool):
            raise TypeError(f"scorer {self.name!r}: trust_remote_code must be a bool, got {trust_remote_code!r}")
        if not isinstance(tokenize_path, str) or not tokenize_path.startswith("/"):
            raise ValueError(f"scorer {self.name!r}: tokenize_path must start with '/', got {tokenize_path!r}")
        if isinstance(tokenizer, str) and tokenizer.startswith("hf:"):
            tokenize_fn: Callable[..., Any] | None = hf_chat_tokenizer(
                tokenizer[3:], trust_remote_code=trust_remote_code
            )
        elif tokenizer == "remote":
            tokenize_fn = None
        else:
            tokenize_fn = resolve_callable(tokenizer, "tokenizer")
        teacher_urls = _judge_urls(self.name, "teacher_base_url", teacher_base_url, teacher_base_urls, required=False)
        super().__init__(weight, enabled, **kwargs)
        try:
            self.teacher: JudgeClient = self.client if teacher_urls is None else self._new_client(teacher_urls)
        except BaseException:
            self._release_unopened()
            raise
        self._tokenize_fn = tokenize_fn
        self.tokenize_path = tokenize_path

    async def _prompt_ids(
        self, messages: list[dict[str, Any]], deadline: float | None, affinity: str | None = None
    ) -> list[int]:
        if self._tokenize_fn is not None:
            ids = self._tokenize_fn(messages)
            if inspect.isawaitable(ids):
                ids = await ids
        else:
            data = await self.teacher.post_json(
                self.tokenize_path,
                {"model": self.endpoint.model, "messages": messages, "add_generation_prompt": True},
                deadline=deadline,
                affinity=affinity,
            )
            ids = data.get("tokens") if isinstance(data, Mapping) else None
            if ids is None:
                raise JudgeRequestError(
                    f"{self.teacher.name}{self.tokenize_path}: answer has no 'tokens'", kind="bad_response"
                )
        ids = [int(t) for t in ids]
        if not ids:
            raise JudgeRequestError("the tokenizer returned no prompt tokens", kind="bad_response")
        return ids

    async def _teacher_logprobs(
        self,
        messages: list[dict[str, Any]],
        output_tokens: np.ndarray,
        deadline: float | None,
        affinity: str | None = None,
    ) -> np.ndarray:
        prompt = await self._prompt_ids(messages, deadline, affinity)
        n = int(output_tokens.shape[0])
        rows = await sglang_input_logprobs(
            self.teacher,
            [*prompt, *output_tokens.tolist()],
            logprob_start_len=max(0, len(prompt) - 1),
            deadline=deadline,
            affinity=affinity,
        )
        if len(rows) < n:
            raise JudgeRequestError(
                f"teacher returned {len(rows)} input log-probs, fewer than the {n} output tokens",
                kind="bad_response",
            )
        tail = rows[len(rows) - n :]
        if any(v is None or not math.isfinite(v) for v in tail):
            raise JudgeRequestError("teacher returned a missing or non-finite output log-prob", kind="bad_response")
        return np.asarray(tail, dtype=np.float32)

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> RawReward | None:
        result = await self.evaluate_result(interaction, ctx)
        return None if result is None else result.reward

    async def evaluate_result(self, interaction: Any, ctx: dict[str, Any]) -> JudgeScorerResult:
        """Steps 1-3 of the module docstring for one turn: the teacher's signal once a hint
        is accepted; zeros without a next state, without an accepted hint, or when every
        vote failed under ``neutral``."""
        iid = interaction.interaction_id
        response = interaction.model_response
        rollout_lp = None if response is None else response.output_logprobs
        if rollout_lp is None:
            raise MissingLogprobsError(
                f"scorer {self.name!r}: interaction {iid!r} has no model_response.output_logprobs; OPD needs "
                "the rollout's per-token log-probs (export them with the trajectory)"
            )
        n = response.output_len
        _located, state = self.next_state(interaction, ctx)
        self.counters["turns"] += 1
        if state is None:
            self.counters["no_next_state"] += 1
            return _result(
                iid,
                n,
                _zeros(n),
                has_next=False,
                accepted=False,
                failed=False,
                judge_calls=0,
                teacher_calls=0,
                audit={"hint": "", "votes": ""},
            )
        messages = build_hint_judge_messages(self.response_text(interaction), state.text, state.role)
        deadline = self._deadline()
        session = _session_key(ctx)
        judged = await self._hint_votes(messages, deadline, session)
        votes = [v for v, _ in judged]
        labels = ",".join("error" if v.error else ("invalid" if v.score is None else str(v.score)) for v in votes)
        if all(v.score is None for v in votes):
            self.counters["judge_failed"] += 1
            audit = {"hint": "", "votes": labels}
            await self._emit_audit(interaction, ctx, audit)
            if self.judging.on_all_votes_failed == "reject":
                raise self._failed(interaction, "hint-judge votes", votes)
            return _result(
                iid,
                n,
                _zeros(n),
                has_next=True,
                accepted=False,
                failed=True,
                judge_calls=len(votes),
                teacher_calls=0,
                audit=audit,
            )
        hint = select_best_hint([(v.score, h) for v, h in judged])
        if hint is None:
            audit = {"hint": "", "votes": labels}
            await self._emit_audit(interaction, ctx, audit)
            return _result(
                iid,
                n,
                _zeros(n),
                has_next=True,
                accepted=False,
                failed=False,
                judge_calls=len(votes),
                teacher_calls=0,
                audit=audit,
            )
        audit = {"hint": hint, "votes": labels}
        chosen = next(i for i, (v, h) in enumerate(judged) if v.score == 1 and h.strip() == hint)
        audit[f"vote_{chosen}"] = votes[chosen].text or ""
        return await self._taught(interaction, ctx, hint, audit, len(votes), deadline, session)

    async def _hint_votes(
        self, messages: list[dict[str, Any]], deadline: float | None, session: str | None
    ) -> list[tuple[Vote, str]]:
        """Step 1: ask the hint judge ``judging.m`` times in parallel; each answer as its
        vote and its hint (``""`` when the call failed)."""
        judged = await gather_or_cancel([self._hint_vote(messages, deadline, session) for _ in range(self.judging.m)])
        self.counters["judge_calls"] += len(judged)
        return judged

    async def _hint_vote(
        self, messages: list[dict[str, Any]], deadline: float | None, session: str | None
    ) -> tuple[Vote, str]:
        """One hint-judge call: its vote and its hint; a failed call is an error vote."""
        text, error = await self._ask(messages, deadline, session)
        if text is None:
            return Vote(None, None, error), ""
        score, hint = parse_hint_judgement(text)
        return Vote(score, text, None), hint

    async def _taught(
        self,
        interaction: Any,
        ctx: dict[str, Any],
        hint: str,
        audit: dict[str, str],
        judge_calls: int,
        deadline: float | None,
        session: str | None,
    ) -> JudgeScorerResult:
        """Steps 2-3 once a hint is accepted: the teacher's log-probs of the rollout's own
        output tokens under the hinted prompt, minus the rollout's. A teacher or
        tokenizer failure counts as a judge failure (``on_all_votes_failed``)."""
        iid = interaction.interaction_id
        response = interaction.model_response
        n = response.output_len
        try:
            teacher_lp = await self._teacher_logprobs(
                normalize_template_messages(append_hint_to_messages(interaction.messages, hint)),
                response.output_tokens,
                deadline,
                session,
            )
        except JudgeRequestError as exc:
            self.counters["judge_failed"] += 1
            audit["teacher_error"] = f"{exc.kind}: {exc}"
            await self._emit_audit(interaction, ctx, audit)
            if self.judging.on_all_votes_failed == "reject":
                self.counters["rejected"] += 1
                raise JudgeFailedError(
                    f"scorer {self.name!r}: teacher log-probs for interaction {iid!r} failed after an accepted "
                    f"hint: {exc.kind}: {exc}",
                    interaction_id=iid,
                    calls=judge_calls + 1,
                    errors=1,
                    last_error=str(exc),
                ) from exc
            return _result(
                iid,
                n,
                _zeros(n),
                has_next=True,
                accepted=True,
                failed=True,
                judge_calls=judge_calls,
                teacher_calls=1,
                audit=audit,
            )
        await self._emit_audit(interaction, ctx, audit)
        reward = torch.from_numpy(teacher_lp - np.asarray(response.output_logprobs, dtype=np.float32))
        return _result(
            iid,
            n,
            reward,
            has_next=True,
            accepted=True,
            failed=False,
            judge_calls=judge_calls,
            teacher_calls=1,
            audit=audit,
        )


def _zeros(n: int) -> torch.Tensor:
    """The reward of a turn without an OPD signal (OpenClaw-RL does not train it)."""
    return torch.zeros(n, dtype=torch.float32)


def _result(
    iid: str,
    n: int,
    reward: torch.Tensor,
    *,
    has_next: bool,
    accepted: bool,
    failed: bool,
    judge_calls: int,
    teacher_calls: int,
    audit: dict[str, str],
) -> JudgeScorerResult:
    """Turn ``iid``'s result with its observations (the class docstring's);
    ``opd_signal_mean`` only for a real signal: an accepted hint, a teacher that
    answered, ``n`` > 0 output tokens."""
    observations = [
        _obs(iid, "has_next_state", has_next),
        _obs(iid, "hint_accepted", accepted),
        _obs(iid, "judge_failed", failed),
        _obs(iid, "judge_calls", judge_calls),
        _obs(iid, "teacher_calls", teacher_calls),
    ]
    if accepted and not failed and n:
        observations.append(_obs(iid, "opd_signal_mean", float(reward.mean())))
    return JudgeScorerResult(reward, tuple(observations), audit=audit)
