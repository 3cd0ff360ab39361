"""The gated activation kernels: out = act(gate) * up forward, and both gradients in one pass."""

import triton
import triton.language as tl

from .._core.launch import aligned

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)
GELU_CUBIC: tl.constexpr = tl.constexpr(0.044715)
SQRT_HALF: tl.constexpr = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI: tl.constexpr = tl.constexpr(0.3989422804014327)

# ACTIVATION codes
SILU, GELU_TANH, GELU_ERF = 0, 1, 2


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    """(act(g), act'(g)) in float32: SiLU, GELU with the tanh approximation, or GELU (erf)."""
    if ACTIVATION == 0:
        s = 1.0 / (1.0 + tl.exp2(-g * LOG2E))  # sigmoid; exp2 of +inf gives s = 0, not NaN
        return g * s, s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == 1:
        inner = SQRT_2_OVER_PI * (g + GELU_CUBIC * g * g * g)
        t = 1.0 - 2.0 / (tl.exp2(2.0 * LOG2E * inner) + 1.0)  # tanh(inner), from exp2
        return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * SQRT_2_OVER_PI * (
            1.0 + 3.0 * GELU_CUBIC * g * g)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(g * SQRT_HALF))
        return g * cdf, cdf + g * INV_SQRT_2PI * tl.exp2(-0.5 * LOG2E * g * g)


@triton.jit
def _gated_forward_kernel(out_ptr, gate_ptr, up_ptr, N, gate_row_stride, up_row_stride, out_row_stride,
                          ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    # One block of one row: read gate and up once, write act(gate) * up once.
    N, gate_row_stride = aligned(N, ALIGN), aligned(gate_row_stride, ALIGN)
    up_row_stride, out_row_stride = aligned(up_row_stride, ALIGN), aligned(out_row_stride, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _activation(g, ACTIVATION)
    tl.store(out_ptr + row * out_row_stride + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_backward_kernel(dgate_ptr, dup_ptr, dy_ptr, gate_ptr, up_ptr, N, dgate_row_stride, dup_row_stride,
                           dy_row_stride, gate_row_stride, up_row_stride, ACTIVATION: tl.constexpr,
                           BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    # One block of one row: read dy, gate and up, recompute the activation, write
    # dgate = dy * up * act'(gate) and dup = dy * act(gate).
    N, dgate_row_stride, dup_row_stride = aligned(N, ALIGN), aligned(dgate_row_stride, ALIGN), \
        aligned(dup_row_stride, ALIGN)
    dy_row_stride, gate_row_stride = aligned(dy_row_stride, ALIGN), aligned(gate_row_stride, ALIGN)
    up_row_stride = aligned(up_row_stride, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _activation(g, ACTIVATION)
    tl.store(dgate_ptr + row * dgate_row_stride + cols, (dy * u * da).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + row * dup_row_stride + cols, (dy * a).to(dup_ptr.dtype.element_ty), mask=mask)
