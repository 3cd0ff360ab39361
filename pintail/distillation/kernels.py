"""The distillation Triton kernel: a row's divergence between the teacher's and the student's
distributions over the vocabulary, and its gradient over the student's logits."""

import triton
import triton.language as tl

from .._core.launch import aligned
from .._loss.rows import LN2, LOG2E


@triton.jit
def _fold(z, running_max, running_sum):
    new_max = tl.maximum(running_max, tl.max(z, axis=0))
    shift = tl.where(new_max == -float("inf"), 0.0, new_max)
    running_sum = running_sum * tl.exp2((running_max - shift) * LOG2E) + tl.sum(tl.exp2((z - shift) * LOG2E), axis=0)
    return new_max, running_sum


@triton.jit
def _log_probs(s_row, t_row, cols, mask, inv_temperature, s_lse, t_lse):
    """The student's and the teacher's log-probabilities at classes `cols` (-inf past V)."""
    z_s = tl.load(s_row + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_temperature
    z_t = tl.load(t_row + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_temperature
    return z_s - s_lse, z_t - t_lse


@triton.jit
def _log_mixture(lp_s, lp_t, log_beta, log_rest):
    """log(beta p_t + (1 - beta) p_s) from the log-probabilities, without underflow."""
    a = lp_t + log_beta
    b = lp_s + log_rest
    high = tl.maximum(a, b)
    low = tl.minimum(a, b)
    mixed = high + tl.log2(1.0 + tl.exp2((low - high) * LOG2E)) * LN2
    return tl.where(high == -float("inf"), -float("inf"), mixed)


@triton.jit
def _term(p, log_ratio):
    """p log_ratio, 0 where p is 0 (also where the ratio is infinite)."""
    return tl.where(p > 0.0, p * log_ratio, 0.0)


@triton.jit
def _distillation_kernel(s_ptr, s_row_stride, t_ptr, t_row_stride, target_ptr, loss_ptr, grad_ptr, V, ignore_index,
                         inv_temperature, beta, log_beta, log_rest, HAS_TARGET: tl.constexpr, MODE: tl.constexpr,
                         GRADIENT: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    # One row, three passes over its V classes (both logits rows):
    # 1. the max and sum of exp of z_s = s / T and z_t = t / T (each row's log-sum-exp);
    # 2. the loss: MODE 0 KL(p_t || p_s), MODE 1 KL(p_s || p_t), MODE 2 beta KL(p_t || m) +
    #    (1 - beta) KL(p_s || m), m = beta p_t + (1 - beta) p_s; and sum p_s a (a = dloss/dp_s);
    # 3. with GRADIENT, dloss/ds_k = p_s,k (a_k - sum p_s a) / T times grad[row], written over
    #    the student's logits (MODE 0: (p_s,k - p_t,k) / T).
    V, s_row_stride, t_row_stride = aligned(V, ALIGN), aligned(s_row_stride, ALIGN), aligned(t_row_stride, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * s_row_stride
    t_row = t_ptr + row * t_row_stride
    s_max, s_sum, t_max, t_sum = -float("inf"), 0.0, -float("inf"), 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        s_max, s_sum = _fold(tl.load(s_row + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_temperature,
                             s_max, s_sum)
        t_max, t_sum = _fold(tl.load(t_row + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_temperature,
                             t_max, t_sum)
    s_lse = s_max + tl.log2(s_sum) * LN2
    t_lse = t_max + tl.log2(t_sum) * LN2
    loss = 0.0
    student = 0.0  # sum p_s a, a = dloss/dp_s (MODE 1: the loss itself; MODE 0: not needed)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        lp_s, lp_t = _log_probs(s_row, t_row, cols, mask, inv_temperature, s_lse, t_lse)
        p_s = tl.exp2(lp_s * LOG2E)
        p_t = tl.exp2(lp_t * LOG2E)
        if MODE == 0:
            loss += tl.sum(_term(p_t, lp_t - lp_s), axis=0)
        elif MODE == 1:
            loss += tl.sum(_term(p_s, lp_s - lp_t), axis=0)
        else:
            lm = _log_mixture(lp_s, lp_t, log_beta, log_rest)
            from_student = tl.sum(_term(p_s, lp_s - lm), axis=0)
            loss += beta * tl.sum(_term(p_t, lp_t - lm), axis=0) + (1.0 - beta) * from_student
            student += (1.0 - beta) * from_student
    if MODE == 1:
        student = loss
    kept = True
    if HAS_TARGET:
        kept = tl.load(target_ptr + row) != ignore_index
    tl.store(loss_ptr + row, tl.where(kept, loss, 0.0))
    if GRADIENT:
        g = tl.where(kept, tl.load(grad_ptr + row), 0.0) * inv_temperature
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            lp_s, lp_t = _log_probs(s_row, t_row, cols, mask, inv_temperature, s_lse, t_lse)
            p_s = tl.exp2(lp_s * LOG2E)
            if MODE == 0:
                d = p_s - tl.exp2(lp_t * LOG2E)
            elif MODE == 1:
                d = _term(p_s, lp_s - lp_t) - p_s * student
            else:
                d = (1.0 - beta) * _term(p_s, lp_s - _log_mixture(lp_s, lp_t, log_beta, log_rest)) - p_s * student
            tl.store(s_row + cols, (d * g).to(s_ptr.dtype.element_ty), mask=mask)
