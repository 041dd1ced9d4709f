"""PRM + OPD combined shaping (shaper.combined) on hand-computed tensors."""

from __future__ import annotations

import math

import pytest
import torch

from shaper.combined import prm_gated_opd, prm_weighted_opd

NAN = float("nan")


def _batch():
    # Row 0: [prompt, t0, t0, user, t1, t1, t2, pad]; turn scores +1, -1, +1.
    # Row 1: [t0, t0(masked), t1, t1, t2, t2, pad, pad]; turn scores +1, +1, 0.
    opd = torch.tensor([[9.0, 0.5, -0.2, 9.0, 0.3, 0.1, 0.7, 9.0], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 9.0, 9.0]])
    scores = torch.tensor([[1.0, -1.0, 1.0], [1.0, 1.0, 0.0]])
    turn_index = torch.tensor([[-1, 0, 0, -1, 1, 1, 2, -1], [0, 0, 1, 1, 2, 2, -1, -1]])
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0], [1, 0, 1, 1, 1, 1, 0, 0]])
    return opd, scores, turn_index, loss_mask


def test_gated_cuts_the_cascade_at_the_first_bad_turn():
    opd, scores, turn_index, loss_mask = _batch()
    out = prm_gated_opd(opd, scores, turn_index, loss_mask)
    expected = torch.tensor(
        [
            [0.0, 0.5, -0.2, 0.0, -1.0, -1.0, 0.0, 0.0],  # t0 good -> OPD; t1 first bad -> -1; t2 cut -> 0
            [0.1, 0.0, 0.3, 0.4, -1.0, -1.0, 0.0, 0.0],
        ]  # neutral 0 counts as bad (seed: score > 0 passes)
    )
    torch.testing.assert_close(out, expected)


def test_gated_penalty_and_turn_mask():
    opd, scores, turn_index, loss_mask = _batch()
    out = prm_gated_opd(opd, scores, turn_index, loss_mask, penalty=-0.5)
    assert out[0, 4].item() == -0.5 and out[1, 5].item() == -0.5
    # Row 1's last turn was never judged (no next state): it neither cuts nor passes OPD.
    turn_mask = torch.tensor([[True, True, True], [True, True, False]])
    out = prm_gated_opd(opd, scores, turn_index, loss_mask, turn_mask=turn_mask)
    torch.testing.assert_close(out[1], torch.tensor([0.1, 0.0, 0.3, 0.4, 0.0, 0.0, 0.0, 0.0]))
    # An unjudged turn before a bad one does not pass OPD and does not stop the later cut.
    turn_mask = torch.tensor([[False, True, True], [True, True, True]])
    out = prm_gated_opd(opd, scores, turn_index, loss_mask, turn_mask=turn_mask)
    torch.testing.assert_close(out[0], torch.tensor([0.0, 0.0, 0.0, 0.0, -1.0, -1.0, 0.0, 0.0]))


def test_gated_all_good_and_first_turn_bad():
    opd = torch.tensor([[0.2, 0.4, -0.6, 0.8]])
    turn_index = torch.tensor([[0, 0, 1, 1]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    torch.testing.assert_close(prm_gated_opd(opd, torch.tensor([[1.0, 0.5]]), turn_index, mask), opd)
    torch.testing.assert_close(
        prm_gated_opd(opd, torch.tensor([[-1.0, 1.0]]), turn_index, mask),
        torch.tensor([[-1.0, -1.0, 0.0, 0.0]]),
    )
    # NaN score counts as not good.
    torch.testing.assert_close(
        prm_gated_opd(opd, torch.tensor([[1.0, NAN]]), turn_index, mask),
        torch.tensor([[0.2, 0.4, -1.0, -1.0]]),
    )


def test_weighted_is_turn_score_times_opd():
    opd, scores, turn_index, loss_mask = _batch()
    out = prm_weighted_opd(opd, scores, turn_index, loss_mask)
    expected = torch.tensor([[0.0, 0.5, -0.2, 0.0, -0.3, -0.1, 0.7, 0.0], [0.1, 0.0, 0.3, 0.4, 0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("fn", [prm_gated_opd, prm_weighted_opd])
def test_pure_dtype_device_and_mask_kinds(fn):
    opd, scores, turn_index, loss_mask = _batch()
    before = [t.clone() for t in (opd, scores, turn_index, loss_mask)]
    out64 = fn(opd.double(), scores, turn_index.int(), loss_mask.bool())
    assert out64.dtype == torch.float64
    for t, b in zip((opd, scores, turn_index, loss_mask), before):
        assert torch.equal(t, b)  # inputs untouched
    out_float_mask = fn(opd, scores, turn_index, loss_mask.float())
    torch.testing.assert_close(out64.float(), out_float_mask)


@pytest.mark.parametrize("fn", [prm_gated_opd, prm_weighted_opd])
def test_no_turns_and_empty(fn):
    opd = torch.tensor([[1.0, 2.0]])
    out = fn(opd, torch.zeros(1, 0), torch.tensor([[-1, -1]]), torch.ones(1, 2))
    assert torch.equal(out, torch.zeros(1, 2))
    empty = fn(torch.zeros(0, 5), torch.zeros(0, 2), torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5))
    assert empty.shape == (0, 5)


@pytest.mark.parametrize("fn", [prm_gated_opd, prm_weighted_opd])
def test_bad_inputs_raise(fn):
    opd, scores, turn_index, loss_mask = _batch()
    with pytest.raises(ValueError, match="turn_index must lie in"):
        fn(opd, scores, torch.where(turn_index == 2, 3, turn_index), loss_mask)
    with pytest.raises(ValueError, match="turn_index must lie in"):
        fn(opd, scores, torch.where(turn_index == -1, -2, turn_index), loss_mask)
    with pytest.raises(ValueError, match="integer"):
        fn(opd, scores, turn_index.float(), loss_mask)
    with pytest.raises(ValueError, match="same"):
        fn(opd, scores, turn_index[:, :4], loss_mask)
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        fn(opd, scores[:1], turn_index, loss_mask)
    with pytest.raises(ValueError, match="floating"):
        fn(opd.long(), scores, turn_index, loss_mask)


def test_gated_rejects_bad_penalty_and_turn_mask():
    opd, scores, turn_index, loss_mask = _batch()
    with pytest.raises(ValueError, match="penalty"):
        prm_gated_opd(opd, scores, turn_index, loss_mask, penalty=math.inf)
    with pytest.raises(ValueError, match="turn_mask"):
        prm_gated_opd(opd, scores, turn_index, loss_mask, turn_mask=torch.ones(2, 2, dtype=torch.bool))
