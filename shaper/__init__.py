"""Trainer side of prm-pipeline: advantage shaping, grouped filters, metric merging.

* :mod:`shaper.shaping` — pure, vectorised torch functions (shift, shape, GRPO).
* :mod:`shaper.filters` — complete-group filters and their decision counters.
* :mod:`shaper.metrics` — count-weighted merging of worker stats (:class:`VerdictMetrics`).
* :mod:`shaper.batch` — concat export of accepted verdicts into padded :class:`TrainingBatch` es.
* :mod:`shaper.consumer` — :class:`VerdictConsumer`: deduplicated batches from ``prm.verdicts``.
* :mod:`shaper.exclusion` — OpenClaw-RL's neutral-turn exclusion with the at-least-one guarantee.
* :mod:`shaper.combined` — PRM + OPD combined token signals (pure tensors).
* :mod:`shaper.combiners` — the combined modes' combiners over a batch's channels.
* :mod:`shaper.trainer` — the reference trainer loop (:func:`run_trainer`) and its CLI.
"""

from __future__ import annotations

from . import filters
from .batch import ConcatExportError, ExportedGroup, TrainingBatch, build_training_batch, collate, export_group
from .consumer import DedupeStore, SqliteDedupeStore, VerdictConsumer
from .exclusion import apply_exclusion, exclude_neutral_turns
from .metrics import VerdictMetrics, merge_stats
from .shaping import SHAPING_MODES, apply_shaping, grpo_outcome_advantages, shape_advantages, shift_token_rewards
from .trainer import TrainerSummary, run_trainer

__all__ = [
    "SHAPING_MODES",
    "ConcatExportError",
    "DedupeStore",
    "ExportedGroup",
    "SqliteDedupeStore",
    "TrainerSummary",
    "TrainingBatch",
    "VerdictConsumer",
    "VerdictMetrics",
    "apply_exclusion",
    "apply_shaping",
    "build_training_batch",
    "collate",
    "exclude_neutral_turns",
    "export_group",
    "filters",
    "grpo_outcome_advantages",
    "merge_stats",
    "run_trainer",
    "shape_advantages",
    "shift_token_rewards",
]
