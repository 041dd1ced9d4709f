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
   normalised advantages with one of :data:`SHAPING_MODES` (the registry in
   :mod:`infra.modes`; :func:`apply_shaping` takes a checked config struct instead).

Every function here is pure (inputs are never mutated), fully vectorised and
runs on whatever device its input tensors live on: no Python loops over rows or
tokens, and no host synchronisation except where an error must be raised.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch
from torch import Tensor

from infra.config import PRMAdvantageShapingConfig
from infra.modes import COEFFICIENT_DEFAULTS, SHAPING_MODES, Mode, check_coefficient, shaping_mode
from shaper.errors import ShapingInputError

__all__ = [
    "SHAPING_MODES",
    "additive_kernel",
    "apply_shaping",
    "gvpo_kernel",
    "grpo_outcome_advantages",
    "process_weighted_kernel",
    "shape_advantages",
    "shift_token_rewards",
]

log = logging.getLogger(__name__)


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
        raise ShapingInputError("token_rewards must have at least one dimension (…, T); got a 0-d tensor")
    out = torch.zeros_like(token_rewards)
    if token_rewards.shape[-1] > 1:
        out[..., :-1] = token_rewards[..., 1:]
    return out


# --------------------------------------------------------------------------- #
# Shaping kernels: one elementwise pass per mode
# --------------------------------------------------------------------------- #
# Each mode is written once, as a pure elementwise expression over (A, P, mask), and
# registered with its coefficients in infra.modes (which refers to these kernels by
# name). Large inputs run it through torch.compile, which fuses the whole expression
# (including process_weighted's range check, a reduction over the same elements)
# into one loop that reads each input once and writes the output once; eager
# PyTorch would make a pass (and a temporary) per operator. Small inputs, and any
# platform where compilation fails, run the very same expression eagerly: the
# results are identical (tests/unit/test_shaping.py compares both paths).
def _active(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def additive_kernel(a: Tensor, p: Tensor, mask: Tensor) -> Tensor:
    """``additive``: ``A + P`` on active positions."""
    return torch.where(_active(mask), a + p, a)


def gvpo_kernel(
    a: Tensor, p: Tensor, mask: Tensor, *, negative_scale: float, zero_penalty: float, zero_eps: float
) -> Tensor:
    """``gvpo``: failed tokens (``P < 0``) reshape ``A``."""
    failed = (p < 0) & _active(mask)
    # Failed tokens: A < -eps -> A*(1+s); A > eps -> 0 (clamp); |A| <= eps -> -penalty.
    # clamp propagates NaN, so a NaN advantage stays NaN.
    failed_value = torch.where(a.abs() <= zero_eps, -zero_penalty, a.clamp(max=0) * (1.0 + negative_scale))
    return torch.where(failed, failed_value, a)


def process_weighted_kernel(a: Tensor, p: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``process_weighted``: ``P`` in ``[0, 1]`` weights ``A``; also whether some active ``P`` is outside."""
    active = _active(mask)
    # AReaL's rule: A >= 0 -> A*P; otherwise (A < 0, or NaN) P > 0 -> P, else A.
    shaped = torch.where(a >= 0, a * p, torch.where(p > 0, p, a))
    bad = active & ~((p >= 0) & (p <= 1))  # NaN fails both comparisons
    return torch.where(active, shaped, a), bad.any()


_COMPILE_MIN_NUMEL = 1 << 16  # below this, compilation overhead is never repaid
_COMPILED: dict[tuple[Callable[..., object], tuple[tuple[str, float], ...]], Callable[..., object]] = {}
_COMPILE_BROKEN: set[str] = set()  # device types where compilation failed once


def _compile_enabled() -> bool:
    return os.environ.get("PRM_SHAPING_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


def _run_kernel(
    mode: Mode, device_type: str, numel: int, tensors: tuple[Tensor, ...], coefficients: tuple[float, ...]
) -> object:
    """Run ``mode``'s expression: compiled when worth it and possible, else eager.

    Coefficients are baked into the compiled kernel as constants (one compilation
    per configured set, i.e. per training run), not passed as symbolic scalars.
    """
    kernel = mode.resolve()
    bound = tuple(zip(mode.coefficients, coefficients))
    if numel < _COMPILE_MIN_NUMEL or device_type in _COMPILE_BROKEN or not _compile_enabled():
        return kernel(*tensors, **dict(bound))
    fn = _COMPILED.get((kernel, bound))
    if fn is None:
        fn = _COMPILED[(kernel, bound)] = torch.compile(functools.partial(kernel, **dict(bound)), dynamic=True)
    try:
        return fn(*tensors)
    except Exception as exc:  # noqa: BLE001 - no compiler/triton: the eager path is exact
        _COMPILE_BROKEN.add(device_type)
        log.warning("shape_advantages: torch.compile failed on %s (%s); using eager kernels", device_type, exc)
        return kernel(*tensors, **dict(bound))


# --------------------------------------------------------------------------- #
# Shaping
# --------------------------------------------------------------------------- #
def _check_tensors(advantages: Tensor, token_rewards: Tensor, loss_mask: Tensor) -> None:
    shapes = (tuple(advantages.shape), tuple(token_rewards.shape), tuple(loss_mask.shape))
    if not (shapes[0] == shapes[1] == shapes[2]):
        raise ShapingInputError(
            "advantages, token_rewards and loss_mask must have the same shape; got "
            f"advantages={shapes[0]}, token_rewards={shapes[1]}, loss_mask={shapes[2]}"
        )
    devices = (advantages.device, token_rewards.device, loss_mask.device)
    if not (devices[0] == devices[1] == devices[2]):
        raise ShapingInputError(
            "advantages, token_rewards and loss_mask must be on the same device; got "
            f"advantages={devices[0]}, token_rewards={devices[1]}, loss_mask={devices[2]}"
        )
    if not advantages.is_floating_point():
        raise ShapingInputError(f"advantages must be a floating-point tensor, got dtype {advantages.dtype}")


def _range_error(mode: str, rewards: Tensor, mask: Tensor) -> RuntimeError:
    """A unit-interval mode multiplies advantages by P, so P must be a weight in [0, 1].

    AReaL asserts it (a ``RuntimeError``); we raise the same type, naming the first
    offending value and its position. Only reached when the fused kernel's check
    failed, so the normal path pays no extra pass and one host synchronisation.
    """
    bad = _active(mask) & ~((rewards >= 0) & (rewards <= 1))
    first = torch.nonzero(bad)[0]
    index = tuple(int(i) for i in first.tolist())
    value = float(rewards[index].item())
    count = int(bad.sum().item())
    return RuntimeError(
        f"mode {mode!r} requires process rewards in [0, 1] at every active "
        f"(loss_mask != 0) position; found {value!r} at position {index} "
        f"({count} offending position(s) in total)"
    )


def apply_shaping(
    advantages: Tensor, token_rewards: Tensor, loss_mask: Tensor, shaping: PRMAdvantageShapingConfig
) -> Tensor:
    """:func:`shape_advantages` with the mode and coefficients of a config struct.

    The struct was checked when it was built (registered mode, coefficients finite and
    ``>= 0``), so nothing about the mode is checked again here: this is the per-batch
    entry of the trainer and the verl adapter.
    """
    mode = shaping_mode(shaping.mode)  # a lookup, never a default: the struct holds a registered name
    return _shape(advantages, token_rewards, loss_mask, mode, tuple(getattr(shaping, n) for n in mode.coefficients))


def _shape(
    advantages: Tensor, token_rewards: Tensor, loss_mask: Tensor, mode: Mode, coefficients: tuple[float, ...]
) -> Tensor:
    _check_tensors(advantages, token_rewards, loss_mask)
    dtype = torch.promote_types(advantages.dtype, torch.float32)
    a = advantages.to(dtype)
    p = token_rewards.to(dtype)
    result = _run_kernel(mode, a.device.type, a.numel(), (a, p, loss_mask), coefficients)
    if mode.unit_interval:
        out, bad = cast("tuple[Tensor, Tensor]", result)
        if bool(bad):
            raise _range_error(mode.name, p, loss_mask)
    else:
        out = cast(Tensor, result)
    if mode.result_dtype == "advantages":
        out = out.to(advantages.dtype)
    return out


def shape_advantages(
    advantages: Tensor,
    token_rewards: Tensor,
    loss_mask: Tensor,
    *,
    mode: str,
    negative_scale: float = COEFFICIENT_DEFAULTS["negative_scale"],
    zero_penalty: float = COEFFICIENT_DEFAULTS["zero_penalty"],
    zero_eps: float = COEFFICIENT_DEFAULTS["zero_eps"],
) -> Tensor:
    """Fold shifted process rewards ``P`` into normalised outcome advantages ``A``.

    Call this *after* GAE and advantage normalisation, with ``token_rewards``
    already passed through :func:`shift_token_rewards`: shaping only redirects
    the policy gradient, it must not leak into critic returns or be rescaled by
    the normaliser.

    Modes (AReaL's Process Rewards, "Advantage Shaping"; the registry in
    :mod:`infra.modes` may hold more), applied where ``loss_mask != 0``:

    ``additive``
        ``A + P`` — the weighted process reward is extra signal on top of the
        outcome.
    ``gvpo``
        A negative ``P`` marks a failed token.  There: ``A < -eps`` becomes
        ``A * (1 + negative_scale)`` (punish a bad outcome harder where the
        step was bad); ``|A| <= eps`` becomes ``-zero_penalty`` (no outcome
        signal, so the step penalty provides one); ``A > eps`` becomes ``0``
        (do not reinforce a failed step even in a good trajectory).  Tokens
        with ``P >= 0`` (or NaN) keep ``A``.
    ``process_weighted``
        ``P`` must lie in ``[0, 1]`` at active positions (``RuntimeError``, as
        AReaL's assertion, naming the first offending value and its index).
        ``A >= 0`` becomes ``A * P`` (credit only the good steps);
        ``A < 0`` with ``P > 0`` becomes ``P`` (a good step inside a bad
        trajectory is not punished); ``A < 0`` with ``P == 0`` keeps ``A``.
        A NaN ``A`` is treated like a negative one, as in AReaL: ``P`` when
        ``P > 0``, else it stays NaN.

    Positions where ``loss_mask == 0`` always keep ``A`` unchanged, so padding
    and prompt tokens are never altered (even by a non-finite ``P`` there).
    Otherwise a NaN advantage stays NaN.

    Precision: the computation runs in ``promote_types(advantages.dtype,
    float32)``, as AReaL casts token rewards to its float32 reward dtype before
    using them. The result has the dtype AReaL's expression gives: float32 for
    fp16/bf16 advantages in ``additive`` and ``process_weighted`` (the float32
    rewards enter the result), the advantages' own dtype in ``gvpo`` (rewards only
    select); float64 stays float64.

    Args:
        advantages: floating tensor of any shape, e.g. ``[T]`` or ``[B, T]``.
        token_rewards: same shape; cast to the computation dtype.
        loss_mask: same shape; bool, integer or float (non-zero = active).
        mode: one of :data:`SHAPING_MODES`.
        negative_scale, zero_penalty, zero_eps: ``gvpo`` coefficients; must
            be finite and ``>= 0`` (checked in every mode, as AReaL's config does).

    Returns:
        A new tensor with ``advantages``' shape and device.

    Raises:
        ValueError: unknown mode, bad coefficient, mismatched shapes/devices,
            non-floating advantages.
        RuntimeError: ``process_weighted`` rewards outside ``[0, 1]`` (or NaN)
            at an active position.
    """
    info = shaping_mode(mode)
    values = {
        name: check_coefficient(name, value)
        for name, value in (("negative_scale", negative_scale), ("zero_penalty", zero_penalty), ("zero_eps", zero_eps))
    }
    return _shape(advantages, token_rewards, loss_mask, info, tuple(values[name] for name in info.coefficients))


# --------------------------------------------------------------------------- #
# GRPO outcome advantages
# --------------------------------------------------------------------------- #
def _group_index(group_ids: Sequence[str] | Tensor, n: int, device: torch.device) -> tuple[Tensor, int]:
    """Map arbitrary group ids to dense ``0..K-1`` indices on ``device``."""
    if isinstance(group_ids, Tensor):
        if group_ids.dim() != 1 or group_ids.shape[0] != n:
            raise ShapingInputError(f"group_ids must have shape ({n},) to match rewards; got {tuple(group_ids.shape)}")
        uniq, inverse = torch.unique(group_ids.to(device), return_inverse=True)
        return inverse, int(uniq.numel())
    ids = list(group_ids)
    if len(ids) != n:
        raise ShapingInputError(f"group_ids has {len(ids)} entries but rewards has {n}")
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
    never group-normalised (AReaL's Process Rewards, "v2 Export"): they enter later through
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
        raise ShapingInputError(f"rewards must be 1-D [N]; got shape {tuple(rewards.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ShapingInputError(f"eps must be finite and > 0, got {eps!r}")
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
