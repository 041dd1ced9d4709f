"""Exact-value tests for shaper.shaping (AReaL's Process Rewards, "Advantage Shaping")."""

from __future__ import annotations

import math

import pytest
import torch

import shaper
from shaper import SHAPING_MODES, grpo_outcome_advantages, shape_advantages, shift_token_rewards

EPS = 1e-6


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def assert_exact(actual: torch.Tensor, expected: list) -> None:
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-7)


# --------------------------------------------------------------------------- #
# shift_token_rewards
# --------------------------------------------------------------------------- #
class TestShift:
    def test_1d_moves_left_and_zeroes_last(self) -> None:
        rewards = t(0.0, 0.0, 1.0, 2.0, 3.0)
        assert_exact(shift_token_rewards(rewards), [0.0, 1.0, 2.0, 3.0, 0.0])

    def test_no_wrap_around(self) -> None:
        rewards = t(9.0, 1.0, 2.0)
        out = shift_token_rewards(rewards)
        assert out[-1].item() == 0.0  # a roll would put 9.0 here

    def test_2d_shifts_each_row(self) -> None:
        rewards = torch.tensor([[0.0, 1.0, 2.0], [0.0, -1.0, 5.0]])
        assert_exact(shift_token_rewards(rewards), [[1.0, 2.0, 0.0], [-1.0, 5.0, 0.0]])

    def test_returns_new_tensor_and_keeps_input(self) -> None:
        rewards = t(1.0, 2.0)
        out = shift_token_rewards(rewards)
        assert out.data_ptr() != rewards.data_ptr()
        assert_exact(rewards, [1.0, 2.0])
        assert_exact(out, [2.0, 0.0])

    def test_length_one_and_empty(self) -> None:
        assert_exact(shift_token_rewards(t(4.0)), [0.0])
        assert shift_token_rewards(torch.zeros(2, 0)).shape == (2, 0)

    def test_scalar_rejected(self) -> None:
        with pytest.raises(ValueError, match="at least one dimension"):
            shift_token_rewards(torch.tensor(1.0))


# --------------------------------------------------------------------------- #
# shape_advantages
# --------------------------------------------------------------------------- #
class TestAdditive:
    def test_adds_on_active_positions_only(self) -> None:
        a = t(1.0, -0.5, 2.0, 0.25)
        p = t(0.5, -1.0, 3.0, 1.0)
        mask = torch.tensor([1, 1, 0, 1])
        assert_exact(shape_advantages(a, p, mask, mode="additive"), [1.5, -1.5, 2.0, 1.25])

    def test_batch(self) -> None:
        a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        p = torch.tensor([[0.5, 0.5], [-1.0, -1.0]])
        mask = torch.tensor([[True, False], [False, True]])
        assert_exact(shape_advantages(a, p, mask, mode="additive"), [[1.5, 2.0], [3.0, 3.0]])


class TestGvpo:
    def test_each_branch(self) -> None:
        # columns: A<-eps, |A|<=eps (0), |A|<=eps (tiny), A>eps, P>=0 with A<0, P==0 with A=0
        a = t(-1.0, 0.0, 5e-7, 2.0, -3.0, 0.0)
        p = t(-0.5, -1.0, -0.1, -2.0, 0.5, 0.0)
        mask = torch.ones(6)
        out = shape_advantages(a, p, mask, mode="gvpo")
        assert_exact(out, [-1.2, -0.4, -0.4, 0.0, -3.0, 0.0])

    def test_custom_coefficients(self) -> None:
        a = t(-2.0, 0.05, 0.2)
        p = t(-1.0, -1.0, -1.0)
        out = shape_advantages(a, p, torch.ones(3), mode="gvpo", negative_scale=0.5, zero_penalty=1.0, zero_eps=0.1)
        assert_exact(out, [-3.0, -1.0, 0.0])

    def test_masked_failed_tokens_keep_advantage(self) -> None:
        a = t(-1.0, 0.0, 2.0)
        p = t(-1.0, -1.0, -1.0)
        mask = torch.tensor([False, False, False])
        assert_exact(shape_advantages(a, p, mask, mode="gvpo"), [-1.0, 0.0, 2.0])

    def test_batch(self) -> None:
        a = torch.tensor([[-1.0, 0.0, 1.0], [1.0, -1.0, 0.0]])
        p = torch.tensor([[-1.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
        mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
        out = shape_advantages(a, p, mask, mode="gvpo")
        assert_exact(out, [[-1.2, -0.4, 0.0], [1.0, -1.2, 0.0]])

    def test_nan_advantage_stays_nan(self) -> None:
        out = shape_advantages(t(math.nan), t(-1.0), torch.ones(1), mode="gvpo")
        assert math.isnan(out.item())


class TestProcessWeighted:
    def test_each_branch(self) -> None:
        # A>=0 -> A*P ; A<0,P>0 -> P ; A<0,P==0 -> A ; A==0 -> 0*P
        a = t(2.0, 1.0, -1.0, -2.0, 0.0)
        p = t(0.5, 0.0, 0.25, 0.0, 1.0)
        out = shape_advantages(a, p, torch.ones(5), mode="process_weighted")
        assert_exact(out, [1.0, 0.0, 0.25, -2.0, 0.0])

    def test_masked_positions_keep_advantage_and_skip_bounds(self) -> None:
        a = t(2.0, -1.0, 3.0)
        p = t(0.5, 7.0, -4.0)  # out of range, but masked
        mask = torch.tensor([1, 0, 0])
        assert_exact(shape_advantages(a, p, mask, mode="process_weighted"), [1.0, -1.0, 3.0])

    @pytest.mark.parametrize("bad", [-0.5, 1.5, math.nan, math.inf])
    def test_out_of_range_names_value_and_position(self, bad: float) -> None:
        a = torch.zeros(2, 3)
        p = torch.zeros(2, 3)
        p[1, 2] = bad
        with pytest.raises(RuntimeError, match=r"process rewards in \[0, 1\]") as info:  # AReaL's assert type
            shape_advantages(a, p, torch.ones(2, 3), mode="process_weighted")
        message = str(info.value)
        assert "position (1, 2)" in message
        assert repr(float(bad)) in message

    def test_batch(self) -> None:
        a = torch.tensor([[1.0, -1.0], [-1.0, 4.0]])
        p = torch.tensor([[0.5, 0.5], [0.0, 0.25]])
        out = shape_advantages(a, p, torch.ones(2, 2, dtype=torch.bool), mode="process_weighted")
        assert_exact(out, [[0.5, 0.5], [-1.0, 1.0]])


class TestContract:
    @pytest.mark.parametrize("mode", SHAPING_MODES)
    def test_inputs_not_mutated_and_output_is_new(self, mode: str) -> None:
        a = torch.tensor([[-1.0, 0.0, 1.0], [0.5, -0.5, 2.0]])
        p = (
            torch.tensor([[-1.0, 0.5, 0.0], [1.0, 0.0, 0.5]]).abs()
            if mode == "process_weighted"
            else (torch.tensor([[-1.0, 0.5, 0.0], [1.0, -1.0, 0.5]]))
        )
        mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
        copies = (a.clone(), p.clone(), mask.clone())
        out = shape_advantages(a, p, mask, mode=mode)
        for before, after in zip(copies, (a, p, mask)):
            assert torch.equal(before, after)
        assert out.data_ptr() not in (a.data_ptr(), p.data_ptr())
        assert out.shape == a.shape and out.dtype == a.dtype and out.device == a.device
        assert out[0, 2].item() == a[0, 2].item()  # masked position untouched

    @pytest.mark.parametrize("mode", SHAPING_MODES)
    def test_1d_matches_batched_rows(self, mode: str) -> None:
        a = torch.tensor([[-1.0, 0.0, 1.0], [0.5, -0.5, 2.0]])
        p = torch.tensor([[0.0, 0.5, 1.0], [1.0, 0.0, 0.25]])
        mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
        batched = shape_advantages(a, p, mask, mode=mode)
        for row in range(2):
            assert torch.equal(shape_advantages(a[row], p[row], mask[row], mode=mode), batched[row])

    def test_shape_mismatch_names_shapes(self) -> None:
        with pytest.raises(ValueError, match=r"advantages=\(2, 3\), token_rewards=\(2, 4\), loss_mask=\(2, 3\)"):
            shape_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), mode="additive")

    def test_mask_shape_mismatch(self) -> None:
        with pytest.raises(ValueError, match="same shape"):
            shape_advantages(torch.zeros(3), torch.zeros(3), torch.ones(4), mode="gvpo")

    def test_unknown_mode(self) -> None:
        with pytest.raises(ValueError, match="unknown shaping mode 'multiplicative'"):
            shape_advantages(torch.zeros(1), torch.zeros(1), torch.ones(1), mode="multiplicative")

    @pytest.mark.parametrize("name", ["negative_scale", "zero_penalty", "zero_eps"])
    @pytest.mark.parametrize("value", [-0.1, math.nan, math.inf])
    def test_bad_coefficients(self, name: str, value: float) -> None:
        with pytest.raises(ValueError, match=name):
            shape_advantages(torch.zeros(1), torch.zeros(1), torch.ones(1), mode="gvpo", **{name: value})

    def test_non_float_advantages_rejected(self) -> None:
        with pytest.raises(ValueError, match="floating-point"):
            shape_advantages(torch.zeros(2, dtype=torch.long), torch.zeros(2), torch.ones(2), mode="additive")

    def test_token_rewards_cast_to_advantage_dtype(self) -> None:
        a = torch.tensor([1.0, 2.0], dtype=torch.float64)
        p = torch.tensor([0.5, 0.5], dtype=torch.float32)
        out = shape_advantages(a, p, torch.ones(2), mode="additive")
        assert out.dtype == torch.float64
        assert out.tolist() == [1.5, 2.5]

    def test_device_mismatch(self) -> None:
        meta = torch.zeros(2, device="meta")
        with pytest.raises(ValueError, match="same device"):
            shape_advantages(torch.zeros(2), meta, torch.ones(2), mode="additive")


# --------------------------------------------------------------------------- #
# grpo_outcome_advantages
# --------------------------------------------------------------------------- #
class TestGrpo:
    def test_two_groups_population_std(self) -> None:
        rewards = t(1.0, 0.0, 1.0, 0.0, 3.0, 1.0)
        groups = ["a", "a", "a", "a", "b", "b"]
        # group a: mean 0.5, population std 0.5 -> +-1 ; group b: mean 2, std 1 -> +-1
        out = grpo_outcome_advantages(rewards, groups, eps=EPS)
        scale_a = 0.5 / (0.5 + EPS)
        scale_b = 1.0 / (1.0 + EPS)
        assert_exact(out, [scale_a, -scale_a, scale_a, -scale_a, scale_b, -scale_b])

    def test_uneven_group(self) -> None:
        out = grpo_outcome_advantages(t(0.0, 0.0, 3.0), ["g", "g", "g"])
        std = math.sqrt(2.0)  # mean 1, deviations -1,-1,2 -> var 2
        assert_exact(out, [-1.0 / (std + EPS), -1.0 / (std + EPS), 2.0 / (std + EPS)])

    def test_singleton_and_constant_groups_get_zero(self) -> None:
        out = grpo_outcome_advantages(t(5.0, 1.0, 1.0, 2.0, 0.0), ["solo", "same", "same", "x", "x"])
        scale = 1.0 / (1.0 + EPS)
        assert_exact(out, [0.0, 0.0, 0.0, scale, -scale])

    def test_tensor_group_ids_and_interleaving(self) -> None:
        out = grpo_outcome_advantages(t(1.0, 3.0, 0.0, 1.0), torch.tensor([7, 2, 7, 2]))
        # group 7 = [1, 0]: mean 0.5, std 0.5 ; group 2 = [3, 1]: mean 2, std 1
        assert_exact(out, [0.5 / (0.5 + EPS), 1.0 / (1.0 + EPS), -0.5 / (0.5 + EPS), -1.0 / (1.0 + EPS)])

    def test_input_not_mutated_and_integer_rewards(self) -> None:
        rewards = torch.tensor([1, 0])
        out = grpo_outcome_advantages(rewards, ["g", "g"])
        assert rewards.tolist() == [1, 0]
        assert out.dtype == torch.float32
        assert_exact(out, [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)])

    def test_empty(self) -> None:
        assert grpo_outcome_advantages(torch.zeros(0), []).shape == (0,)

    def test_bad_inputs(self) -> None:
        with pytest.raises(ValueError, match="1-D"):
            grpo_outcome_advantages(torch.zeros(2, 2), ["a", "b"])
        with pytest.raises(ValueError, match="entries"):
            grpo_outcome_advantages(torch.zeros(3), ["a", "b"])
        with pytest.raises(ValueError, match="eps"):
            grpo_outcome_advantages(torch.zeros(2), ["a", "b"], eps=0.0)


def test_package_exports() -> None:
    assert shaper.SHAPING_MODES == ("additive", "gvpo", "process_weighted")
    assert callable(shaper.filters.get_filter)
    assert callable(shaper.merge_stats)


# --------------------------------------------------------------------------- #
# AReaL edge cases
# --------------------------------------------------------------------------- #
class TestAReaLEdgeCases:
    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_half_precision_computed_in_float32(self, dtype: torch.dtype) -> None:
        # AReaL casts token rewards to its float32 reward dtype: A(fp16) + P(fp32) promotes to
        # float32. In fp16, 1000 + 0.1 would round to 1000.0; in float32 it is 1000.1.
        a = torch.tensor([1000.0, -2.0], dtype=dtype)
        p = torch.tensor([0.1, 0.25], dtype=dtype)
        out = shape_advantages(a, p, torch.ones(2), mode="additive")
        assert out.dtype == torch.float32
        expected = a.float() + p.float()
        assert torch.equal(out, expected) and out[0].item() != float(a[0] + p[0])

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_gvpo_returns_the_advantages_dtype(self, dtype: torch.dtype) -> None:
        # AReaL's gvpo only compares P (P < 0), so its result keeps A's dtype; we compute in
        # float32 and cast back: A(1 + s) is rounded once, at the end.
        a = torch.tensor([-3.0, 0.5, 1e-7, -1.0, 2.0], dtype=dtype)
        p = torch.tensor([-1.0, -1.0, -1.0, 0.5, 0.0], dtype=dtype)
        out = shape_advantages(a, p, torch.ones(5), mode="gvpo", negative_scale=0.3)
        assert out.dtype == dtype
        expected = torch.tensor([-3.0 * 1.3, 0.0, -0.4, -1.0, 2.0]).to(dtype)
        assert torch.equal(out, expected)
        assert shape_advantages(a.double(), p, torch.ones(5), mode="gvpo").dtype == torch.float64

    def test_process_weighted_nan_advantage_with_positive_reward_becomes_reward(self) -> None:
        # AReaL: NaN A is not >= 0, so P > 0 -> P, and P == 0 keeps the NaN.
        a = t(math.nan, math.nan, math.nan)
        p = t(0.75, 0.0, 0.5)
        out = shape_advantages(a, p, torch.tensor([1, 1, 0]), mode="process_weighted")
        assert out[0].item() == 0.75 and math.isnan(out[1].item()) and math.isnan(out[2].item())

    def test_process_weighted_range_error_is_runtime_error(self) -> None:
        with pytest.raises(RuntimeError, match=r"process rewards in \[0, 1\]"):
            shape_advantages(t(1.0), t(math.nan), torch.ones(1), mode="process_weighted")


def _special_inputs(n: int, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(n, generator=gen)
    a[::17] = 0.0
    a[1::17] = 1e-6  # exactly eps: the |A| <= eps boundary
    a[2::17] = -1e-6
    a[3::97] = math.nan
    if mode == "process_weighted":
        p = torch.rand(n, generator=gen)
        p[::13] = 0.0
        p[1::13] = 1.0
    else:
        p = torch.randn(n, generator=gen)
        p[::11] = 0.0
        p[5::101] = math.nan
    mask = torch.rand(n, generator=gen) < 0.9
    return a.view(16, -1), p.view(16, -1), mask.view(16, -1)


@pytest.mark.slow  # torch.compile: seconds per mode
@pytest.mark.parametrize("mode", SHAPING_MODES)
def test_fused_kernels_match_eager_exactly(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled one-pass kernels give bit-identical results to the eager expressions
    (NaN in the same places), including the eps boundaries and masked NaN rewards."""
    from shaper import shaping

    a, p, mask = _special_inputs(16 * 4096, mode)
    monkeypatch.setenv("PRM_SHAPING_COMPILE", "0")
    eager = shape_advantages(a, p, mask, mode=mode)
    monkeypatch.setenv("PRM_SHAPING_COMPILE", "1")
    monkeypatch.setattr(shaping, "_COMPILE_BROKEN", set())
    assert a.numel() >= shaping._COMPILE_MIN_NUMEL
    fused = shape_advantages(a, p, mask, mode=mode)
    assert "cpu" not in shaping._COMPILE_BROKEN, "torch.compile fell back to eager"
    assert torch.equal(fused.isnan(), eager.isnan())
    assert torch.equal(torch.nan_to_num(fused), torch.nan_to_num(eager))
