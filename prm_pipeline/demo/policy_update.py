"""A real policy-gradient step on a :class:`~shaper.batch.TrainingBatch`: PPO-clip / GRPO.

The reference trainer (:mod:`shaper.trainer`) shapes advantages; this module spends
them. :class:`PolicyUpdate` takes any causal LM whose forward returns ``.logits``
(``model(input_ids=..., attention_mask=...)``) and, per step:

1. recomputes the log-prob of every token under the current weights in the trainer's
   next-token alignment (:func:`next_token_logprobs`: entry ``t`` is
   ``log p(input_ids[t + 1] | input_ids[:t + 1])``), and the batch's behaviour
   log-probs are shifted the same way (``shift_token_rewards(batch.logprobs)``);
2. before the first weight change it measures ``alignment_max_abs_diff`` — the
   largest ``|recomputed - behaviour|`` on the loss mask. On-policy (the rollout used
   the weights being trained) every importance ratio of the first minibatch is then
   1; anything more than float noise is an alignment bug (wrong shift, a re-tokenised
   turn, log-probs of the wrong tokens);
3. minimises the PPO-clip loss ``-min(r A, clip(r, 1 - eps, 1 + eps) A)`` averaged over
   loss-mask tokens (AReaL's token-level mean), with ``A`` the shaped advantages and
   ``r = exp(new - behaviour)``. GRPO is this loss with group-normalised outcome
   advantages and no critic, which is what :func:`shaper.trainer.shape_batch` gives.

Minibatches after the first see weights already moved, so their ratios leave 1 — that
is what the ``ratio_*`` and ``clip_fraction`` statistics show. Pure torch: the
shaper never imports ``transformers``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from shaper.batch import TrainingBatch
from shaper.shaping import shift_token_rewards

__all__ = ["PolicyUpdate", "UpdateStats", "next_token_logprobs", "ppo_clip_loss"]


def next_token_logprobs(model: Callable[..., Any], input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """``[B, T]`` log-probs in next-token alignment; the last column is 0 (nothing follows)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (0, 1))


def ppo_clip_loss(
    new_logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, ratio, clipped)``: the token-mean PPO-clip loss over ``mask``."""
    maskf = mask.to(new_logp.dtype)
    ratio = torch.exp((new_logp - old_logp) * maskf)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = (per_token * maskf).sum() / maskf.sum().clamp_min(1.0)
    return loss, ratio, (unclipped != clipped) & mask


@dataclass(frozen=True, slots=True)
class UpdateStats:
    """One optimiser step's numbers (token means over the loss mask)."""

    loss: float
    alignment_max_abs_diff: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    clip_fraction: float
    tokens: int
    grad_norm: float

    def as_dict(self) -> dict[str, float]:
        return {f"update/{k}": float(getattr(self, k)) for k in self.__slots__}


class PolicyUpdate:
    """PPO-clip on ``model`` with Adam; :meth:`step` consumes one batch and its shaped advantages."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float = 3e-3,
        clip_eps: float = 0.2,
        minibatches: int = 2,
        max_grad_norm: float = 1.0,
    ) -> None:
        if minibatches < 1:
            raise ValueError(f"minibatches must be >= 1, got {minibatches}")
        self.model = model
        self.clip_eps = clip_eps
        self.minibatches = minibatches
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def recompute(self, batch: TrainingBatch) -> tuple[Tensor, Tensor, Tensor]:
        """``(recomputed, behaviour, mask)``, all shifted, on the model's device: the alignment check's inputs."""
        batch = batch.to(self.device)
        new = next_token_logprobs(self.model, batch.input_ids, batch.attention_mask)
        return new, shift_token_rewards(batch.logprobs), shift_token_rewards(batch.loss_mask)

    def step(self, batch: TrainingBatch, advantages: Tensor, loss_mask: Tensor) -> UpdateStats:
        """One pass over ``batch`` in ``minibatches`` row slices; ``advantages``/``loss_mask`` are shifted.

        Everything moves to the model's device first (the batch may come from a CPU consumer).
        """
        batch = batch.to(self.device)
        advantages = advantages.to(self.device)
        old = shift_token_rewards(batch.logprobs)
        mask = loss_mask.to(self.device).bool()
        rows = batch.batch_size
        bounds = [round(i * rows / self.minibatches) for i in range(self.minibatches + 1)]
        alignment = 0.0
        losses: list[float] = []
        ratios: list[Tensor] = []
        clipped = 0
        norm = 0.0
        self.model.train()
        try:
            for lo, hi in zip(bounds, bounds[1:]):
                if hi <= lo:
                    continue
                m = mask[lo:hi]
                new = next_token_logprobs(self.model, batch.input_ids[lo:hi], batch.attention_mask[lo:hi])
                if not losses:  # the first minibatch: before any weight change
                    alignment = float(((new.detach() - old[lo:hi]).abs() * m).max().item()) if m.any() else 0.0
                loss, ratio, was_clipped = ppo_clip_loss(new, old[lo:hi], advantages[lo:hi], m, self.clip_eps)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
                self.optimizer.step()
                losses.append(float(loss.item()))
                ratios.append(ratio.detach()[m])
                clipped += int(was_clipped.sum().item())
        finally:
            self.model.eval()
        r = torch.cat(ratios).float().cpu() if ratios else torch.ones(0)
        n = int(mask.sum().item())
        return UpdateStats(
            loss=sum(losses) / max(1, len(losses)),
            alignment_max_abs_diff=alignment,
            ratio_mean=float(r.mean()) if r.numel() else 1.0,
            ratio_min=float(r.min()) if r.numel() else 1.0,
            ratio_max=float(r.max()) if r.numel() else 1.0,
            clip_fraction=clipped / max(1, n),
            tokens=n,
            grad_norm=norm,
        )
