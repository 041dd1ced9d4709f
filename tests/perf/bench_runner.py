"""Runner overhead per turn: ``PRMRunner.run`` against the same scorer called directly.

The figure of merit is the **ratio** runner / direct for ``LengthBudgetScorer`` on
linear ``--turns``-turn trajectories with ``--tokens`` output tokens per turn: the
cheapest realistic scorer makes the runner's own bookkeeping (branch clones, read-only
messages, validation, weighting, tensors, observations, turn results) as visible as it
can be. "Direct" is ``await scorer.evaluate_result(interaction, ctx)`` per turn — what
a hand-written loop without any of the runner's guarantees would pay. A second row runs
the same scorer on token-only turns (no chat messages), which isolates the cost of
freezing the branch conversation for ``ctx["messages"]``; a third uses a variant that
suspends once per turn (``await asyncio.sleep(0)``), which forces the concurrent path
(one task per turn) that I/O-bound judges take.

Runner and direct calls are timed round-robin in the same process, best of ``--repeats``; times are
reported, never asserted.

Run: ``python -m tests.perf.bench_runner --trajectories 200 --turns 8 --tokens 512``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np

from infra.schema import Interaction, ModelResponse, ReadyTrajectory
from scoring_workers.prm import PRMConfig, PRMRunner
from scoring_workers.scorers import LengthBudgetScorer


class _SuspendingLengthBudget(LengthBudgetScorer):
    """LengthBudgetScorer that yields to the event loop once, like an I/O-bound judge."""

    name = "length_budget_async"

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        await asyncio.sleep(0)
        return await super().evaluate(interaction, ctx)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=200, help="trajectories per timed pass (default 200)")
    parser.add_argument("--turns", type=int, default=8, help="turns per trajectory (default 8)")
    parser.add_argument("--tokens", type=int, default=512, help="output tokens per turn (default 512)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes; the best is reported (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.trajectories, args.turns, args.tokens, args.repeats) <= 0:
        parser.error("--trajectories, --turns, --tokens and --repeats must be positive")
    return args


def _trajectory(index: int, turns: int, tokens: int, rng: np.random.Generator, *, chat: bool = True) -> ReadyTrajectory:
    """A linear agent trajectory with a cumulative chat history, as concat export produces
    (``chat=False``: token-only turns, no messages)."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful coding agent. " * 8}]
    interactions: list[Interaction] = []
    prompt_len = 256
    parent = None
    for turn in range(turns):
        history.append({"role": "user", "content": f"observation {turn}: " + "lorem ipsum " * 40})
        output = {
            "role": "assistant",
            "content": f"step {turn}: " + "thinking " * 30,
            "tool_calls": [{"id": f"call{turn}", "type": "function", "function": {"name": "run", "arguments": "{}"}}],
        }
        iid = f"t{index}-turn{turn}"
        interactions.append(
            Interaction(
                interaction_id=iid,
                parent_id=parent,
                messages=[dict(m) for m in history] if chat else [],
                output_message_list=[output] if chat else [],
                model_response=ModelResponse.from_arrays(
                    rng.integers(0, 32000, prompt_len, dtype=np.int32),
                    rng.integers(0, 32000, tokens, dtype=np.int32),
                    rng.standard_normal(tokens).astype(np.float32),
                ),
            )
        )
        history.append(output)
        prompt_len += tokens + 64
        parent = iid
    return ReadyTrajectory(
        trajectory_id=f"traj-{index}",
        session_id=f"s-{index}",
        group_id="g",
        group_size=1,
        interactions=interactions,
        outcome_reward=1.0,
    )


async def _bench(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    rng = np.random.default_rng(args.seed)
    chat = [_trajectory(i, args.turns, args.tokens, rng) for i in range(args.trajectories)]
    tokens_only = [_trajectory(i, args.turns, args.tokens, rng, chat=False) for i in range(args.trajectories)]
    n_turns = args.trajectories * args.turns
    rows = []
    cases = (
        ("LengthBudgetScorer", LengthBudgetScorer(), chat),
        ("  same, token-only turns", LengthBudgetScorer(), tokens_only),
        ("  same, suspending once", _SuspendingLengthBudget(), chat),
    )
    for label, scorer, trajectories in cases:
        runner = await PRMRunner.create(PRMConfig(scorers=[scorer]))

        async def via_runner() -> None:
            for trajectory in trajectories:
                await runner.run(trajectory)

        async def direct() -> None:
            ctx = {"is_eval": False}
            for trajectory in trajectories:
                for interaction in trajectory.interactions:
                    await scorer.evaluate_result(interaction, ctx)

        best = {"runner": float("inf"), "direct": float("inf")}
        await via_runner()  # warm-up (imports, allocator, caches)
        await direct()
        for _ in range(args.repeats):
            for kind, fn in (("runner", via_runner), ("direct", direct)):
                start = time.perf_counter()
                await fn()
                best[kind] = min(best[kind], time.perf_counter() - start)
        await runner.aclose()
        rows.append((label, best["direct"] / n_turns * 1e6, best["runner"] / n_turns * 1e6))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rows = asyncio.run(_bench(args))
    print(
        f"PRMRunner overhead: {args.trajectories} trajectories x {args.turns} turns x {args.tokens} "
        f"output tokens, best of {args.repeats}"
    )
    header = f"{'scorer':<26}{'direct µs/turn':>16}{'runner µs/turn':>16}{'overhead µs/turn':>18}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    for name, direct_us, runner_us in rows:
        print(
            f"{name:<26}{direct_us:>16.2f}{runner_us:>16.2f}{runner_us - direct_us:>18.2f}{runner_us / direct_us:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
