"""A synthetic rollout proxy: token-backed multi-turn trajectories grouped for GRPO.

Used by the demo, the benchmarks and the tests. Each session is a concat-export
conversation: every turn's input is its parent's input + output + a few new prompt
tokens, which is what the trainer's batch builder checks. Arrays are built with
numpy (no per-token Python objects), so generating large workloads stays cheap.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from infra.schema import DiscardGroup, Interaction, ModelResponse, ReadyTrajectory


def make_session(
    *,
    trajectory_id: str,
    session_id: str,
    group_id: str,
    group_size: int,
    turns: int = 4,
    output_tokens: int | tuple[int, int] = 64,
    prompt_tokens: int = 16,
    outcome_reward: float = 1.0,
    branch_at: int | None = None,
    rng: np.random.Generator | None = None,
    is_eval: bool = False,
    policy_version: int | None = 0,
) -> ReadyTrajectory:
    """One session of ``turns`` turns; ``branch_at`` adds a second leaf after that turn."""
    rng = rng or np.random.default_rng(0)

    def out_len() -> int:
        if isinstance(output_tokens, tuple):
            return int(rng.integers(output_tokens[0], output_tokens[1] + 1))
        return output_tokens

    interactions: list[Interaction] = []
    context = rng.integers(1, 32_000, prompt_tokens, dtype=np.int32)
    messages: list[dict[str, str]] = [{"role": "user", "content": f"task for {session_id}"}]

    def turn(iid: str, parent: str | None, ctx: np.ndarray, msgs: list[dict[str, str]]) -> tuple[np.ndarray, list[dict[str, str]]]:
        n = out_len()
        out = rng.integers(1, 32_000, n, dtype=np.int32)
        logp = -rng.random(n, dtype=np.float32)
        answer = {"role": "assistant", "content": f"step {iid} ({n} tokens)"}
        interactions.append(
            Interaction(
                interaction_id=iid,
                parent_id=parent,
                messages=list(msgs),
                output_message_list=[answer],
                model_response=ModelResponse.from_arrays(ctx, out, logp, "stop"),
            )
        )
        follow = rng.integers(1, 32_000, 4, dtype=np.int32)
        return np.concatenate([ctx, out, follow]), [*msgs, answer, {"role": "tool", "content": "ok"}]

    parent: str | None = None
    fork: tuple[str | None, np.ndarray, list[dict[str, str]]] | None = None
    for k in range(turns):
        iid = f"{session_id}-t{k}"
        if branch_at is not None and k == branch_at + 1:
            fork = (parent, context, messages)
        context, messages = turn(iid, parent, context, messages)
        parent = iid
    if fork is not None:
        turn(f"{session_id}-t{branch_at + 1}b", *fork)
    return ReadyTrajectory(
        trajectory_id=trajectory_id,
        session_id=session_id,
        group_id=group_id,
        group_size=group_size,
        interactions=interactions,
        outcome_reward=outcome_reward,
        is_eval=is_eval,
        policy_version=policy_version,
        created_at=time.time(),
    )


def make_group(
    group_id: str, group_size: int = 4, *, rng: np.random.Generator | None = None, **session_kwargs: object
) -> list[ReadyTrajectory]:
    """``group_size`` sessions of one prompt with mixed 0/1 outcome rewards."""
    rng = rng or np.random.default_rng(abs(hash(group_id)) % (1 << 32))
    return [
        make_session(
            trajectory_id=f"{group_id}-traj{i}",
            session_id=f"{group_id}-s{i}",
            group_id=group_id,
            group_size=group_size,
            outcome_reward=float(rng.integers(0, 2)),
            rng=rng,
            **session_kwargs,  # type: ignore[arg-type]
        )
        for i in range(group_size)
    ]


def workload(
    n_groups: int,
    group_size: int = 4,
    *,
    seed: int = 0,
    discard_every: int = 0,
    prefix: str = "g",
    **session_kwargs: object,
) -> Iterator[ReadyTrajectory | DiscardGroup]:
    """Messages for ``n_groups`` groups; every ``discard_every``-th group is discarded instead."""
    rng = np.random.default_rng(seed)
    for g in range(n_groups):
        gid = f"{prefix}{g:06d}"
        if discard_every and g % discard_every == discard_every - 1:
            yield DiscardGroup(group_id=gid, reason="synthetic discard", requested_at=time.time())
            continue
        yield from make_group(gid, group_size, rng=rng, **session_kwargs)
