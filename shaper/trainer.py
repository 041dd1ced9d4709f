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

OpenClaw-RL's online mode (``trainer.online_samples`` with ``recipe: openclaw_turns``)
adds a second source: the workers' turn samples (:class:`shaper.online.TurnSampleConsumer`),
each trainable as it arrives, before its session ends, and shaped by :func:`shape_samples`;
verdict members whose turns came that way are left out of their groups (docs/trainer.md).

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

from infra import event_loop
from infra.config import (
    ActorConfig,
    ConfigError,
    PipelineConfig,
    PRMAdvantageShapingConfig,
    TrainerConfig,
    load_config,
    validate,
)
from infra.experiments import DEFAULT_EXPERIMENT
from infra.modes import combined_mode

from .batch import TrainingBatch, resolve_device
from .combiners import combined_token_signal
from .consumer import VerdictConsumer
from .exclusion import JudgeTurnTable, judge_turn_table, session_index, unhinted_turns
from .exclusion import exclude_neutral_turns as _exclude_neutral_turns
from .filters import get_filter
from .openclaw_recipe import openclaw_turn_advantages, turn_values_to_tokens
from .shaping import apply_shaping, grpo_outcome_advantages, shift_token_rewards

__all__ = [
    "ShapedBatch",
    "StepReport",
    "TrainerSummary",
    "cmd_trainer",
    "combined_token_signal",
    "format_step",
    "run_trainer",
    "shape_batch",
    "with_shaping_mode",
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
    source: str = "verdicts"  # or "turn_samples": online turn samples (trainer.online_samples)


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
    online_samples: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


def shape_batch(
    batch: TrainingBatch,
    shaping: PRMAdvantageShapingConfig,
    trainer: TrainerConfig | None = None,
    actor: ActorConfig | None = None,
) -> ShapedBatch:
    """Shifted masks/rewards, GRPO outcome advantages and shaped advantages for ``batch``.

    Pure and vectorised on the batch's device; the three calls a real trainer needs
    after its own advantage computation are the last two lines. The config structs
    come whole and were checked when built (mode, coefficients, recipe, combined mode
    and their compatibility): nothing is validated again per batch, and the modes are
    dispatched through the registry in :mod:`infra.modes`, never by a default.

    ``trainer.exclude_neutral_turns`` removes the turns OpenClaw-RL would not train on
    (judge score 0 or no next state, with the at-least-one guarantee per session) from
    the loss mask, using ``trainer.judge_scorer``'s per-turn results
    (:mod:`shaper.exclusion`). A combined mode that yields a signal replaces the summed
    token rewards by its combiner's signal of the ``judge_scorer`` and ``opd_scorer``
    channels (:mod:`shaper.combiners`). Both work in generated-token alignment, before
    the shift. ``actor.mask_no_eos_with_zero`` zeroes truncated rows' rewards (AReaL).

    OpenClaw-RL's recipes replace the outcome advantage altogether (their
    ``outcome_advantages`` are zeros): ``recipe: openclaw_turns`` trains judged turns
    with the judge score as advantage (:mod:`shaper.openclaw_recipe`), and a combined
    mode that yields the advantage (``openclaw_combine``) gives the advantage and mask.
    ``drop_unhinted_turns`` masks the turns ``opd_scorer`` accepted no hint for
    (:func:`shaper.exclusion.unhinted_turns`).
    """
    trainer = _DEFAULT_TRAINER if trainer is None else trainer
    actor = _DEFAULT_ACTOR if actor is None else actor
    combined = None if trainer.combined_mode is None else combined_mode(trainer.combined_mode)
    loss_mask = batch.loss_mask
    if trainer.drop_unhinted_turns:
        loss_mask = loss_mask & ~turn_values_to_tokens(unhinted_turns(batch, trainer.opd_scorer), batch.turn_index)
    channels = {"judge_scorer": trainer.judge_scorer, "opd_scorer": trainer.opd_scorer}
    direct: tuple[Tensor, Tensor] | None = None
    if trainer.recipe == "openclaw_turns":
        direct = openclaw_turn_advantages(batch, trainer.judge_scorer, loss_mask)
    elif combined is not None and combined.yields == "advantage":
        direct = combined.resolve()(batch, loss_mask, table=None, **channels)
    if direct is not None:  # OpenClaw-RL: the advantage itself, no outcome term, no shaping
        advantages, kept = direct
        mask = shift_token_rewards(kept)
        shifted = shift_token_rewards(advantages)
        return ShapedBatch(
            loss_mask=mask, token_rewards=shifted, outcome_advantages=torch.zeros_like(shifted), advantages=shifted
        )
    table: JudgeTurnTable | None = None
    if trainer.exclude_neutral_turns:
        table = judge_turn_table(batch, trainer.judge_scorer, needed_by="trainer.exclude_neutral_turns")
        sessions = session_index(batch.group_ids, batch.session_ids, device=batch.turn_index.device)
        loss_mask = _exclude_neutral_turns(
            loss_mask, batch.turn_index, table.scores, table.has_next_state, sessions, table.judged
        )
    signal = batch.token_rewards if combined is None else combined.resolve()(batch, loss_mask, table=table, **channels)
    outcome_rewards = batch.rewards
    if actor.mask_no_eos_with_zero:
        # AReaL: truncated rows stay in the loss; their outcome reward is not placed and
        # their token rewards are zeroed (advantages then come from the group baseline).
        truncated = batch.is_truncated
        outcome_rewards = torch.where(truncated, torch.zeros_like(outcome_rewards), outcome_rewards)
        signal = torch.where(truncated.unsqueeze(-1), torch.zeros_like(signal), signal)
    mask = shift_token_rewards(loss_mask)
    rewards = shift_token_rewards(signal)
    per_row = grpo_outcome_advantages(outcome_rewards, batch.group_ids)
    outcome = per_row.unsqueeze(-1).expand_as(rewards) * mask
    shaped = apply_shaping(outcome, rewards, mask, shaping)
    return ShapedBatch(loss_mask=mask, token_rewards=rewards, outcome_advantages=outcome, advantages=shaped)


def shape_samples(batch: TrainingBatch) -> ShapedBatch:
    """A batch of online turn samples (:class:`shaper.online.TurnSampleConsumer`): OpenClaw-RL's
    RL signal. Each row is one sample that trains, its score as token reward on its response
    (:func:`shaper.online.export_sample`); that score is the advantage, with no outcome term
    and no shaping — what :func:`shape_batch` gives a kept turn with ``recipe: openclaw_turns``.
    """
    mask = shift_token_rewards(batch.loss_mask)
    advantages = shift_token_rewards(torch.where(batch.loss_mask, batch.token_rewards, 0.0))
    return ShapedBatch(
        loss_mask=mask, token_rewards=advantages, outcome_advantages=torch.zeros_like(advantages), advantages=advantages
    )


_DEFAULT_TRAINER = TrainerConfig()
_DEFAULT_ACTOR = ActorConfig()


def with_shaping_mode(cfg: PipelineConfig, mode: str) -> PipelineConfig:
    """``cfg`` with ``advantage_shaping.mode`` replaced, checked as a loaded config is."""
    cfg = _replace_shaping_mode(cfg, mode)
    validate(cfg)
    return cfg


def _replace_shaping_mode(cfg: PipelineConfig, mode: str) -> PipelineConfig:
    prm = cfg.prm
    try:
        shaping = msgspec.structs.replace(prm.advantage_shaping, mode=mode)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    agent = msgspec.structs.replace(cfg.rollout.agent, prm=msgspec.structs.replace(prm, advantage_shaping=shaping))
    return msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, agent=agent))


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    n = mask.sum()
    if int(n.item()) == 0:
        return 0.0
    return float((values * mask).sum().item() / n.item())


_HEADLINE_PARTS = ("/prm_turn_reward/", "/prm_trajectory_reward/")


def format_step(report: StepReport, *, max_metrics: int = 4) -> str:
    """One line: step, sizes, mean advantages and the first few PRM reward metrics."""
    parts = [
        f"step {report.step}" + ("" if report.source == "verdicts" else f" ({report.source})"),
        f"groups={report.groups}",
        f"rows={report.rows}",
        f"tokens={report.tokens}",
        f"adv_outcome={report.mean_outcome_advantage:+.4f}",
        f"adv_shaped={report.mean_shaped_advantage:+.4f}",
        f"token_reward={report.mean_token_reward:+.4f}",
    ]
    shown = [
        (k, v) for k, v in report.metrics.items() if any(p in k for p in _HEADLINE_PARTS) and not k.endswith("__count")
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
    policy_version: int = 0,
    metrics_port: int | None = None,
) -> TrainerSummary:
    """Consume verdicts (and, in online mode, turn samples) and shape advantages until
    ``max_steps``, idleness or ``stop``.

    ``mode`` defaults to ``cfg.prm.advantage_shaping.mode`` (coefficients always come
    from there), ``device`` to ``cfg.trainer.device``. With ``idle_timeout_s``, the
    groups buffered when no verdict arrived for that long form a final smaller step,
    then the loop ends. Batches are acknowledged as the loop asks for the next one and
    at a normal exit; an exception (e.g. ``process_weighted`` meeting a reward outside
    ``[0, 1]``) propagates and leaves the failing batch for redelivery.

    With ``trainer.online_samples`` a second source runs beside the verdicts: the online
    turn samples (:class:`shaper.online.TurnSampleConsumer`), ``batch_groups`` samples a
    step, shaped by :func:`shape_samples`. Each source fills its next batch while the
    other's is stepped, steps take whichever batch is ready first, and a source asks for
    (and so acknowledges) its next batch only after the step that used its last one;
    a batch handed out but not stepped when the run ends stays uncommitted. With
    ``idle_timeout_s`` each source ends after that long without records, the run when
    both have.

    ``update`` is the optimiser step (e.g. :class:`prm_pipeline.demo.policy_update.PolicyUpdate`
    wrapped by the caller): it gets each batch with its shaped advantages and returns
    numbers for the step report; without it the loop shapes and reports only.

    ``policy_version`` is the version of the policy at the start; each step makes the
    next one (or the ``policy_version`` its ``update`` returns), and the consumer's
    staleness bound (``trainer.max_policy_lag``) compares verdicts with it.
    ``metrics_port`` serves the verdict consumer's counters to Prometheus (:mod:`shaper.telemetry`).
    """
    if mode is not None and mode != cfg.prm.advantage_shaping.mode:
        cfg = with_shaping_mode(cfg, mode)
    shaping, tc = cfg.prm.advantage_shaping, cfg.trainer
    dev = resolve_device(device if device is not None else tc.device)
    summary = TrainerSummary(
        device=str(dev),
        mode=shaping.mode,
        combined_mode=tc.combined_mode,
        exclude_neutral_turns=tc.exclude_neutral_turns,
        online_samples=tc.online_samples,
    )
    kwargs = dict(consumer_kwargs or {})
    consumer = VerdictConsumer(cfg, batch_groups=batch_groups, device=dev, dedupe_store=dedupe_store, **kwargs)
    sources = [_Source("verdicts", consumer, lambda batch: shape_batch(batch, shaping, tc, cfg.actor))]
    if tc.online_samples:
        from .online import TurnSampleConsumer  # the online mode's own consumer

        samples = TurnSampleConsumer(cfg, batch_groups=batch_groups, device=dev)
        sources.append(_Source("turn_samples", samples, shape_samples))
    for source in sources:
        source.consumer.set_policy_version(policy_version)
    telemetry = None
    if metrics_port is not None:
        from shaper.telemetry import TrainerTelemetry

        telemetry = TrainerTelemetry(consumer)
        telemetry.serve(metrics_port)
    try:
        return await _train(
            sources,
            summary,
            stop or asyncio.Event(),
            _Run(max_steps, idle_timeout_s, update, on_step),
            policy_version,
            telemetry,
        )
    finally:
        if telemetry is not None:
            telemetry.close()


@dataclass(slots=True)
class _Source:
    """One stream of batches of a run and how its batches are shaped."""

    name: str
    consumer: VerdictConsumer
    shape: Callable[[TrainingBatch], ShapedBatch]
    pending: bool = False  # a batch handed out and not yet stepped


@dataclass(frozen=True, slots=True)
class _Run:
    """What the caller asked of the run."""

    max_steps: int | None
    idle_timeout_s: float | None
    update: Callable[[TrainingBatch, ShapedBatch], Mapping[str, float]] | None
    on_step: Callable[[StepReport], None] | None


_Ready = tuple[_Source, TrainingBatch, asyncio.Event]


async def _feed(source: _Source, idle_timeout_s: float | None, ready: asyncio.Queue[_Ready]) -> None:
    """Hand ``source``'s batches to the steps, one at a time: the next is asked for (which
    acknowledges the last) only once the step that used the last one is done."""
    while True:
        batch = await source.consumer.next_batch(idle_timeout_s=idle_timeout_s)
        if batch is None:
            return
        stepped = asyncio.Event()
        source.pending = True
        await ready.put((source, batch, stepped))
        await stepped.wait()


async def _train(
    sources: list[_Source],
    summary: TrainerSummary,
    stop: asyncio.Event,
    run: _Run,
    policy_version: int,
    telemetry: Any,
) -> TrainerSummary:
    started: list[_Source] = []
    feeds: list[asyncio.Task[None]] = []
    try:
        for source in sources:
            await source.consumer.start()
            started.append(source)
        ready: asyncio.Queue[_Ready] = asyncio.Queue()
        feeds = [asyncio.create_task(_feed(source, run.idle_timeout_s, ready)) for source in sources]
        watcher = asyncio.create_task(_stop_when(stop, [s.consumer for s in sources]))
        try:
            while run.max_steps is None or summary.steps < run.max_steps:
                item = await _next_ready(ready, feeds)
                if item is None:
                    summary.stop_reason = "stopped" if stop.is_set() else "idle"
                    break
                source, batch, stepped = item
                policy_version = _step(source, batch, summary, run, policy_version)
                for s in sources:
                    s.consumer.set_policy_version(policy_version)
                if telemetry is not None:
                    telemetry.collector.steps = summary.steps
                source.pending = False
                stepped.set()
            else:
                summary.stop_reason = "max_steps"
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await _cancel(feeds)  # safe at any await of next_batch: nothing is begun across one
        for source in sources:  # a batch handed out but never stepped must not be acknowledged
            await source.consumer.aclose(commit=not source.pending)
    except BaseException:
        await _cancel(feeds)
        for source in started:  # the failing batch stays for redelivery
            await source.consumer.aclose(commit=False)
        raise
    summary.metrics = _merged_totals([s.consumer for s in sources])
    return summary


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _next_ready(ready: asyncio.Queue[_Ready], feeds: list[asyncio.Task[None]]) -> _Ready | None:
    """The next batch any source handed out; None once every source has ended (a source's
    exception is raised here)."""
    while True:
        if not ready.empty():
            return ready.get_nowait()
        running = [task for task in feeds if not task.done()]
        for task in feeds:
            if task.done():
                task.result()  # re-raise a source's failure
        if not running:
            return None
        getter = asyncio.ensure_future(ready.get())
        try:
            await asyncio.wait([getter, *running], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()


def _step(source: _Source, batch: TrainingBatch, summary: TrainerSummary, run: _Run, policy_version: int) -> int:
    """Shape ``batch``, run the update and report; returns the policy version after the step."""
    t0 = time.perf_counter()
    shaped = source.shape(batch)
    mask = shaped.loss_mask
    stepped = dict(run.update(batch, shaped)) if run.update is not None else {}
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
        source=source.name,
    )
    summary.steps += 1
    summary.groups += report.groups
    summary.rows += report.rows
    summary.tokens += report.tokens
    if run.on_step is not None:
        run.on_step(report)
    return int(stepped.get("policy_version", policy_version + 1))


def _merged_totals(consumers: list[VerdictConsumer]) -> dict[str, float]:
    """Every source's totals in one mapping (counters they share are added up)."""
    out: dict[str, float] = {}
    for consumer in consumers:
        for key, value in consumer.totals().items():
            out[key] = out.get(key, 0.0) + value if key.startswith("pipeline/") else value
    return out


async def _stop_when(stop: asyncio.Event, consumers: list[VerdictConsumer]) -> None:
    await stop.wait()
    for consumer in consumers:
        consumer.request_stop()


# --------------------------------------------------------------------------- CLI
def _configure(args: argparse.Namespace) -> PipelineConfig:
    cfg = load_config(getattr(args, "config", None))
    changes: dict[str, Any] = {
        name: getattr(args, name)
        for name in ("batch_groups", "device", "filter", "exclude_neutral_turns", "experiment")
        if getattr(args, name, None) is not None
    }
    combined = getattr(args, "combined_mode", None)
    if combined is not None:  # "none" on the command line turns a configured mode off
        changes["combined_mode"] = None if combined == "none" else combined
    try:  # one replace: the trainer's rules see the final combination of options
        cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, **changes))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.trainer.experiment != DEFAULT_EXPERIMENT:
        cfg = _declared_shaping(cfg)
    if args.mode is not None:
        cfg = _replace_shaping_mode(cfg, args.mode)
    if cfg.trainer.filter is not None:
        try:
            get_filter(cfg.trainer.filter)
        except ValueError as exc:
            raise ConfigError(f"trainer.filter: {exc}") from None
    validate(cfg)  # e.g. process_weighted with mask_no_eos_with_zero: ConfigError -> exit 2
    return cfg


def _declared_shaping(cfg: PipelineConfig) -> PipelineConfig:
    """``cfg`` shaping as the experiment's registry declaration says (its ``prm.advantage_shaping``):
    the workers score an experiment with the stack it declares, and its trainer shapes with
    the settings declared next to it. ``--mode`` still overrides the mode."""
    from infra.registry import declared_experiment

    experiment = cfg.trainer.experiment
    spec = asyncio.run(declared_experiment(cfg, experiment))  # UnknownExperiment: one line, exit 2
    if spec is None:  # the default experiment: no declaration, the config file's shaping
        return cfg
    shaping = spec.prm.advantage_shaping
    log.info("experiment %s: shaping as declared in the registry: %s", experiment, shaping)
    agent = msgspec.structs.replace(cfg.rollout.agent, prm=msgspec.structs.replace(cfg.prm, advantage_shaping=shaping))
    return msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, agent=agent))


def cmd_trainer(args: argparse.Namespace) -> int:
    """Entry point of ``prm-pipeline trainer``; SIGINT/SIGTERM stop it gracefully."""
    cfg = _configure(args)
    if logging.getLogger("shaper").getEffectiveLevel() > logging.INFO:
        logging.getLogger("shaper").setLevel(logging.INFO)  # progress lines ("waiting for N more groups")

    async def main() -> TrainerSummary:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        return await run_trainer(
            cfg,
            max_steps=args.max_steps,
            idle_timeout_s=args.idle_timeout,
            stop=stop,
            on_step=lambda report: print(format_step(report), flush=True),
            dedupe_store=args.dedupe_store,
            metrics_port=getattr(args, "metrics_port", None),
        )

    try:
        summary = event_loop.run(main())
    except ConfigError:
        raise  # a setting or flag to change (a taken --metrics-port): one line, exit 2 (prm_pipeline.cli)
    except ValueError as exc:  # bad device, unknown filter, out-of-range process rewards
        print(f"trainer: {exc}", file=sys.stderr)
        return 1
    extras = "".join(
        (
            f" + {summary.combined_mode}" if summary.combined_mode else "",
            ", neutral turns excluded" if summary.exclude_neutral_turns else "",
            ", online turn samples" if summary.online_samples else "",
        )
    )
    print(
        f"trainer stopped ({summary.stop_reason}): {summary.steps} steps, {summary.groups} groups, "
        f"{summary.rows} rows, {summary.tokens} tokens on {summary.device}, mode {summary.mode}{extras}",
        flush=True,
    )
    counters = {k: v for k, v in summary.metrics.items() if k.startswith("pipeline/")}
    if counters:
        print("  " + " ".join(f"{k[len('pipeline/') :]}={int(v)}" for k, v in counters.items()), flush=True)
    return 0
