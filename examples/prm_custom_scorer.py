"""A worked custom PRM scorer module: copy it into your own package and adapt.

Three scorers show the three shapes a scorer can take:

* :class:`ToolUseScorer` — per-turn, scalar reward, with a **boolean turn observation**
  (``valid_tool_call``, aggregated as count and rate) and a **float trajectory
  observation** (``branch_turns``, sum and mean) emitted once per branch.
* :class:`LowConfidencePenalty` — per-turn, **dense** reward: a tensor with one value
  per output token, built with torch ops (no per-token Python loop).
* :class:`FinalAnswerScorer` — a :class:`BaseTrajectoryScorer` that looks at the whole
  branch once and rewards only the turn that gives the final answer; every other turn
  is left out of its mapping and scores 0.

Configure them in YAML by import path (the module must be importable by the worker,
e.g. installed in its image; deployments may restrict importable prefixes)::

    rollout:
      agent:
        prm:
          enabled: true
          scorers:
            - path: my_project.prm_scorers.ToolUseScorer
              weight: 0.5
            - path: my_project.prm_scorers.LowConfidencePenalty
              weight: 0.5
              kwargs: {logprob_threshold: -2.0}
            - path: my_project.prm_scorers.FinalAnswerScorer

Rules the runner enforces (see ``scoring_workers/prm``): return *unweighted* rewards;
a scalar or a tensor of shape ``[interaction.model_response.output_len]``; ``None`` or
an exception rejects the whole trajectory (return ``0.0`` for a deliberate zero);
inputs are read-only; keep per-request state inside the coroutine, since one scorer
instance serves many concurrent sessions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import torch

from scoring_workers.prm import (
    BaseScorer,
    BaseTrajectoryScorer,
    PRMConfig,
    PRMMetricObservation,
    PRMScorerResult,
)
from scoring_workers.prm.capabilities import RecordSettings


def _valid_tool_call(message: dict[str, Any]) -> bool:
    calls = message.get("tool_calls") or ()
    if not calls:
        return False
    for call in calls:
        try:
            json.loads(call["function"]["arguments"])
        except (KeyError, TypeError, ValueError):
            return False
    return True


class ToolUseScorer(BaseScorer):
    """1.0 for a turn whose output makes well-formed tool calls, else 0.0."""

    name = "tool_use"
    version = "1"

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        return 1.0 if any(_valid_tool_call(m) for m in interaction.output_message_list) else 0.0

    def prepare_result(self, interaction: Any, result: Any, ctx: dict[str, Any]) -> PRMScorerResult | None:
        # prepare_result sees the raw reward; observations are unweighted monitoring data.
        if result is None:
            return None
        observations = [
            PRMMetricObservation(
                metric_id="valid_tool_call",
                scope="turn",
                target_id=interaction.interaction_id,  # a turn observation targets its own turn
                value=result == 1.0,
                value_type="boolean",
                aggregations=("count", "rate"),
            )
        ]
        if interaction.interaction_id == ctx["leaf_id"]:  # once per branch, on its leaf
            depth, node = 0, interaction
            while node is not None:  # `parent` stays inside this branch
                depth, node = depth + 1, node.parent
            observations.append(
                PRMMetricObservation(
                    metric_id="branch_turns",
                    scope="trajectory",
                    target_id=ctx["leaf_id"],
                    value=float(depth),
                    value_type="float",
                    aggregations=("sum", "mean"),
                )
            )
        return PRMScorerResult(result, tuple(observations))


class LowConfidenceSettings(RecordSettings):
    """What an experiment-registry record may set on :class:`LowConfidencePenalty` (typed and
    bounded). A scorer that declares nothing lets records set only ``weight``/``enabled``;
    anything that could load code, read a file or the environment stays out of here."""

    logprob_threshold: Annotated[float, msgspec.Meta(ge=-100, le=0)] | msgspec.UnsetType = msgspec.UNSET


class LowConfidencePenalty(BaseScorer):
    """-1.0 on every output token whose log-probability is below a threshold."""

    name = "low_confidence"
    version = "1"
    record_settings = LowConfidenceSettings

    def __init__(self, weight: float = 1.0, enabled: bool = True, logprob_threshold: float = -2.0) -> None:
        super().__init__(weight=weight, enabled=enabled)
        self.logprob_threshold = float(logprob_threshold)

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> torch.Tensor | float:
        logprobs = interaction.model_response.output_logprobs  # read-only numpy view
        if logprobs is None:
            return 0.0  # no log-probs recorded: a deliberate zero, not a rejection
        low = torch.from_numpy(logprobs.copy()) < self.logprob_threshold
        return -low.to(torch.float32)  # shape [output_len]


class FinalAnswerScorer(BaseTrajectoryScorer):
    """Joint scoring: 1.0 on the turn that states ``ANSWER:``, nothing elsewhere."""

    name = "final_answer"
    version = "1"

    async def evaluate_trajectory(self, interactions: Sequence[Any], ctx: dict[str, Any]) -> dict[str, Any]:
        for interaction in reversed(interactions):  # root first, so the last answer wins
            if any("ANSWER:" in str(m.get("content") or "") for m in interaction.output_message_list):
                return {interaction.interaction_id: self._result(1.0, True, ctx)}
        # Nothing answered: reward no turn (missing ids score 0) but still observe it on the leaf.
        return {interactions[-1].interaction_id: self._result(0.0, False, ctx)}

    @staticmethod
    def _result(reward: float, answered: bool, ctx: dict[str, Any]) -> PRMScorerResult:
        return PRMScorerResult(
            reward,
            (
                PRMMetricObservation(
                    metric_id="answered",
                    scope="trajectory",
                    target_id=ctx["leaf_id"],
                    value=answered,
                    value_type="boolean",
                    aggregations=("rate",),
                ),
            ),
        )


def example_config() -> PRMConfig:
    """The three scorers as instances (borrowed by the runner; handy in notebooks/tests)."""
    return PRMConfig(
        enabled=True,
        scorers=[  # type: ignore[list-item]
            ToolUseScorer(weight=0.5),
            LowConfidencePenalty(weight=0.5, logprob_threshold=-2.0),
            FinalAnswerScorer(weight=1.0),
        ],
    )
