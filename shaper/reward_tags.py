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
the rest of the bits agree, so a value that does not decode is an error, not a guess.
"""

from __future__ import annotations

import math

import numpy as np

from infra.schema import GroupVerdict, SessionResult

TAG_BITS = 8
TAG_MASK = (1 << TAG_BITS) - 1
MAX_MEMBERS = TAG_MASK  # tags 1..255; 0 is "no member"

__all__ = ["MAX_MEMBERS", "TAG_BITS", "member_by_tag", "member_tag", "read_tag", "tag_reward", "tagged_matches"]


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
        raise ValueError(f"member tag {tag} outside 0..{MAX_MEMBERS}")
    if not math.isfinite(value) or abs(value) > 1e37:
        raise ValueError(f"a tagged reward must be finite and below 1e37 in magnitude, got {value!r}")
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
        raise ValueError(f"group {verdict.group_id!r} has {len(ranked)} sessions; member tags name at most {MAX_MEMBERS}")
    for rank, session in enumerate(ranked):
        if session.trajectory_id == trajectory_id:
            return rank + 1
    return 0


def member_by_tag(verdict: GroupVerdict, tag: int) -> SessionResult | None:
    """The session a tag names, or ``None`` when the verdict has no such member."""
    ranked = _ranked(verdict)
    return ranked[tag - 1] if 1 <= tag <= len(ranked) else None
