"""A reference trainer loop: what a real trainer does with verdicts, minus the model.

Each step takes one :class:`~shaper.batch.TrainingBatch` from a
:class:`~shaper.consumer.VerdictConsumer` and runs the trainer-side half of AReaL's Process
Rewards "Advantage Shaping" exactly where an AReaL/verl-style trainer would:

1. move to next-token-prediction positions: the logits at position ``t`` predict
   token ``t + 1``, so ``loss_mask`` and ``token_rewards`` are shifted left by one
   (:func:`shaper.shift_token_rewards`; AReaL's actor rolls its ``loss_mask`` the same
   way). With ``actor.mask_no_eos_with_zero`` truncated rows keep their loss mask but
   get zero outcome and token rewards (AReaL's actor);
2. outcome advantages: GRPO group normalisation of the raw outcome rewards
   (:func:`shaper.grpo_outcome_advantages`; one row per branch, so a session with two
   branches counts twice in its group), broadcast over the row's trainable tokens.
   This stands in for "GAE + advantage normalisation"; process rewards never enter it;
3. :func:`shaper.shape_advantages` folds the shifted process rewards into those
   advantages with the configured mode.

Two trainer-side options change what goes into steps 1 and 3 (``trainer:`` config):

* ``exclude_neutral_turns`` — OpenClaw-RL's exclusion policy on the loss mask
  (:mod:`shaper.exclusion`), from the judge scorer's per-turn results;
* ``combined_mode`` — the per-token process signal is a PRM + OPD combination
  (:mod:`shaper.combined`) of two scorers' channels instead of the summed token
  rewards; ``advantage_shaping.mode`` still decides how that signal is folded in.

It then reports one line per step. The optimiser step is the caller's ``update``
callback (the demo passes :class:`prm_pipeline.demo.policy_update.PolicyUpdate`, PPO-clip on a
real model); without one the loop only shapes (see ``docs/trainer.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from torch import Tensor

from infra.config import COMBINED_MODES, SHAPING_MODES, ConfigError, PipelineConfig, load_config, validate

from .batch import TrainingBatch, resolve_device
from .combined import openclaw_combine, prm_gated_opd, prm_weighted_opd, turn_scores_from_tokens
from .consumer import VerdictConsumer
from .exclusion import JudgeTurnTable, judge_turn_table, session_index, unhinted_turns
from .exclusion import exclude_neutral_turns as _exclude_neutral_turns
from .filters import get_filter
from .openclaw_recipe import RECIPES, openclaw_turn_advantages, turn_values_to_tokens
from .shaping import grpo_outcome_advantages, shape_advantages, shift_token_rewards

__all__ = [
    "ShapedBatch",
    "StepReport",
    "TrainerSummary",
    "check_combined_mode",
    "cmd_trainer",
    "combined_token_signal",
    "format_step",
    "run_trainer",
    "shape_batch",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ShapedBatch:
    """Tensors of one step in next-token-prediction alignment, on the batch's device."""

    loss_mask: Tensor  # bool [B, T], shifted
    token_rewards: Tensor  # float32 [B, T], shifted
    outcome_advantages: Tensor  # float32 [B, T], GRPO per row, masked
    advantages: Tensor  # float32 [B, T], shaped


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one trainer step saw and computed (passed to ``on_step``)."""

    step: int
    groups: int
    rows: int
    tokens: int
    mean_outcome_advantage: float
    mean_shaped_advantage: float
    mean_token_reward: float
    seconds: float
    metrics: dict[str, float]
    update: dict[str, float] = field(default_factory=dict)  # what the ``update`` callback returned


@dataclass(slots=True)
class TrainerSummary:
    """The run as a whole: totals and why it stopped (``max_steps``, ``idle``, ``stopped``)."""

    steps: int = 0
    groups: int = 0
    rows: int = 0
    tokens: int = 0
    stop_reason: str = ""
    device: str = "cpu"
    mode: str = "additive"
    combined_mode: str | None = None
    exclude_neutral_turns: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


def shape_batch(
    batch: TrainingBatch,
    *,
    mode: str,
    negative_scale: float = 0.2,
    zero_penalty: float = 0.4,
    zero_eps: float = 1e-6,
    mask_no_eos_with_zero: bool = False,
    exclude_neutral_turns: bool = False,
    judge_scorer: str = "openclaw_judge",
    combined_mode: str | None = None,
    opd_scorer: str = "opd_teacher",
    gate_penalty: float = -1.0,
    recipe: str = "grpo",
    drop_unhinted_turns: bool = False,
) -> ShapedBatch:
    """Shifted masks/rewards, GRPO outcome advantages and shaped advantages for ``batch``.

    Pure and vectorised on the batch's device; the three calls a real trainer needs
    after its own advantage computation are the last two lines.

    ``exclude_neutral_turns`` removes the turns OpenClaw-RL would not train on (judge
    score 0 or no next state, with the at-least-one guarantee per session) from the
    loss mask, using ``judge_scorer``'s per-turn results (:mod:`shaper.exclusion`).
    ``combined_mode`` (``prm_gated_opd`` | ``prm_weighted_opd``) replaces the summed
    token rewards by :func:`combined_token_signal` of the ``judge_scorer`` and
    ``opd_scorer`` channels. Both work in generated-token alignment, before the shift.

    OpenClaw-RL's recipes replace the outcome advantage altogether (their
    ``outcome_advantages`` are zeros): ``recipe="openclaw_turns"`` trains judged turns
    with the judge score as advantage (:mod:`shaper.openclaw_recipe`), and
    ``combined_mode="openclaw_combine"`` uses :func:`shaper.combined.openclaw_combine`'s
    advantage and mask. ``drop_unhinted_turns`` masks the turns ``opd_scorer`` accepted
    no hint for (:func:`shaper.exclusion.unhinted_turns`).
    """
    check_recipe(recipe, combined_mode, exclude_neutral_turns)
    loss_mask = batch.loss_mask
    if drop_unhinted_turns:
        loss_mask = loss_mask & ~turn_values_to_tokens(unhinted_turns(batch, opd_scorer), batch.turn_index)
    direct: tuple[Tensor, Tensor] | None = None
    if recipe == "openclaw_turns":
        direct = openclaw_turn_advantages(batch, judge_scorer, loss_mask)
    elif combined_mode == "openclaw_combine":
        direct = _openclaw_combine(batch, loss_mask, judge_scorer, opd_scorer)
    if direct is not None:  # OpenClaw-RL: the advantage itself, no outcome term, no shaping
        advantages, kept = direct
        mask = shift_token_rewards(kept)
        shifted = shift_token_rewards(advantages)
        return ShapedBatch(loss_mask=mask, token_rewards=shifted, outcome_advantages=torch.zeros_like(shifted),
                           advantages=shifted)
    table: JudgeTurnTable | None = None
    if exclude_neutral_turns or combined_mode == "prm_gated_opd":
        table = judge_turn_table(batch, judge_scorer)
    if exclude_neutral_turns:
        assert table is not None
        sessions = session_index(batch.group_ids, batch.session_ids, device=batch.turn_index.device)
        loss_mask = _exclude_neutral_turns(loss_mask, batch.turn_index, table.scores, table.has_next_state,
                                           sessions, table.judged)
    if combined_mode is None:
        signal = batch.token_rewards
    else:
        signal = combined_token_signal(batch, combined_mode, loss_mask=loss_mask, judge_scorer=judge_scorer,
                                       opd_scorer=opd_scorer, penalty=gate_penalty, table=table)
    outcome_rewards = batch.rewards
    if mask_no_eos_with_zero:
        # AReaL: truncated rows stay in the loss; their outcome reward is not placed and
        # their token rewards are zeroed (advantages then come from the group baseline).
        truncated = batch.is_truncated
        outcome_rewards = torch.where(truncated, torch.zeros_like(outcome_rewards), outcome_rewards)
        signal = torch.where(truncated.unsqueeze(-1), torch.zeros_like(signal), signal)
    mask = shift_token_rewards(loss_mask)
    rewards = shift_token_rewards(signal)
    per_row = grpo_outcome_advantages(outcome_rewards, batch.group_ids)
    outcome = per_row.unsqueeze(-1).expand_as(rewards) * mask
    shaped = shape_advantages(outcome, rewards, mask, mode=mode, negative_scale=negative_scale,
                              zero_penalty=zero_penalty, zero_eps=zero_eps)
    return ShapedBatch(loss_mask=mask, token_rewards=rewards, outcome_advantages=outcome, advantages=shaped)


def combined_token_signal(
    batch: TrainingBatch,
    combined_mode: str,
    *,
    loss_mask: Tensor | None = None,
    judge_scorer: str = "openclaw_judge",
    opd_scorer: str = "opd_teacher",
    penalty: float = -1.0,
    table: JudgeTurnTable | None = None,
) -> Tensor:
    """The ``[B, T]`` PRM + OPD token signal of ``batch`` (unshifted, 0 off the loss mask).

    Per-turn scores are the ``judge_scorer`` channel's mean over each turn's tokens
    (its weighted ``+1/0/-1``); token signals are the ``opd_scorer`` channel
    (``teacher_lp - rollout_lp``, weighted). ``prm_gated_opd`` additionally treats
    turns without a next state as unjudged (``turn_mask``), from the judge's
    ``has_next_state`` observations: such a turn (normally the last) has nothing to be
    judged on, so its ``0`` must not cut the cascade or earn the penalty.
    """
    check_combined_mode(combined_mode)
    if combined_mode == "openclaw_combine":
        raise ValueError("openclaw_combine yields an advantage and a mask, not a token signal: use shape_batch")
    _require_channels(batch, combined_mode, judge_scorer, opd_scorer)
    mask = batch.loss_mask if loss_mask is None else loss_mask
    turn_index = batch.turn_index
    num_turns = int(turn_index.max().item()) + 1 if turn_index.numel() else 0
    scores = turn_scores_from_tokens(batch.channels[judge_scorer], turn_index, num_turns)
    opd = batch.channels[opd_scorer]
    if combined_mode == "prm_weighted_opd":
        return prm_weighted_opd(opd, scores, turn_index, mask)
    table = table if table is not None else judge_turn_table(batch, judge_scorer)
    return prm_gated_opd(opd, scores, turn_index, mask, penalty=penalty,
                         turn_mask=table.judged & table.has_next_state)


def _openclaw_combine(
    batch: TrainingBatch, loss_mask: Tensor, judge_scorer: str, opd_scorer: str
) -> tuple[Tensor, Tensor]:
    """:func:`shaper.combined.openclaw_combine` on the batch's channels; the scorers'
    weights already scale them, so they play ``w_rl`` (judge) and ``w_opd`` (OPD)."""
    _require_channels(batch, "openclaw_combine", judge_scorer, opd_scorer)
    turn_index = batch.turn_index
    num_turns = int(turn_index.max().item()) + 1 if turn_index.numel() else 0
    scores = turn_scores_from_tokens(batch.channels[judge_scorer], turn_index, num_turns)
    hinted = ~unhinted_turns(batch, opd_scorer)
    return openclaw_combine(batch.channels[opd_scorer], scores, hinted, turn_index, loss_mask)


def _require_channels(batch: TrainingBatch, combined_mode: str, judge_scorer: str, opd_scorer: str) -> None:
    missing = [name for name in (judge_scorer, opd_scorer) if name not in batch.channels]
    if missing:
        raise ValueError(
            f"combined_mode {combined_mode!r} needs the per-scorer channels of {judge_scorer!r} (judge) and "
            f"{opd_scorer!r} (OPD); the batch has {sorted(batch.channels) or 'none'}, missing {missing}. Run the "
            "workers with worker.keep_scorer_channels: true and both scorers configured, or set "
            "trainer.judge_scorer / trainer.opd_scorer to their names"
        )


def check_recipe(recipe: str, combined_mode: str | None = None, exclude_neutral_turns: bool = False) -> None:
    """Refuse an unknown recipe, and OpenClaw-RL's turn recipe combined with a PRM + OPD mode
    (each defines the whole advantage) or with our exclusion (it has OpenClaw-RL's own)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown trainer recipe {recipe!r}; expected one of {list(RECIPES)}")
    if exclude_neutral_turns and (recipe == "openclaw_turns" or combined_mode == "openclaw_combine"):
        which = "trainer.recipe 'openclaw_turns'" if recipe == "openclaw_turns" else "combined_mode 'openclaw_combine'"
        raise ValueError(
            f"{which} applies OpenClaw-RL's own turn selection; turn trainer.exclude_neutral_turns off"
        )
    if recipe != "grpo" and combined_mode is not None:
        raise ValueError(
            f"trainer.recipe {recipe!r} defines the whole advantage; it cannot be combined with "
            f"trainer.combined_mode {combined_mode!r} (use one of them)"
        )


def check_combined_mode(combined_mode: str | None, shaping_mode: str | None = None) -> None:
    """Refuse an unknown combined mode, and one that ``shaping_mode`` cannot fold in.

    The combined signals are signed (a ``-1`` penalty, ``score x (teacher_lp -
    rollout_lp)``), while ``process_weighted`` multiplies advantages by a weight in
    ``[0, 1]``: better to say so at start-up than on the first batch.
    """
    if combined_mode is None:
        return
    if combined_mode not in COMBINED_MODES:
        raise ValueError(f"unknown combined mode {combined_mode!r}; expected one of {list(COMBINED_MODES)} or null")
    if shaping_mode == "process_weighted" and combined_mode != "openclaw_combine":  # that one is not shaped
        raise ValueError(
            f"trainer.combined_mode {combined_mode!r} produces signed token signals, but "
            "advantage_shaping.mode 'process_weighted' needs process rewards in [0, 1]; use additive or gvpo"
        )


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    n = mask.sum()
    if int(n.item()) == 0:
        return 0.0
    return float((values * mask).sum().item() / n.item())


_HEADLINE_PARTS = ("/prm_turn_reward/", "/prm_trajectory_reward/")


def format_step(report: StepReport, *, max_metrics: int = 4) -> str:
    """One line: step, sizes, mean advantages and the first few PRM reward metrics."""
    parts = [
        f"step {report.step}",
        f"groups={report.groups}",
        f"rows={report.rows}",
        f"tokens={report.tokens}",
        f"adv_outcome={report.mean_outcome_advantage:+.4f}",
        f"adv_shaped={report.mean_shaped_advantage:+.4f}",
        f"token_reward={report.mean_token_reward:+.4f}",
    ]
    shown = [
        (k, v) for k, v in report.metrics.items()
        if any(p in k for p in _HEADLINE_PARTS) and not k.endswith("__count")
    ][:max_metrics]
    parts += [f"{k}={v:.4f}" for k, v in shown]
    for name in ("verdicts/rejected", "verdicts/duplicate", "groups/dropped/filtered"):
        value = report.metrics.get(f"pipeline/{name}")
        if value:
            parts.append(f"{name}={int(value)}")
    parts.append(f"{1e3 * report.seconds:.1f}ms")
    return " ".join(parts)


async def run_trainer(
    cfg: PipelineConfig,
    *,
    max_steps: int | None = None,
    idle_timeout_s: float | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    mode: str | None = None,
    device: str | torch.device | None = None,
    batch_groups: int | None = None,
    dedupe_store: str | None = None,
    stop: asyncio.Event | None = None,
    consumer_kwargs: Mapping[str, Any] | None = None,
    update: Callable[[TrainingBatch, ShapedBatch], Mapping[str, float]] | None = None,
) -> TrainerSummary:
    """Consume verdicts and shape advantages until ``max_steps``, idleness or ``stop``.

    ``mode`` defaults to ``cfg.prm.advantage_shaping.mode`` (coefficients always come
    from there), ``device`` to ``cfg.trainer.device``. With ``idle_timeout_s``, the
    groups buffered when no verdict arrived for that long form a final smaller step,
    then the loop ends. Batches are acknowledged as the loop asks for the next one and
    at a normal exit; an exception (e.g. ``process_weighted`` meeting a reward outside
    ``[0, 1]``) propagates and leaves the failing batch for redelivery.

    ``update`` is the optimiser step (e.g. :class:`prm_pipeline.demo.policy_update.PolicyUpdate`
    wrapped by the caller): it gets each batch with its shaped advantages and returns
    numbers for the step report; without it the loop shapes and reports only.
    """
    shaping = cfg.prm.advantage_shaping
    mode = mode or shaping.mode
    if mode not in SHAPING_MODES:
        raise ValueError(f"unknown shaping mode {mode!r}; expected one of {list(SHAPING_MODES)}")
    tc = cfg.trainer
    check_combined_mode(tc.combined_mode, mode)
    check_recipe(tc.recipe, tc.combined_mode, tc.exclude_neutral_turns)
    dev = resolve_device(device if device is not None else tc.device)
    summary = TrainerSummary(device=str(dev), mode=mode, combined_mode=tc.combined_mode,
                             exclude_neutral_turns=tc.exclude_neutral_turns)
    stop = stop or asyncio.Event()
    kwargs = dict(consumer_kwargs or {})
    consumer = VerdictConsumer(cfg, batch_groups=batch_groups, device=dev, dedupe_store=dedupe_store, **kwargs)
    async with consumer:
        watcher = asyncio.create_task(_stop_when(stop, consumer))
        try:
            while max_steps is None or summary.steps < max_steps:
                batch = await consumer.next_batch(idle_timeout_s=idle_timeout_s)
                if batch is None:
                    summary.stop_reason = "stopped" if stop.is_set() else "idle"
                    break
                t0 = time.perf_counter()
                shaped = shape_batch(
                    batch, mode=mode, negative_scale=shaping.negative_scale, zero_penalty=shaping.zero_penalty,
                    zero_eps=shaping.zero_eps, mask_no_eos_with_zero=cfg.actor.mask_no_eos_with_zero,
                    exclude_neutral_turns=tc.exclude_neutral_turns, judge_scorer=tc.judge_scorer,
                    combined_mode=tc.combined_mode, opd_scorer=tc.opd_scorer,
                    recipe=tc.recipe, drop_unhinted_turns=tc.drop_unhinted_turns,
                )
                mask = shaped.loss_mask
                stepped = dict(update(batch, shaped)) if update is not None else {}
                report = StepReport(
                    step=summary.steps + 1,
                    groups=batch.num_groups,
                    rows=batch.batch_size,
                    tokens=int(mask.sum().item()),
                    mean_outcome_advantage=_masked_mean(shaped.outcome_advantages, mask),
                    mean_shaped_advantage=_masked_mean(shaped.advantages, mask),
                    mean_token_reward=_masked_mean(shaped.token_rewards, mask),
                    seconds=time.perf_counter() - t0,
                    metrics=batch.metrics,
                    update=stepped,
                )
                summary.steps += 1
                summary.groups += report.groups
                summary.rows += report.rows
                summary.tokens += report.tokens
                if on_step is not None:
                    on_step(report)
            else:
                summary.stop_reason = "max_steps"
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        summary.metrics = consumer.totals()
    return summary


async def _stop_when(stop: asyncio.Event, consumer: VerdictConsumer) -> None:
    await stop.wait()
    consumer.request_stop()


# --------------------------------------------------------------------------- CLI
def _configure(args: argparse.Namespace) -> PipelineConfig:
    cfg = load_config(getattr(args, "config", None))
    trainer = cfg.trainer
    if args.batch_groups is not None:
        trainer = msgspec.structs.replace(trainer, batch_groups=args.batch_groups)
    if args.device is not None:
        trainer = msgspec.structs.replace(trainer, device=args.device)
    if args.filter is not None:
        trainer = msgspec.structs.replace(trainer, filter=args.filter)
    if getattr(args, "exclude_neutral_turns", None) is not None:
        trainer = msgspec.structs.replace(trainer, exclude_neutral_turns=args.exclude_neutral_turns)
    combined = getattr(args, "combined_mode", None)
    if combined is not None:  # "none" on the command line turns a configured mode off
        trainer = msgspec.structs.replace(trainer, combined_mode=None if combined == "none" else combined)
    cfg = msgspec.structs.replace(cfg, trainer=trainer)
    if args.mode is not None:
        prm = cfg.prm
        shaping = msgspec.structs.replace(prm.advantage_shaping, mode=args.mode)
        agent = msgspec.structs.replace(cfg.rollout.agent, prm=msgspec.structs.replace(prm, advantage_shaping=shaping))
        cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, agent=agent))
    if cfg.trainer.filter is not None:
        try:
            get_filter(cfg.trainer.filter)
        except ValueError as exc:
            raise ConfigError(f"trainer.filter: {exc}") from None
    validate(cfg)  # e.g. process_weighted with mask_no_eos_with_zero: ConfigError -> exit 2
    try:
        check_combined_mode(cfg.trainer.combined_mode, cfg.prm.advantage_shaping.mode)
        check_recipe(cfg.trainer.recipe, cfg.trainer.combined_mode, cfg.trainer.exclude_neutral_turns)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return cfg


def cmd_trainer(args: argparse.Namespace) -> int:
    """Entry point of ``prm-pipeline trainer``; SIGINT/SIGTERM stop it gracefully."""
    cfg = _configure(args)

    async def main() -> TrainerSummary:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        return await run_trainer(
            cfg, max_steps=args.max_steps, idle_timeout_s=args.idle_timeout, stop=stop,
            on_step=lambda report: print(format_step(report), flush=True), dedupe_store=args.dedupe_store,
        )

    try:
        summary = asyncio.run(main())
    except ValueError as exc:  # bad device, unknown filter, out-of-range process rewards
        print(f"trainer: {exc}", file=sys.stderr)
        return 1
    extras = "".join((
        f" + {summary.combined_mode}" if summary.combined_mode else "",
        ", neutral turns excluded" if summary.exclude_neutral_turns else "",
    ))
    print(
        f"trainer stopped ({summary.stop_reason}): {summary.steps} steps, {summary.groups} groups, "
        f"{summary.rows} rows, {summary.tokens} tokens on {summary.device}, mode {summary.mode}{extras}",
        flush=True,
    )
    counters = {k: v for k, v in summary.metrics.items() if k.startswith("pipeline/")}
    if counters:
        print("  " + " ".join(f"{k[len('pipeline/'):]}={int(v)}" for k, v in counters.items()), flush=True)
    return 0
