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

    def turn(
        iid: str, parent: str | None, ctx: np.ndarray, msgs: list[dict[str, str]]
    ) -> tuple[np.ndarray, list[dict[str, str]]]:
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
    if fork is not None and branch_at is not None:
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


_WORDS = np.array(
    [
        f"{a}{b}"
        for a in ("ca", "de", "fo", "li", "mu", "ra", "so", "te")
        for b in ("b", "ck", "d", "ll", "m", "n", "p", "rs", "st", "t", "x", "z")
    ]
)


def _text(rng: np.random.Generator, n_tokens: int, chars_per_token: float) -> str:
    """Plain text of about ``n_tokens * chars_per_token`` characters (3-4 character words)."""
    n_words = max(1, round(n_tokens * chars_per_token / 4.5))
    return " ".join(rng.choice(_WORDS, n_words).tolist())


def make_agent_session(
    *,
    trajectory_id: str,
    session_id: str,
    group_id: str,
    group_size: int = 1,
    turns: int,
    context_tokens: int,
    output_tokens: int = 200,
    chars_per_token: float = 4.0,
    branch_at: int | None = None,
    outcome_reward: float = 1.0,
    rng: np.random.Generator | None = None,
) -> ReadyTrajectory:
    """A long tool-using agent session (concat export), the shape that made records quadratic.

    Each turn the model writes ``output_tokens`` tokens (an assistant message of matching
    text) and a tool answers with plain text, so the final context is about
    ``context_tokens`` tokens after ``turns`` turns. Every turn's ``messages`` is the whole
    conversation so far and its prompt the whole context so far (the full form).
    ``branch_at`` forks a second chain after that turn which runs to the same length.
    """
    rng = rng or np.random.default_rng(0)
    per_turn = max(output_tokens + 1, context_tokens // turns)
    new_tokens = per_turn - output_tokens
    interactions: list[Interaction] = []

    def chain(
        first: int, parent: str | None, ctx: np.ndarray, msgs: list[dict[str, str]], suffix: str
    ) -> tuple[str | None, np.ndarray, list[dict[str, str]]]:
        for k in range(first, turns):
            iid = f"{session_id}-t{k}{suffix}"
            role = "user" if k == 0 else "tool"
            delta = rng.integers(1, 150_000, new_tokens, dtype=np.int32)
            ctx = np.concatenate([ctx, delta])
            msgs = [*msgs, {"role": role, "content": _text(rng, new_tokens, chars_per_token)}]
            out = rng.integers(1, 150_000, output_tokens, dtype=np.int32)
            answer = {"role": "assistant", "content": _text(rng, output_tokens, chars_per_token)}
            interactions.append(
                Interaction(
                    interaction_id=iid,
                    parent_id=parent,
                    messages=msgs,
                    output_message_list=[answer],
                    model_response=ModelResponse.from_arrays(
                        ctx, out, -rng.random(output_tokens, dtype=np.float32), "stop"
                    ),
                )
            )
            ctx, msgs, parent = np.concatenate([ctx, out]), [*msgs, answer], iid
            if k == branch_at:
                forks.append((parent, ctx, msgs))
        return parent, ctx, msgs

    forks: list[tuple[str | None, np.ndarray, list[dict[str, str]]]] = []
    chain(0, None, np.empty(0, np.int32), [], "")
    if forks:
        chain(branch_at + 1, *forks[0], "b")  # type: ignore[operator]
    return ReadyTrajectory(
        trajectory_id=trajectory_id,
        session_id=session_id,
        group_id=group_id,
        group_size=group_size,
        interactions=interactions,
        outcome_reward=outcome_reward,
        created_at=time.time(),
    )


def session_content_bytes(traj: ReadyTrajectory) -> int:
    """A session's content: unique prompt and output tokens x 4 B, output log-probs, unique message text.

    "Unique" along the tree: a turn contributes the tokens and messages it adds to its
    parent's context (what the compact form stores), so the figure is what any encoding
    must at least carry.
    """
    from infra.schema import compact_trajectory

    total = 0
    for it in compact_trajectory(traj).interactions:
        mr = it.model_response
        if mr is not None:
            total += len(mr.input_tokens_raw) + len(mr.output_tokens_raw) + len(mr.output_logprobs_raw or b"")
        for m in (*it.messages, *it.output_message_list):
            total += len(str(m.get("content", "")).encode())
    return total
