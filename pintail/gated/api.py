"""swiglu / geglu: argument checks, launch by plan, the torch.library ops and autograd."""

import torch

from .. import reference
from .._core.dtensor import is_dtensor, local_rows
from .._core.launch import KERNEL_DTYPES, as_rows, cdiv, launch, no_second_derivative, row_alignment, runs_kernels
from . import plans
from .kernels import GELU_ERF, GELU_TANH, SILU, _gated_backward_kernel, _gated_forward_kernel

def _halves(x, up):
    """(gate, up) rows (M, N): the two given tensors, or the two halves of x's last dim."""
    if up is None:
        x = as_rows(x, x.dim() - 1)
        N = x.shape[1] // 2
        return x[:, :N], x[:, N:]
    return as_rows(x, x.dim() - 1), as_rows(up, up.dim() - 1)


def _forward(x: torch.Tensor, up: torch.Tensor | None, activation: int) -> torch.Tensor:
    """act(gate) * up as rows (M, N) in x's dtype; gate = x, or x's first half where up is None."""
    gate, up_rows = _halves(x, up)
    M, N = gate.shape
    if not (runs_kernels(gate) and gate.dtype in KERNEL_DTYPES):
        return reference.gated_forward(gate, up_rows, activation)
    out = torch.empty(M, N, dtype=gate.dtype, device=gate.device)
    if M == 0 or N == 0:
        return out
    block = plans.block(N)
    launch(_gated_forward_kernel, (M, cdiv(N, block)), out, gate, up_rows, N, gate.stride(0), up_rows.stride(0),
           out.stride(0), ACTIVATION=activation, BLOCK=block,
           ALIGN=row_alignment(N, gate.stride(0), up_rows.stride(0)), num_warps=plans.NUM_WARPS)
    return out


def _backward(dy: torch.Tensor, x: torch.Tensor, up: torch.Tensor | None, activation: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dup) from dy (M, N): dx of x's rows ((M, 2N), both halves, where up is None, and
    dup empty), else (dgate, dup), each (M, N)."""
    gate, up_rows = _halves(x, up)
    M, N = gate.shape
    fused = up is None
    if not (runs_kernels(gate) and gate.dtype in KERNEL_DTYPES):
        dgate, dup = reference.gated_backward(as_rows(dy, 1), gate, up_rows, activation)
        return (torch.cat([dgate, dup], 1), dup.new_empty(0)) if fused else (dgate, dup)
    if fused:
        dx = torch.empty(M, 2 * N, dtype=gate.dtype, device=gate.device)
        dgate, dup = dx[:, :N], dx[:, N:]
    else:
        dgate, dup = torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty(
            M, N, dtype=gate.dtype, device=gate.device)
    if M and N:
        dy = as_rows(dy, 1)
        block = plans.block(N)
        launch(_gated_backward_kernel, (M, cdiv(N, block)), dgate, dup, dy, gate, up_rows, N, dgate.stride(0),
               dup.stride(0), dy.stride(0), gate.stride(0), up_rows.stride(0), ACTIVATION=activation, BLOCK=block,
               ALIGN=row_alignment(N, dgate.stride(0), dup.stride(0), dy.stride(0), gate.stride(0),
                                   up_rows.stride(0)), num_warps=plans.NUM_WARPS)
    return (dx, dup.new_empty(0)) if fused else (dgate, dup)


# ------------------------------------------------------------- torch.library and autograd
# One path, eager and compiled.

_forward_op = torch.library.custom_op("pintail::gated_forward", _forward, mutates_args=())


@_forward_op.register_fake
def _gated_forward_fake(x, up, activation):
    """(M, N) rows in x's dtype, N = x's last dim (half of it where up is None)."""
    N = x.shape[-1] if up is not None else x.shape[-1] // 2
    return x.new_empty(x.numel() // max(x.shape[-1], 1) if x.shape[-1] else 0, N)


_backward_op = torch.library.custom_op("pintail::gated_backward", _backward, mutates_args=())


@_backward_op.register_fake
def _gated_backward_fake(dy, x, up, activation):
    """dx as x's rows (both halves where up is None, with an empty dup), or dgate and dup."""
    M, N = dy.shape
    if up is None:
        return x.new_empty(M, 2 * N), x.new_empty(0)
    return x.new_empty(M, N), x.new_empty(M, N)


def _setup_context(ctx, inputs, output):
    x, up, activation = inputs
    ctx.save_for_backward(x, up)
    ctx.activation = activation


def _backward_of_op(ctx, dy):
    x, up = ctx.saved_tensors
    dx, dup = _backward_op(dy, x, up, ctx.activation)
    dx = dx.reshape(x.shape)
    grads = (dx, dup.reshape(up.shape) if up is not None else None, None)
    return no_second_derivative(grads, x, up, dy)


_forward_op.register_autograd(_backward_of_op, setup_context=_setup_context)


# ------------------------------------------------------------------------ public API


def _check(name, gate, up):
    if not isinstance(gate, torch.Tensor) or (up is not None and not isinstance(up, torch.Tensor)):
        raise TypeError(f"{name}: gate and up must be tensors")
    if not gate.dtype.is_floating_point or gate.dim() == 0:
        raise ValueError(f"{name}: gate must be a floating point tensor of at least one dim, got {gate.dtype} of "
                         f"shape {tuple(gate.shape)}")
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(f"{name}: a fused gate_up must have an even last dim (gate, then up), got "
                             f"{gate.shape[-1]}")
        return
    if up.shape != gate.shape:
        raise ValueError(f"{name}: up has shape {tuple(up.shape)}, expected gate's {tuple(gate.shape)}")
    if up.dtype != gate.dtype:
        raise TypeError(f"{name}: up has dtype {up.dtype}, expected gate's {gate.dtype}")
    if up.device != gate.device:
        raise ValueError(f"{name}: up is on {up.device}, expected gate's device {gate.device}")


def _gated(name, gate, up, activation):
    if is_dtensor(gate) or is_dtensor(up):  # elementwise: any layout but partial sums (gate and up: the last dim whole)
        return local_rows(name, lambda g, u: _gated(name, g, u, activation), gate, [-1] if up is None else [],
                          [("up", up)])
    _check(name, gate, up)
    shape = gate.shape if up is not None else (*gate.shape[:-1], gate.shape[-1] // 2)
    return _forward_op(gate, up, activation).reshape(shape)


def swiglu(gate, up=None):
    """F.silu(gate) * up in one pass (math in float32, out in gate's dtype); its backward
    saves only gate and up and writes both gradients in one pass. With up None, gate holds
    gate then up along its last dim (a fused projection, as Phi-3's): split without a copy.
    gate and up: any leading shape, views of one projection welcome."""
    return _gated("pintail.swiglu", gate, up, SILU)


def geglu(gate, up=None, approximate="tanh"):
    """F.gelu(gate, approximate=approximate) * up, as swiglu (approximate "tanh", Gemma's,
    or "none")."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"pintail.geglu: approximate must be 'tanh' or 'none', got {approximate!r}")
    return _gated("pintail.geglu", gate, up, GELU_TANH if approximate == "tanh" else GELU_ERF)
