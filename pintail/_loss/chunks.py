"""The pieces of a loss over chunks of a row's classes, which the fused heads' plans and the
vocabulary-parallel loss share: the fold and gradient kernels' launches over a chunk, the
logits of a chunk by GEMM into a reused buffer, a GEMM summed into a float32 accumulator,
and the vocabulary-chunk loops over a head (or a rank's rows of it)."""

import warnings

import torch

from .. import reference
from .._core.launch import KERNEL_DTYPES, launch, row_alignment, runs_kernels
from . import plans
from .kernels import STATE_COLUMNS, fold_kernel, gradient_kernel


def on_kernels(x):
    return runs_kernels(x) and x.dtype in KERNEL_DTYPES


def accumulates(x, need_input):
    """Whether dx is summed over the chunks in a float32 accumulator (16-bit inputs)."""
    return need_input and x.element_size() < 4


def logit_chunks(x, linear_weight, linear_bias, columns):
    """(first class, past-last class, logits) of each chunk of `columns` classes in turn, the
    logits x W[chunk]^T + b[chunk] written into one buffer that every chunk reuses."""
    M, V = x.shape[0], linear_weight.shape[0]
    buffer = torch.empty(M, plans.buffer_columns(columns), dtype=x.dtype, device=x.device)
    for start in range(0, V, columns):
        stop = min(start + columns, V)
        logits = buffer[:, :stop - start]
        head = linear_weight[start:stop].t()
        if linear_bias is None:
            torch.mm(x, head, out=logits)
        else:
            torch.addmm(linear_bias[start:stop], x, head, out=logits)
        yield start, stop, logits


def padded_head(linear_weight, linear_bias, dtype):
    """The head and bias in `dtype` with zero rows up to buffer_columns(V): GEMMs over the whole
    vocabulary then take a multiple of 64 classes (cuBLAS runs GPT-2's 50257 at a fraction of
    its rate). The zero rows give logits of 0 past V, which the kernels never read, and so
    gradient columns of 0 there, which the GEMMs that read the gradient add nothing from."""
    V, K = linear_weight.shape
    rows = plans.buffer_columns(V)
    if rows == V:
        return linear_weight.to(dtype), linear_bias.to(dtype) if linear_bias is not None else None
    head = linear_weight.new_zeros(rows, K, dtype=dtype)
    head[:V] = linear_weight  # cast and padded in one copy
    bias = None
    if linear_bias is not None:
        bias = linear_bias.new_zeros(rows, dtype=dtype)
        bias[:V] = linear_bias
    return head, bias


def weight_total(weight, smoothing, dtype):
    """sum(weight) (0-d, on the device), which smoothing spreads over; None where not read."""
    return weight.sum(dtype=dtype) if weight is not None and smoothing > 0 else None


def fold(logits, start, V, target, weight, weight_total, state, loss, stats, options, first, last):
    """Fold a chunk's logits into each row's state; the last chunk writes loss and stats."""
    ignore_index, smoothing, z_scale, softcap, z_ratio = options
    if not on_kernels(logits):
        z = z_scale * z_ratio if z_ratio is not None else z_scale
        reference.linear_cross_entropy_fold(logits, start, V, target, weight, weight_total, state, loss, stats,
                                            ignore_index, smoothing, z, softcap, first, last)
        return
    n = logits.shape[1]
    placeholder = state
    launch(fold_kernel, (logits.shape[0],), logits, logits.stride(0), n, start, V, target,
           weight if weight is not None else placeholder, weight_total if weight_total is not None else placeholder,
           state, loss, stats, z_ratio if z_ratio is not None else placeholder, ignore_index, smoothing, z_scale,
           softcap, HAS_WEIGHT=weight is not None, SMOOTH=smoothing > 0, SOFTCAP=softcap > 0, FIRST=first, LAST=last,
           Z_RATIO=z_ratio is not None, BLOCK=min(plans.FOLD_BLOCK, max(16, 1 << (n - 1).bit_length())),
           ALIGN=row_alignment(n, logits.stride(0)), num_warps=plans.FOLD_WARPS)


def gradient(logits, start, V, target, weight, weight_total, stats, grad, options):
    """Overwrite a chunk's logits with the gradient of the row losses (times grad) there."""
    ignore_index, smoothing, z_scale, softcap, z_ratio = options
    if not on_kernels(logits):
        z = z_scale * z_ratio if z_ratio is not None else z_scale
        logits.copy_(reference.linear_cross_entropy_chunk_gradient(
            logits, start, V, target, weight, weight_total, stats, grad, ignore_index, smoothing, z, softcap))
        return
    M, n = logits.shape
    heavy = plans.heavy_body(weight, smoothing, softcap)
    block, blocks = plans.backward_chunks(n, 0, heavy)
    placeholder = stats
    launch(gradient_kernel, (M, blocks), logits, logits.stride(0), n, start, V, target,
           weight if weight is not None else placeholder, weight_total if weight_total is not None else placeholder,
           stats, grad, grad.stride(0), z_ratio if z_ratio is not None else placeholder, ignore_index, smoothing,
           z_scale, softcap, HAS_WEIGHT=weight is not None, SMOOTH=smoothing > 0, SOFTCAP=softcap > 0,
           Z_RATIO=z_ratio is not None, BLOCK=block, ALIGN=row_alignment(n, logits.stride(0)),
           num_warps=plans.GRADIENT_WARPS)


# Whether cuBLAS takes 16-bit operands into a float32 output here (torch.addmm's out_dtype).
_MIXED_GEMM = {"cuda": True}


def add_product(accumulator, a, b):
    """accumulator += a @ b, summed in the accumulator's dtype (float32 for 16-bit a, b).
    Without a mixed-precision GEMM (the CPU) the operands go to float32 in slices of
    plans.CPU_ACCUMULATE_COLUMNS columns of a, so that their copies stay small."""
    if accumulator.dtype == a.dtype:
        accumulator.addmm_(a, b)
    elif accumulator.is_cuda:
        if _MIXED_GEMM["cuda"]:
            try:
                torch.addmm(accumulator, a, b, out_dtype=accumulator.dtype, out=accumulator)
                return
            except (RuntimeError, TypeError) as error:  # refused before writing anything
                _MIXED_GEMM["cuda"] = False
                warnings.warn(f"pintail: torch.addmm(out_dtype=float32) is not available ({error}); the float32 "
                              f"sums take 16-bit products of each chunk instead", stacklevel=2)
        accumulator += torch.mm(a, b)  # each chunk's product rounded once, the sum in float32
    else:
        for start in range(0, a.shape[1], plans.CPU_ACCUMULATE_COLUMNS):
            stop = start + plans.CPU_ACCUMULATE_COLUMNS
            accumulator.addmm_(a[:, start:stop].to(accumulator.dtype), b[start:stop].to(accumulator.dtype))


def head_state(x, linear_weight, linear_bias, target, weight, first_class, num_classes, smoothing, softcap, columns):
    """Each row's running state (kernels.STATE_COLUMNS) over the logits x W^T + b of the head's
    rows, classes first_class ... of num_classes, in chunks of `columns` classes."""
    compute = torch.promote_types(x.dtype, torch.float32)
    state = x.new_empty(x.shape[0], STATE_COLUMNS, dtype=compute)
    if x.shape[0] == 0:
        return state
    total = weight_total(weight, smoothing, compute)
    options = (-100, smoothing, 0.0, softcap, None)
    for start, _, logits in logit_chunks(x, linear_weight, linear_bias, columns):
        fold(logits, first_class + start, num_classes, target, weight, total, state, state, state, options,
             start == 0, False)
    return state


def head_gradients(grad, x, linear_weight, linear_bias, target, weight, stats, options, columns, need_input,
                   need_weight, need_bias, first_class=0, num_classes=-1):
    """(dx, dW, db) from the gradient of each row's loss (grad, (M,)), each chunk of `columns`
    classes' logits computed again and their gradient written over them; a gradient not asked
    for is an empty tensor. dW's rows of a chunk come from one GEMM (summed in float32 by it);
    dx is summed over the chunks in float32 for 16-bit x. The head's rows are classes
    first_class ... of num_classes (-1: the head is the whole vocabulary)."""
    M, K = x.shape
    V = linear_weight.shape[0]
    num_classes = V if num_classes < 0 else num_classes
    need_bias = need_bias and linear_bias is not None
    sums_dx = accumulates(x, need_input) and columns < V
    dx = x.new_zeros(M, K, dtype=torch.float32 if sums_dx else x.dtype) if need_input else x.new_empty(0)
    dW = torch.empty_like(linear_weight) if need_weight else x.new_empty(0)
    db = torch.empty_like(linear_bias) if need_bias else x.new_empty(0)
    if M == 0:
        dW.zero_(), db.zero_()
        return dx.to(x.dtype), dW, db
    if not (need_input or need_weight or need_bias):
        return dx, dW, db
    total = weight_total(weight, options[1], stats.dtype)
    grad = grad.to(stats.dtype).expand(M)
    for start, stop, logits in logit_chunks(x, linear_weight, linear_bias, columns):
        gradient(logits, first_class + start, num_classes, target, weight, total, stats, grad, options)
        if need_input:
            add_product(dx, logits, linear_weight[start:stop])
        if need_weight:
            torch.mm(logits.t(), x, out=dW[start:stop])
        if need_bias:
            db[start:stop] = logits.sum(0, dtype=stats.dtype)
    return dx.to(x.dtype), dW, db


def narrowed(total, dtype, scale=None, head_rows=256):
    """total (a float32 sum) times scale ((rows, 1): a value a row; else one value; None: 1)
    in `dtype`. A 16-bit result is written over the first half of total's own bytes and
    returned as a view of them, so the float32 sum and its 16-bit copy (a head's dW: 1 and
    0.5 GiB at Llama-3.2-1B) are never both held. Rows [r, 2r) at a time: their 16-bit bytes
    cover only float32 rows below r, already read; the first head_rows through a copy. It
    aliases total: eager, or inside an op whose total is its own."""
    def scaled(a, b, out=None):
        part = total[a:b]
        if scale is None:
            return part.to(dtype) if out is None else out.copy_(part)
        factor = scale[a:b] if scale.dim() == 2 else scale
        return (part * factor).to(dtype) if out is None else torch.mul(part, factor, out=out)

    if not total.numel() or (scale is not None and not scale.numel()):  # no rows: the sums are 0 already
        return total.to(dtype)
    if dtype == total.dtype:
        return total if scale is None else total.mul_(scale)
    if torch.finfo(dtype).bits != 16 or total.dtype != torch.float32 or not total.is_contiguous():
        return scaled(0, total.shape[0])
    narrow = total.view(-1).view(dtype)[:total.numel()].view(total.shape)
    rows = total.shape[0]
    head = min(rows, head_rows)
    first = scaled(0, head)
    start = head
    while start < rows:
        end = min(2 * start, rows)
        scaled(start, end, out=narrow[start:end])
        start = end
    narrow[:head].copy_(first)
    return narrow


def token_chunks(x, head, bias, rows):
    """(row slice, logits) of each chunk of `rows` rows of x in turn: x[rows] head^T + bias,
    over all of the head's rows (padded_head's: a multiple of 64), into one reused buffer."""
    M = x.shape[0]
    buffer = x.new_empty(min(rows, M), head.shape[0])
    for first in range(0, M, rows):
        chunk = slice(first, min(first + rows, M))
        logits = buffer[:chunk.stop - first]
        if bias is None:
            torch.mm(x[chunk], head.t(), out=logits)
        else:
            torch.addmm(bias, x[chunk], head.t(), out=logits)
        yield chunk, logits


def autocast_inputs(input, linear_weight, linear_bias):
    """The inputs in autocast's dtype where autocast is on for their device, as F.linear, and
    the head's weight as given (a token-chunk plan casts a float32 one itself, so that its dW
    sum is the weight's float32 gradient)."""
    device = input.device.type
    if not torch.is_autocast_enabled(device):
        return input, linear_weight, linear_bias, linear_weight
    input, linear_bias = autocast_head(input, linear_bias)
    cast = linear_weight.to(torch.get_autocast_dtype(device)) if linear_weight.is_floating_point() else linear_weight
    return input, cast, linear_bias, linear_weight if linear_weight.dtype == torch.float32 else cast


def autocast_head(input, linear_bias):
    """input and bias in autocast's dtype where autocast is on (as F.linear); the head's weight
    is cast chunk-loop side (padded_head), so that a float32 one gets a float32 gradient."""
    device = input.device.type
    if not torch.is_autocast_enabled(device):
        return input, linear_bias
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in (input, linear_bias))


def head_rows(name, M, V, K, x, linear_weight, memory_budget, buffers):
    """Rows a token chunk within memory_budget (plans.token_rows), or a ValueError that
    names the least budget."""
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)):
        raise TypeError(f"{name}: memory_budget must be None or an int (bytes), got {memory_budget!r}")
    sums_dW = torch.is_grad_enabled() and linear_weight.requires_grad and linear_weight.element_size() < 4
    rows = plans.token_rows(M, V, K, x.element_size(), memory_budget, buffers, sums_dW)
    if rows == 0:
        least = plans.token_budget(M, V, K, x.element_size(), buffers, sums_dW)
        raise ValueError(f"{name}: memory_budget={memory_budget} bytes is below the least this call needs, {least} "
                         f"bytes ({min(M, plans.MIN_TOKEN_ROWS)} rows of {buffers} logits buffer(s)"
                         f"{' and the float32 sum of the head gradient' if sums_dW else ''})")
    return rows
