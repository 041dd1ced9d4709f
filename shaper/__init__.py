"""Trainer side of prm-pipeline: advantage shaping, grouped filters, metric merging.

* :mod:`shaper.shaping` — pure, vectorised torch functions (shift, shape, GRPO).
* :mod:`shaper.filters` — complete-group filters and their decision counters.
* :mod:`shaper.metrics` — count-weighted merging of worker stats.
"""

from __future__ import annotations

from . import filters
from .metrics import merge_stats
from .shaping import SHAPING_MODES, grpo_outcome_advantages, shape_advantages, shift_token_rewards

# --- trainer-side consumer exports (VerdictConsumer, TrainingBatch) ------------
# Reserved for shaper/consumer.py and shaper/batch.py, owned by the lead.  Add
#   from .consumer import VerdictConsumer
#   from .batch import TrainingBatch
# here (and to __all__) once those modules exist.
# -------------------------------------------------------------------------------

__all__ = [
    "SHAPING_MODES",
    "filters",
    "grpo_outcome_advantages",
    "merge_stats",
    "shape_advantages",
    "shift_token_rewards",
]
