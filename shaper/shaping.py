"""Trainer-side advantage shaping with process (token-level) rewards.

Scoring workers attach ``token_rewards`` to every *generated* token (prompt
tokens carry 0).  The trainer consumes them in three steps, in this order:

1. :func:`shift_token_rewards` moves them from "the token that was generated"
   to "the position whose logits predicted it" (next-token prediction), so they
   line up with PPO's log-prob / advantage tensors.
2. Ordinary GAE and advantage normalisation run on the *outcome* reward only
   (for GRPO-style training :func:`grpo_outcome_advantages` is the group
   normalisation).  Critic returns are never touched by process rewards.
3. :func:`shape_advantages` folds the shifted process rewards into the already
   normalised advantages with one of :data:`SHAPING_MODES`.

Every function here is pure (inputs are never mutated), fully vectorised and
runs on whatever device its input tensors live on: no Python loops over rows or
tokens, and no host synchronisation except where an error must be raised.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final, Literal

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "SHAPING_MODES",
    "ShapingMode",
    "grpo_outcome_advantages",
    "shape_advantages",
    "shift_token_rewards",
]

ShapingMode = Literal["additive", "gvpo", "process_weighted"]

SHAPING_MODES: Final[tuple[str, ...]] = ("additive", "gvpo", "process_weighted")
"""Valid ``mode`` values of :func:`shape_advantages` (seed 001, "Advantage Shaping")."""


# --------------------------------------------------------------------------- #
# Alignment
# --------------------------------------------------------------------------- #
def shift_token_rewards(token_rewards: Tensor) -> Tensor:
    """Shift rewards from generated-token positions to next-token-prediction positions.

    A reward earned by token ``t + 1`` belongs to the logits at position ``t``
    that produced it, so ``out[..., t] = in[..., t + 1]`` along the last axis.
    The last position predicts nothing inside the sequence and gets ``0``;
    nothing wraps around (``torch.roll`` would leak the first token's reward,
    normally a prompt zero but not guaranteed, into the last slot).

    Works for a single sequence ``[T]`` and a batch ``[B, T]`` (or any leading
    dims).  Returns a new tensor with the input's dtype and device.
    """
    if token_rewards.dim() < 1:
        raise ValueError(
            "token_rewards must have at least one dimension (…, T); got a 0-d tensor"
        )
    out = torch.zeros_like(token_rewards)
    if token_rewards.shape[-1] > 1:
        out[..., :-1] = token_rewards[..., 1:]
    return out


# --------------------------------------------------------------------------- #
# Shaping
# --------------------------------------------------------------------------- #
def _check_coefficient(name: str, value: float) -> float:
    """Coefficients come from YAML; reject nonsense early rather than train on it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return value


def _check_tensors(advantages: Tensor, token_rewards: Tensor, loss_mask: Tensor) -> None:
    shapes = (tuple(advantages.shape), tuple(token_rewards.shape), tuple(loss_mask.shape))
    if not (shapes[0] == shapes[1] == shapes[2]):
        raise ValueError(
            "advantages, token_rewards and loss_mask must have the same shape; got "
            f"advantages={shapes[0]}, token_rewards={shapes[1]}, loss_mask={shapes[2]}"
        )
    devices = (advantages.device, token_rewards.device, loss_mask.device)
    if not (devices[0] == devices[1] == devices[2]):
        raise ValueError(
            "advantages, token_rewards and loss_mask must be on the same device; got "
            f"advantages={devices[0]}, token_rewards={devices[1]}, loss_mask={devices[2]}"
        )
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating-point tensor, got dtype {advantages.dtype}")


def _check_process_weights(rewards: Tensor, active: Tensor) -> None:
    """process_weighted multiplies advantages by P, so P must be a weight in [0, 1].

    Fast path: one ``aminmax`` over the whole tensor (inactive positions are
    normally 0, so they rarely get in the way).  Only if that fails (out of
    range somewhere, or NaN, which ``aminmax`` propagates) do we look at the
    active positions alone, to decide and to name the first offender.  This is
    the only host synchronisation in the shaping path: a bad reward must
    surface as an exception rather than a silently wrong gradient.
    """
    if rewards.numel() == 0:
        return
    lo, hi = (float(v) for v in rewards.aminmax())
    if 0.0 <= lo and hi <= 1.0:
        return
    bad = active & ~((rewards >= 0) & (rewards <= 1))  # NaN fails both comparisons
    if not bool(bad.view(torch.uint8).amax()):  # uint8 amax: bool.any() is slow on CPU
        return
    first = torch.nonzero(bad)[0]
    index = tuple(int(i) for i in first.tolist())
    value = float(rewards[index].item())
    count = int(bad.sum().item())
    raise ValueError(
        "mode 'process_weighted' requires token_rewards in [0, 1] at every active "
        f"(loss_mask != 0) position; found {value!r} at position {index} "
        f"({count} offending position(s) in total)"
    )


def shape_advantages(
    advantages: Tensor,
    token_rewards: Tensor,
    loss_mask: Tensor,
    *,
    mode: str,
    negative_scale: float = 0.2,
    zero_penalty: float = 0.4,
    zero_eps: float = 1e-6,
) -> Tensor:
    """Fold shifted process rewards ``P`` into normalised outcome advantages ``A``.

    Call this *after* GAE and advantage normalisation, with ``token_rewards``
    already passed through :func:`shift_token_rewards`: shaping only redirects
    the policy gradient, it must not leak into critic returns or be rescaled by
    the normaliser.

    Modes (seed 001, "Advantage Shaping"), applied where ``loss_mask != 0``:

    ``additive``
        ``A + P`` — the weighted process reward is extra signal on top of the
        outcome.
    ``gvpo``
        A negative ``P`` marks a failed token.  There: ``A < -eps`` becomes
        ``A * (1 + negative_scale)`` (punish a bad outcome harder where the
        step was bad); ``|A| <= eps`` becomes ``-zero_penalty`` (no outcome
        signal, so the step penalty provides one); ``A > eps`` becomes ``0``
        (do not reinforce a failed step even in a good trajectory).  Tokens
        with ``P >= 0`` keep ``A``.
    ``process_weighted``
        ``P`` must lie in ``[0, 1]`` at active positions (``ValueError``
        naming the first offending value and its index otherwise).
        ``A >= 0`` becomes ``A * P`` (credit only the good steps);
        ``A < 0`` with ``P > 0`` becomes ``P`` (a good step inside a bad
        trajectory is not punished); ``A < 0`` with ``P == 0`` keeps ``A``.

    Positions where ``loss_mask == 0`` always keep ``A`` unchanged, so padding
    and prompt tokens are never altered.  A NaN advantage stays NaN in every
    mode rather than being masked into a plausible number.

    Args:
        advantages: floating tensor of any shape, e.g. ``[T]`` or ``[B, T]``.
        token_rewards: same shape; cast to ``advantages.dtype``.
        loss_mask: same shape; bool, integer or float (non-zero = active).
        mode: one of :data:`SHAPING_MODES`.
        negative_scale, zero_penalty, zero_eps: ``gvpo`` coefficients; must
            be finite and ``>= 0`` (checked in every mode so that a bad config
            fails on the first batch, whatever the mode).

    Returns:
        A new tensor with ``advantages``' shape, dtype and device.

    Raises:
        ValueError: unknown mode, bad coefficient, mismatched shapes/devices,
            non-floating advantages, or out-of-range ``process_weighted`` rewards.
    """
    if mode not in SHAPING_MODES:
        raise ValueError(f"unknown shaping mode {mode!r}; expected one of {SHAPING_MODES}")
    negative_scale = _check_coefficient("negative_scale", negative_scale)
    zero_penalty = _check_coefficient("zero_penalty", zero_penalty)
    zero_eps = _check_coefficient("zero_eps", zero_eps)
    _check_tensors(advantages, token_rewards, loss_mask)

    a = advantages
    p = token_rewards.to(dtype=a.dtype)
    active = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0

    if mode == "additive":
        return torch.where(active, a + p, a)

    if mode == "gvpo":
        failed = (p < 0) & active
        # Value for failed tokens: A<-eps -> A*(1+s); A>eps -> 0 (clamp); |A|<=eps -> -penalty.
        # clamp propagates NaN, so a NaN advantage stays NaN.
        failed_value = a.clamp(max=0).mul_(1.0 + negative_scale)
        failed_value = torch.where(a.abs() <= zero_eps, -zero_penalty, failed_value)
        return torch.where(failed, failed_value, a)

    # process_weighted
    _check_process_weights(p, active)
    negative = a < 0
    take_reward = (p > 0) & negative & active  # A<0, P>0 -> P
    keep_advantage = negative | ~active  # A<0, P==0 -> A ; inactive -> A
    out = torch.where(keep_advantage, a, a * p)  # A>=0 -> A*P (NaN A lands here, stays NaN)
    return torch.where(take_reward, p, out, out=out)


# --------------------------------------------------------------------------- #
# GRPO outcome advantages
# --------------------------------------------------------------------------- #
def _group_index(group_ids: Sequence[str] | Tensor, n: int, device: torch.device) -> tuple[Tensor, int]:
    """Map arbitrary group ids to dense ``0..K-1`` indices on ``device``."""
    if isinstance(group_ids, Tensor):
        if group_ids.dim() != 1 or group_ids.shape[0] != n:
            raise ValueError(
                f"group_ids must have shape ({n},) to match rewards; got {tuple(group_ids.shape)}"
            )
        uniq, inverse = torch.unique(group_ids.to(device), return_inverse=True)
        return inverse, int(uniq.numel())
    ids = list(group_ids)
    if len(ids) != n:
        raise ValueError(f"group_ids has {len(ids)} entries but rewards has {n}")
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=device), 0
    # Strings cannot live on a device; numpy factorises them without a Python loop.
    uniq_np, inverse_np = np.unique(np.asarray(ids, dtype=object).astype(str), return_inverse=True)
    return torch.as_tensor(inverse_np.reshape(-1), dtype=torch.long, device=device), len(uniq_np)


def grpo_outcome_advantages(
    rewards: Tensor,
    group_ids: Sequence[str] | Tensor,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO outcome advantages: ``(r - mean_g) / (std_g + eps)`` per group ``g``.

    The standard deviation is the *population* one (``unbiased=False``,
    divide by ``n``): the group is the whole set of samples drawn for a prompt,
    not a sample of a larger population, and it keeps groups of two finite.
    A group of one has no baseline and gets advantage ``0``; a group whose
    rewards are all equal gets ``0`` as well (numerator 0, ``eps > 0``).

    Only *outcome* rewards are normalised here.  Process token rewards are
    never group-normalised (seed 001, "v2 Export"): they enter later through
    :func:`shape_advantages`.

    Args:
        rewards: ``[N]`` outcome rewards, one per sample (integer rewards are
            promoted to float32).  NaN propagates to its own group only.
        group_ids: ``N`` group labels — a sequence of strings (compared as
            ``str``, factorised on the host by numpy) or a 1-D tensor
            (factorised on its device by ``torch.unique``).
        eps: added to the std; must be finite and ``> 0``.

    Returns:
        ``[N]`` advantages on ``rewards``' device.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N]; got shape {tuple(rewards.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be finite and > 0, got {eps!r}")
    r = rewards if rewards.is_floating_point() else rewards.to(torch.float32)
    n = r.shape[0]
    index, k = _group_index(group_ids, n, r.device)
    if n == 0:
        return r.clone()

    counts = torch.zeros(k, dtype=r.dtype, device=r.device).index_add_(0, index, torch.ones_like(r))
    sums = torch.zeros(k, dtype=r.dtype, device=r.device).index_add_(0, index, r)
    mean = sums / counts
    dev = r - mean[index]
    var = torch.zeros(k, dtype=r.dtype, device=r.device).index_add_(0, index, dev * dev) / counts
    adv = dev / (var.sqrt()[index] + eps)
    return torch.where(counts[index] > 1, adv, torch.zeros_like(adv))
