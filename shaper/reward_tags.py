"""A scalar reward that names its group member, so a trainer's float can find its verdict again.

Some trainers carry exactly one float per sample from the reward function to the
advantage step (verl's agent loop: ``AgentLoopOutput.reward_score`` becomes one value
of ``rm_scores``, and a registered advantage estimator sees only that tensor, the
``response_mask`` and the group ``uid``). The advantage step can fetch the group's
verdict by ``uid``, but it cannot tell which row is which member: two members can
have the same length, turns and outcome. This module makes the float itself the key.

The float travels as float32 (verl stores ``rm_scores`` as float32), and its lowest
:data:`TAG_BITS` mantissa bits hold a *member tag*: ``1 + `` the member's rank among
the verdict's sessions ordered by ``trajectory_id`` (the same in every copy of the
verdict, whoever decodes it). Tag ``0`` means "no member" (no verdict came): the value
is then the outcome rounded to clear those bits. A tagged value differs from the
float32 outcome by at most ``2**TAG_BITS - 1`` units in the last place (relative
``< 3.1e-5``); the reader restores the exact outcome from the verdict and checks that
the rest of the bits agree, so a value that does not decode is an error, not a guess
(:func:`recover_rewards`: the advantage step's end of this route, used by verl's ``prm_grpo``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from infra.schema import GroupVerdict, SessionResult
from shaper.errors import ShapingInputError, VerdictMismatch
from shaper.reward_client import session_turn_rewards, turn_spans

TAG_BITS = 8
TAG_MASK = (1 << TAG_BITS) - 1
MAX_MEMBERS = TAG_MASK  # tags 1..255; 0 is "no member"

__all__ = [
    "MAX_MEMBERS",
    "TAG_BITS",
    "member_by_tag",
    "member_tag",
    "read_tag",
    "recover_rewards",
    "tag_reward",
    "tagged_matches",
]


def _bits(value: float) -> int:
    return int(np.float32(value).view(np.uint32))


def _float(bits: int) -> float:
    return float(np.uint32(bits).view(np.float32))


def tag_reward(value: float, tag: int) -> float:
    """``value`` as float32 with ``tag`` in its lowest :data:`TAG_BITS` bits (exactly representable in float32).

    Tag 0 rounds ``value`` to the nearest float32 whose low bits are clear, so an
    untagged value never reads as a tag.
    """
    if not 0 <= tag <= MAX_MEMBERS:
        raise ShapingInputError(f"member tag {tag} outside 0..{MAX_MEMBERS}")
    if not math.isfinite(value) or abs(value) > 1e37:
        raise ShapingInputError(f"a tagged reward must be finite and below 1e37 in magnitude, got {value!r}")
    bits = _bits(value)
    if tag == 0:
        return _float((bits + (1 << (TAG_BITS - 1))) & ~TAG_MASK & 0xFFFFFFFF)
    return _float((bits & ~TAG_MASK) | tag)


def read_tag(value: float) -> int:
    """The member tag a float32 value carries (0: none)."""
    return _bits(value) & TAG_MASK


def tagged_matches(value: float, outcome: float) -> bool:
    """Whether ``value`` is ``outcome`` carrying ``read_tag(value)``, bit for bit in float32."""
    return _bits(tag_reward(outcome, read_tag(value))) == _bits(value)


def _ranked(verdict: GroupVerdict) -> list[SessionResult]:
    return sorted(verdict.sessions, key=lambda s: s.trajectory_id)


def member_tag(verdict: GroupVerdict | None, trajectory_id: str) -> int:
    """``1 +`` the rank of ``trajectory_id`` among the verdict's sessions; 0 when it is not one of them."""
    if verdict is None:
        return 0
    ranked = _ranked(verdict)
    if len(ranked) > MAX_MEMBERS:
        raise ShapingInputError(
            f"group {verdict.group_id!r} has {len(ranked)} sessions; member tags name at most {MAX_MEMBERS}"
        )
    for rank, session in enumerate(ranked):
        if session.trajectory_id == trajectory_id:
            return rank + 1
    return 0


def member_by_tag(verdict: GroupVerdict, tag: int) -> SessionResult | None:
    """The session a tag names, or ``None`` when the verdict has no such member."""
    ranked = _ranked(verdict)
    return ranked[tag - 1] if 1 <= tag <= len(ranked) else None


def recover_rewards(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray, verdicts: Any, *, wait_s: float
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(outcome rewards, process rewards, tagged rows)`` of a batch whose rewards carry member tags.

    Each row's reward sits at its last valid token (verl puts it there); a nonzero
    member tag in it names the row's member of the ``index`` group's verdict, fetched
    with ``verdicts.get(uids, wait_s)``. The outcome is restored exactly from the
    verdict, and for an accepted verdict the member's token rewards are laid on the
    response: one turn covering the valid response, or one span per run of
    ``response_mask`` ones. Untagged rows (no verdict came) keep their reward as it is.
    A tag that does not decode is an error naming the row and group.
    """
    rewards = token_level_rewards.detach().to("cpu", torch.float32)
    n, width = rewards.shape
    positions = torch.arange(width)
    last = torch.where(rewards != 0, positions, -1).amax(dim=-1).tolist()
    tags = [read_tag(float(rewards[i, p])) if p >= 0 else 0 for i, p in enumerate(last)]
    tagged = [i for i in range(n) if tags[i]]
    outcome = rewards.clone()
    process = torch.zeros_like(rewards)
    if not tagged:
        return outcome.to(token_level_rewards), process.to(token_level_rewards), 0
    uids = [str(index[i]) for i in range(n)]
    found: dict[str, GroupVerdict] = verdicts.get([uids[i] for i in tagged], wait_s)
    owner: dict[tuple[str, int], int] = {}
    mask = response_mask.detach().cpu().numpy()
    for i in tagged:
        uid, tag, pos = uids[i], tags[i], last[i]
        value = float(rewards[i, pos])
        if (uid, tag) in owner:
            raise VerdictMismatch(
                f"prm_grpo: rows {owner[uid, tag]} and {i} both carry member {tag} of group {uid!r} "
                "(an agent loop returning several outputs per sample is not supported)"
            )
        owner[uid, tag] = i
        verdict = found.get(uid)
        if verdict is None:
            raise VerdictMismatch(
                f"prm_grpo: row {i} carries member tag {tag} of group {uid!r}, but no verdict for that "
                f"group arrived within {wait_s:g}s: is the reward manager prm_pipeline, on the same "
                "pipeline config (algorithm.prm_config)?"
            )
        session = member_by_tag(verdict, tag)
        if session is None or session.outcome_reward is None or not tagged_matches(value, session.outcome_reward):
            raise VerdictMismatch(
                f"prm_grpo: row {i}'s reward {value!r} does not decode as a member of group {uid!r} "
                f"(tag {tag}, {len(verdict.sessions)} sessions in its verdict)"
            )
        outcome[i, pos] = float(np.float32(session.outcome_reward))
        if verdict.status != "accepted":
            continue
        per_turn = session_turn_rewards(session, group_id=uid)
        if not per_turn:
            continue
        valid = pos + 1
        spans = [(0, valid)] if len(per_turn) == 1 and len(per_turn[0]) == valid else turn_spans(mask[i], valid)
        if [len(v) for v in per_turn] != [e - s for s, e in spans]:
            raise VerdictMismatch(
                f"prm_grpo: row {i} (group {uid!r}) has turns {spans} but its verdict scored turns of "
                f"{[len(v) for v in per_turn]} tokens"
            )
        for (start, end), values in zip(spans, per_turn):
            process[i, start:end] = torch.from_numpy(np.asarray(values, dtype=np.float32))
    return outcome.to(token_level_rewards), process.to(token_level_rewards), len(tagged)
