"""The comparison rule rejects wrong answers: corruptions of correct outputs that a bound
relative to the tensor's largest entry let through, and that must fail."""

import pytest
import torch

from helpers import assert_matches, assert_rows_sum_to_one


def _softmax(shape, dtype, log=False):
    x = torch.randn(*shape, dtype=torch.float64) * 2
    truth = torch.log_softmax(x, -1) if log else torch.softmax(x, -1)
    return truth.to(dtype), truth


def _ce_grad(M, V, dtype, weight=None, smoothing=0.0):
    x = torch.randn(M, V, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, V, (M,))
    torch.nn.functional.cross_entropy(x, target, weight, label_smoothing=smoothing).backward()
    return x.grad.to(dtype), x.grad, x.detach(), target


def _rejected(ours, truth):
    with pytest.raises(AssertionError):
        assert_matches(ours, truth)


@pytest.mark.parametrize("shape", [(3, 1000), (3, 32769)])
def test_zeroed_softmax_is_rejected(shape):
    ours, truth = _softmax(shape, torch.bfloat16)
    assert_matches(ours, truth)  # the correct output passes
    wrong = ours.clone()
    wrong[:, : int(0.94 * shape[1])] = 0
    _rejected(wrong, truth)


def test_raised_top_log_probabilities_are_rejected():
    ours, truth = _softmax((4, 1000), torch.bfloat16, log=True)
    assert_matches(ours, truth)
    wrong = ours.clone()
    top = truth.topk(10, dim=-1).indices
    wrong.scatter_(1, top, wrong.gather(1, top) + 0.4)
    _rejected(wrong, truth)


def test_tripled_or_zeroed_cross_entropy_gradients_are_rejected():
    ours, truth, _, _ = _ce_grad(16, 1000, torch.float32)
    assert_matches(ours, truth)
    tripled = ours.clone()
    tripled[torch.rand_like(tripled) < 0.5] *= 3
    _rejected(tripled, truth)
    ours16, _, _, _ = _ce_grad(16, 1000, torch.bfloat16)
    zeroed = ours16.clone()
    zeroed[:, 4:] = 0
    _rejected(zeroed, truth)


def test_one_wrong_chunk_or_tail_is_rejected():
    ours, truth = _softmax((2, 5000), torch.float32)
    chunk = ours.clone()
    chunk[1, 1024:2048] *= 1.001  # one chunk of a row off by 0.1 %
    _rejected(chunk, truth)
    tail = ours.clone()
    tail[:, -7:] = tail[:, -8:-1].clone()  # a tail of 7 read from the wrong place
    _rejected(tail, truth)


def test_dropped_smoothing_term_is_rejected():
    """Label smoothing's gradient without its -(e / V) / M term on every entry."""
    ours, truth, _, _ = _ce_grad(8, 500, torch.float32, smoothing=0.1)
    assert_matches(ours, truth)
    _rejected((truth + 0.1 / 500 / 8).float(), truth)


def test_off_by_one_ulp_everywhere_passes_but_two_percent_does_not():
    ours, truth = _softmax((4, 777), torch.bfloat16)
    nudged = (ours.float() * (1 + 2.0**-9)).to(torch.bfloat16)  # at most one ulp each
    assert_matches(nudged, truth)
    _rejected((ours.float() * 1.02).to(torch.bfloat16), truth)


def test_rows_sum_to_one():
    ours, truth = _softmax((5, 3000), torch.float32)
    assert_rows_sum_to_one(ours)
    with pytest.raises(AssertionError):
        assert_rows_sum_to_one(ours * 1.001)


def test_nan_and_inf_must_match():
    truth = torch.tensor([1.0, float("nan"), float("inf")], dtype=torch.float64)
    assert_matches(truth.float(), truth)
    _rejected(torch.tensor([1.0, 0.0, float("inf")]), truth)
    _rejected(torch.tensor([1.0, float("nan"), 3.0]), truth)
