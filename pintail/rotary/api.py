"""rotary: argument checks, launch by plan, autograd and the torch.library ops with their fakes."""

import torch

from .. import reference
from .._core.dtensor import refuse_dtensors
from .._core.launch import KERNEL_DTYPES, cdiv, launch, next_power_of_2, no_second_derivative, runs_kernels, unit_stride
from . import plans
from .kernels import _rotary_kernel


def _bsh_strides(t, seq_dim):
    stride = t.stride()
    return (stride[0], stride[1], stride[2]) if seq_dim == 1 else (stride[0], stride[2], stride[1])


def _launch(pairs_of_tensors, cos, sin, positions, seq_dim, seq_offset, rotary_dim, interleaved, backward):
    """out = rotary(x), or its transpose for the backward, for each (x, out) of one or two
    (q and k, in one launch); x of shape (B, S, H, D) (seq_dim 1) or (B, H, S, D) (seq_dim 2),
    unit feature stride; the tensors share B, S and D."""
    (x, out), *second = pairs_of_tensors
    y, y_out = second[0] if second else (x, out)
    heads = lambda t: t.shape[2] if seq_dim == 1 else t.shape[1]
    B, D, S = x.shape[0], x.shape[3], x.shape[seq_dim]
    if B * S == 0:
        return
    pairs = rotary_dim // 2
    full_table = cos.shape[-1] == rotary_dim
    per_token = cos.dim() == 3
    block_p = next_power_of_2(pairs)
    block_s = max(1, min(next_power_of_2(S), plans.TILE_FEATURES // (2 * block_p)))
    rest = D - rotary_dim
    launch(
        _rotary_kernel, (B * cdiv(S, block_s),),
        x, out, y, y_out, cos, sin, positions if positions is not None else cos, S, heads(x),
        heads(y) if second else 0, D, seq_offset, cos.shape[-2],
        *_bsh_strides(x, seq_dim), *_bsh_strides(out, seq_dim), *_bsh_strides(y, seq_dim),
        *_bsh_strides(y_out, seq_dim),
        cos.stride(0) if per_token and cos.shape[0] > 1 else 0, cos.stride(-2),
        positions.stride(0) if positions is not None else 0, positions.stride(1) if positions is not None else 0,
        PAIRS=pairs, INTERLEAVED=interleaved,
        TABLE_STEP=2 if (interleaved and full_table) else 1,
        TABLE_SECOND=(1 if interleaved else pairs) if full_table else 0,
        HAS_POS=positions is not None, BACKWARD=backward, COPY_REST=rest > 0 and out.data_ptr() != x.data_ptr(),
        BLOCK_H=plans.HEADS_PER_STEP, BLOCK_S=block_s, BLOCK_P=block_p, BLOCK_REST=next_power_of_2(max(rest, 1)),
        num_warps=plans.NUM_WARPS)


# --------------------------------------------------------------- tensor-level functions


def _rotate(x: torch.Tensor, y: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor | None, seq_dim: int, seq_offset: int, rotary_dim: int, interleaved: bool,
            backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation of x and of y (q and k; y may be None: then an empty second output), or
    its transpose, into new tensors of their layouts; one launch for both."""
    tensors = [unit_stride(t) for t in (x, y) if t is not None]
    outs = [torch.empty_like(t) for t in tensors]  # the fake's rule, on both paths
    if not (runs_kernels(x) and all(t.dtype in KERNEL_DTYPES for t in tensors) and cos.dtype in KERNEL_DTYPES):
        for t, out in zip(tensors, outs):
            out.copy_(reference.rotary(t, cos, sin, positions, seq_dim, seq_offset, rotary_dim, interleaved, backward))
    else:
        _launch(list(zip(tensors, outs)), cos, sin, positions, seq_dim, seq_offset, rotary_dim, interleaved, backward)
    return outs[0], (outs[1] if y is not None else x.new_empty(0))


def _rotate_in_place(tensors, cos, sin, positions, seq_dim, seq_offset, rotary_dim, interleaved):
    if not (runs_kernels(tensors[0]) and all(t.dtype in KERNEL_DTYPES for t in tensors)
            and cos.dtype in KERNEL_DTYPES):
        for t in tensors:
            t.copy_(reference.rotary(t, cos, sin, positions, seq_dim, seq_offset, rotary_dim, interleaved, False))
    else:
        _launch([(t, t) for t in tensors], cos, sin, positions, seq_dim, seq_offset, rotary_dim, interleaved, False)


# ------------------------------------------------------------- autograd and torch.library
# Eager calls take a plain autograd.Function (host time, as for softmax); torch.compile
# reaches the same function as a custom op, out of place. q and k go through one node and
# one launch.


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, cos, sin, positions, seq_dim, seq_offset, rotary_dim, interleaved):
        geometry = (seq_dim, seq_offset, rotary_dim, interleaved)
        x_out, y_out = _rotate(x, y, cos, sin, positions, *geometry, backward=False)
        ctx.save_for_backward(cos, sin, positions)
        ctx.geometry = geometry
        ctx.set_materialize_grads(False)
        return x_out, (y_out if y is not None else None)

    @staticmethod
    def backward(ctx, dx, dy):
        cos, sin, positions = ctx.saved_tensors
        if dx is None and dy is None:
            return (None,) * 9
        first, second = (dx, dy) if dx is not None else (dy, None)
        out_first, out_second = _rotate(first, second, cos, sin, positions, *ctx.geometry, backward=True)
        grads = (out_first, out_second if second is not None else None) if dx is not None else (None, out_first)
        return no_second_derivative((*grads, None, None, None, None, None, None, None), dx, dy)


class _RotaryInPlace(torch.autograd.Function):
    """inplace=True with autograd: one tensor rotated in its own storage. autograd lets a
    Function modify a view in place (q and k sliced out of a fused projection, or a packed
    batch seen with a leading dim) only if that tensor is its one output, so q and k take a
    node and a launch each here."""

    @staticmethod
    def forward(ctx, x, cos, sin, positions, seq_dim, seq_offset, rotary_dim, interleaved):
        ctx.geometry = (seq_dim, seq_offset, rotary_dim, interleaved)
        _rotate_in_place([x], cos, sin, positions, *ctx.geometry)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin, positions)
        return x

    @staticmethod
    def backward(ctx, dx):
        cos, sin, positions = ctx.saved_tensors
        dx_in, _ = _rotate(dx, None, cos, sin, positions, *ctx.geometry, backward=True)
        return no_second_derivative((dx_in, None, None, None, None, None, None, None), dx)


_rotary_op = torch.library.custom_op("pintail::rotary", _rotate, mutates_args=())


@_rotary_op.register_fake
def _rotary_fake(x, y, cos, sin, positions, seq_dim, seq_offset, rotary_dim, interleaved, backward):
    """Each output as torch.empty_like of its input with a unit last stride (x and y keep
    their layouts: bshd, bhsd, or a transposed view's dense strides)."""
    return torch.empty_like(unit_stride(x)), (torch.empty_like(unit_stride(y)) if y is not None else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    _, y, cos, sin, positions, *geometry = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.geometry = tuple(geometry[:-1])
    ctx.has_second = y is not None


def _backward_of_op(ctx, dx, dy):
    cos, sin, positions = ctx.saved_tensors
    dx_in, dy_in = _rotary_op(dx, dy if ctx.has_second else None, cos, sin, positions, *ctx.geometry, True)
    return (dx_in, dy_in if ctx.has_second else None, None, None, None, None, None, None, None, None)


_rotary_op.register_autograd(_backward_of_op, setup_context=_setup_context)


# ------------------------------------------------------------------------ public API


def _positions_from(cu_seqlens, total, seq_offset):
    """Position of each packed token inside its own sequence (no host synchronisation)."""
    starts = cu_seqlens[:-1]
    lengths = cu_seqlens[1:] - starts
    first = torch.repeat_interleave(starts, lengths, output_size=total)
    return (torch.arange(total, device=cu_seqlens.device) - first + seq_offset)[None, :]


def _check(name, tensors, cos, sin, layout, rotary_dim, position_ids, cu_seqlens, seq_offset):
    """Validate; returns (seq_dim, rotary_dim)."""
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"{name}: layout must be 'bshd' or 'bhsd', got {layout!r}")
    if cu_seqlens is not None and layout != "bshd":
        raise ValueError(f"{name}: packed sequences (cu_seqlens) are (total_tokens, heads, head_dim): layout 'bshd'")
    ndim = 3 if cu_seqlens is not None else 4
    for label, t in tensors:
        if not isinstance(t, torch.Tensor) or t.dim() != ndim or not t.dtype.is_floating_point:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {label} must be a floating point tensor of {ndim} dims "
                             f"({'total_tokens, heads, head_dim' if ndim == 3 else layout}), got {got}")
        if t.device != cos.device or t.device != sin.device:
            raise ValueError(f"{name}: {label} is on {t.device}, cos on {cos.device}, sin on {sin.device}: "
                             "expected one device")
    seq_dim = 1 if layout == "bshd" else 2
    (first_label, first), *others = tensors
    head_dim = first.shape[-1]
    for label, t in others:
        if t.shape[-1] != head_dim:
            raise ValueError(f"{name}: {label} has head_dim {t.shape[-1]}, {first_label} has {head_dim}: "
                             "expected the same")
        if t.shape[0] != first.shape[0] or (ndim == 4 and t.shape[seq_dim] != first.shape[seq_dim]):
            raise ValueError(f"{name}: {label} and {first_label} differ in batch or sequence length: "
                             f"{tuple(t.shape)} and {tuple(first.shape)}")
    if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor) or cos.shape != sin.shape \
            or cos.dim() not in (2, 3) or not cos.dtype.is_floating_point or cos.dtype != sin.dtype:
        raise ValueError(f"{name}: cos and sin must be floating point tensors of one shape and dtype, "
                         "(positions, width) or (batch, seq, width)")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(f"{name}: cos and sin get no gradient here; pass them without requires_grad")
    width = cos.shape[-1]
    rotary_dim = width if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or rotary_dim <= 0 or rotary_dim > head_dim:
        raise ValueError(f"{name}: rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
    if width not in (rotary_dim, rotary_dim // 2):
        raise ValueError(f"{name}: cos/sin width {width} fits neither rotary_dim {rotary_dim} (a column per "
                         f"feature) nor rotary_dim / 2 = {rotary_dim // 2} (a column per pair)")
    seq_len = first.shape[0] if ndim == 3 else first.shape[seq_dim]
    batch = 1 if ndim == 3 else first.shape[0]
    if seq_offset < 0:
        raise ValueError(f"{name}: seq_offset must be >= 0 (the position of the first token), got {seq_offset}")
    if cos.dim() == 3:
        if position_ids is not None or cu_seqlens is not None or seq_offset:
            raise ValueError(f"{name}: per-token cos/sin (batch, seq, width) take no position_ids, cu_seqlens "
                             "or seq_offset")
        if cos.shape[0] not in (1, batch) or cos.shape[1] != seq_len:
            raise ValueError(f"{name}: per-token cos/sin must be ({batch} or 1, {seq_len}, width), "
                             f"got {tuple(cos.shape)}")
    elif position_ids is None and cu_seqlens is None and seq_len + seq_offset > cos.shape[0]:
        raise ValueError(f"{name}: cos/sin have {cos.shape[0]} positions, too short for positions "
                         f"{seq_offset}..{seq_offset + seq_len - 1}")
    if position_ids is not None:
        if position_ids.shape != (batch, seq_len) or position_ids.dtype.is_floating_point:
            raise ValueError(f"{name}: position_ids must be integers of shape ({batch}, {seq_len}), got "
                             f"{tuple(position_ids.shape)} {position_ids.dtype}")
    return seq_dim, rotary_dim


def _check_cu_seqlens(name, cu_seqlens, total):
    """Eager only (one host synchronisation): cumulative lengths from 0 to the token count."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 \
            or cu_seqlens.dtype.is_floating_point:
        got = f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}" if isinstance(cu_seqlens, torch.Tensor) \
            else type(cu_seqlens).__name__
        raise ValueError(f"{name}: cu_seqlens must be a 1-d integer tensor (num_seqs + 1,), got {got}")
    values = cu_seqlens.tolist()
    if values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name}: cu_seqlens must start at 0, never decrease and end at the token count {total}, "
                         f"got {values[:8]}{' ...' if len(values) > 8 else ''}")


def _check_positions(name, positions, rows):
    """Eager only: positions past the table raise (one host synchronisation)."""
    if positions.numel() and bool(((positions < 0) | (positions >= rows)).any()):
        raise ValueError(f"{name}: positions reach {int(positions.max())} (min {int(positions.min())}), but "
                         f"cos/sin have {rows} positions")


def apply_rotary(q, k, cos, sin, *, position_ids=None, seq_offset=0, layout="bshd", rotary_dim=None,
                 interleaved=False, cu_seqlens=None, inplace=False):
    """Rotary embeddings on q and k: q * cos + rotate(q) * sin, as Hugging Face Llama-style
    models apply them; returns (q_out, k_out).

    - q, k: (batch, seq, heads, head_dim) (layout="bshd") or (batch, heads, seq, head_dim)
      ("bhsd"), any strides but unit feature stride, their own head counts (GQA); packed
      variable-length batches: (total_tokens, heads, head_dim) with `cu_seqlens` (int,
      (num_seqs + 1,), as flash-attention), positions restarting at each sequence.
    - cos, sin: (positions, width) tables, rows picked by `position_ids` (batch, seq) or by
      seq_offset + the index in the sequence (decoding); or per-token (batch or 1, seq, width).
      width = rotary_dim (a column per feature, Hugging Face) or rotary_dim / 2 (a column per
      pair, flash-attention); rotary_dim defaults to width; features past it pass through.
    - interleaved: pairs (2i, 2i + 1) (GPT-J) instead of (i, i + rotary_dim / 2) (GPT-NeoX).
    - inplace: rotate q and k in their own storage (eager; under torch.compile out of place).
      Views work, e.g. q and k sliced out of a fused projection; with autograd, q and k then
      take a launch each (autograd allows in-place on a view only in a one-output node).
    Backward through autograd (the transpose rotation); cos and sin get no gradient. q and k
    go through one launch and one autograd node: taking their gradients in two separate
    torch.autograd.grad calls needs retain_graph=True on the first.
    Positions past the table, or cu_seqlens that do not run from 0 to the token count without
    decreasing: eager raises (position_ids and cu_seqlens are read on the host for that);
    under torch.compile or CUDA-graph capture they are not checked (such tokens come out NaN).
    """
    refuse_dtensors("pintail.apply_rotary", q=q, k=k, cos=cos, sin=sin)
    return _apply("pintail.apply_rotary", (("q", q), ("k", k)), cos, sin, position_ids, seq_offset, layout,
                  rotary_dim, interleaved, cu_seqlens, inplace)


def rotary(x, cos, sin, *, position_ids=None, seq_offset=0, layout="bshd", rotary_dim=None, interleaved=False,
           cu_seqlens=None, inplace=False):
    """apply_rotary for a single tensor."""
    refuse_dtensors("pintail.rotary", x=x, cos=cos, sin=sin)
    return _apply("pintail.rotary", (("x", x),), cos, sin, position_ids, seq_offset, layout, rotary_dim,
                  interleaved, cu_seqlens, inplace)[0]


def _apply(name, tensors, cos, sin, position_ids, seq_offset, layout, rotary_dim, interleaved, cu_seqlens, inplace):
    seq_dim, rotary_dim = _check(name, tensors, cos, sin, layout, rotary_dim, position_ids, cu_seqlens, seq_offset)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():  # the kernel reads both with cos's strides
        cos, sin = cos.contiguous(), sin.contiguous()
    positions = position_ids
    tracing = torch.compiler.is_compiling() or (cos.is_cuda and torch.cuda.is_current_stream_capturing())
    if cu_seqlens is not None:
        if not tracing:
            _check_cu_seqlens(name, cu_seqlens, tensors[0][1].shape[0])
        positions = _positions_from(cu_seqlens, tensors[0][1].shape[0], seq_offset)
    if positions is not None and not tracing:
        _check_positions(name, positions, cos.shape[0])
    x, y = [t.unsqueeze(0) if cu_seqlens is not None else t for _, t in tensors] + [None] * (2 - len(tensors))
    geometry = (seq_dim, seq_offset, rotary_dim, interleaved)
    if torch.compiler.is_compiling():
        x_out, y_out = _rotary_op(x, y, cos, sin, positions, *geometry, False)
    elif not inplace:
        x_out, y_out = _Rotary.apply(x, y, cos, sin, positions, *geometry)
    elif torch.is_grad_enabled() and any(t.requires_grad for _, t in tensors):
        x_out, y_out = [_RotaryInPlace.apply(t, cos, sin, positions, *geometry) if t is not None else None
                        for t in (x, y)]
    else:  # nothing to differentiate: q and k in one launch
        _rotate_in_place([t for t in (x, y) if t is not None], cos, sin, positions, *geometry)
        x_out, y_out = x, y
    outputs = (x_out, y_out) if y is not None else (x_out,)
    return tuple(o.squeeze(0) if cu_seqlens is not None else o for o in outputs)
