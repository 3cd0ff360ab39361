"""The token-chunk plan: m rows at a time over the whole vocabulary, three GEMMs in all.

For each chunk of rows the forward writes their (m, V) logits into one reused buffer, folds
each row into its loss and (max, log-sum), writes over the logits the gradient of the rows'
summed loss, and takes from it the rows' dx (complete at once: a row's whole vocabulary is
there) and the chunk's share of dW and db, summed over the chunks in float32. The backward
only scales those by the incoming gradient. This serves reductions "mean" and "sum", whose
row gradients are one value for every row; "none" takes the vocabulary chunks.

dx and the dW sum are float32 until that scaling (one rounding to the input's dtype, as the
composition's single GEMM); where the head's weight is float32 (autocast over float32
weights) the dW sum is the weight's gradient itself, with no other V x K buffer.
"""

import torch

from .._core.launch import no_second_derivative
from .._loss.chunks import add_product, fold, gradient, narrowed, padded_head, token_chunks, weight_total
from .._loss.kernels import STATE_COLUMNS
from .._loss.plans import buffer_columns
from .plans import NAME


def _forward(x: torch.Tensor, linear_weight: torch.Tensor, linear_bias: torch.Tensor | None, target: torch.Tensor,
             weight: torch.Tensor | None, ignore_index: int, smoothing: float, z_scale: float, softcap: float,
             z_ratio: torch.Tensor | None, rows_per_chunk: int, need_input: bool, need_weight: bool,
             need_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, stats, dx, dW, db) per row and of the rows' summed loss; a gradient not asked for
    is an empty tensor. linear_weight may be float32 where x is 16-bit (GEMMs in x's dtype)."""
    M, K = x.shape
    V = linear_weight.shape[0]
    compute = torch.promote_types(x.dtype, torch.float32)
    loss, stats = x.new_empty(M, dtype=compute), x.new_empty(M, 2, dtype=compute)
    dx = x.new_zeros(M, K, dtype=compute) if need_input else x.new_empty(0)
    # over the padded vocabulary (padded_head); its first V rows are returned, not copied
    dW_sum = x.new_zeros(buffer_columns(V), K, dtype=compute) if need_weight else x.new_empty(0)
    db = x.new_zeros(V, dtype=compute) if need_bias and linear_bias is not None else x.new_empty(0)
    if M == 0:
        return loss, stats, dx, dW_sum[:V], db
    with torch.autocast(x.device.type, enabled=False):  # the GEMMs write float32 sums: no casts
        _chunk_loop(x, linear_weight, linear_bias, target, weight, (ignore_index, smoothing, z_scale, softcap, z_ratio),
                    rows_per_chunk, loss, stats, dx, dW_sum, db)
    return loss, stats, dx, dW_sum[:V], db


def _chunk_loop(x, linear_weight, linear_bias, target, weight, options, rows_per_chunk, loss, stats, dx, dW_sum, db):
    M, V = x.shape[0], linear_weight.shape[0]
    compute = loss.dtype
    head, bias = padded_head(linear_weight, linear_bias, x.dtype)
    m = min(rows_per_chunk, M)
    state = x.new_empty(m, STATE_COLUMNS, dtype=compute)
    unit = x.new_ones(1, dtype=compute).expand(m)  # the gradient of the summed loss: 1 a row
    total = weight_total(weight, options[1], compute)
    for rows, logits in token_chunks(x, head, bias, m):
        n = rows.stop - rows.start
        fold(logits[:, :V], 0, V, target[rows], weight, total, state[:n], loss[rows], stats[rows], options, True, True)
        gradient(logits[:, :V], 0, V, target[rows], weight, total, stats[rows], unit[:n], options)
        if dx.numel():
            add_product(dx[rows], logits, head)
        if dW_sum.numel():
            add_product(dW_sum, logits.t(), x[rows])
        if db.numel():
            db += logits[:, :V].sum(0, dtype=compute)


_forward_op = torch.library.custom_op("pintail::linear_cross_entropy_tokens", _forward, mutates_args=())


@_forward_op.register_fake
def _forward_fake(x, linear_weight, linear_bias, target, weight, ignore_index, smoothing, z_scale, softcap, z_ratio,
                  rows_per_chunk, need_input, need_weight, need_bias):
    """loss (M,), stats (M, 2), dx (M, K), dW (V, K), db (V,) in float32 (float64 for float64
    x), contiguous; an empty tensor for a gradient not asked for."""
    (M, K), V = x.shape, linear_weight.shape[0]
    dtype = torch.promote_types(x.dtype, torch.float32)
    empty = x.new_empty(0)
    return (x.new_empty(M, dtype=dtype), x.new_empty(M, 2, dtype=dtype),
            x.new_empty(M, K, dtype=dtype) if need_input else empty,
            x.new_empty(V, K, dtype=dtype) if need_weight else empty,
            x.new_empty(V, dtype=dtype) if need_bias and linear_bias is not None else empty)


@torch.library.custom_op("pintail::linear_cross_entropy_scale_", mutates_args=("dx", "dW", "db"))
def _scale_(dx: torch.Tensor, dW: torch.Tensor, db: torch.Tensor, grad: torch.Tensor) -> None:
    """dx *= grad (a row each), dW and db *= grad[0], in place (empty tensors skipped); under
    torch.compile functionalized, and written in place again where nothing else reads them."""
    if dx.numel():
        dx.mul_(grad[:, None])
    for total in (dW, db):
        if total.numel() and grad.numel():  # no rows: the sums are 0 already
            total.mul_(grad[:1])


@_scale_.register_fake
def _scale_fake(dx, dW, db, grad):
    return None


class _TokenChunks(torch.autograd.Function):
    """The row losses and stats from the forward op; its gradients of the summed loss kept
    for the backward, which scales them by the incoming row gradients in place (dx row by
    row, dW and db by the one value every row's gradient has under "mean" and "sum")."""

    @staticmethod
    def forward(ctx, x, linear_weight, linear_bias, target, weight, options, rows_per_chunk, need):
        loss, stats, dx, dW, db = _forward_op(x, linear_weight, linear_bias, target, weight, *options,
                                              rows_per_chunk, *need)
        ctx.save_for_backward(dx, dW, db, x, linear_weight, linear_bias)
        ctx.dtypes = (x.dtype, linear_weight.dtype, linear_bias.dtype if linear_bias is not None else None)
        ctx.spent = False
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad, _stats):
        if ctx.spent:
            raise RuntimeError(f"{NAME}: a second backward through a token-chunk call (its gradients were scaled "
                               f"in place); use reduction='none' or a memory_budget of the logits with retain_graph")
        ctx.spent = True
        dx, dW, db, *sources = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need = ctx.needs_input_grad
        if torch.compiler.is_compiling():  # functional, as the graph needs
            _scale_(dx, dW, db, grad)
            grads = (dx.to(x_dtype) if need[0] else None, dW.to(w_dtype) if need[1] else None,
                     db.to(b_dtype) if need[2] and b_dtype is not None else None)
        else:
            grads = (narrowed(dx, x_dtype, grad[:, None]) if need[0] else None,
                     narrowed(dW, w_dtype, grad[:1]) if need[1] else None,
                     narrowed(db, b_dtype, grad[:1]) if need[2] and b_dtype is not None else None)
        return (*no_second_derivative(grads, *sources, grad), None, None, None, None, None)


def rows_and_stats(x, linear_weight, linear_bias, target, weight, options, rows_per_chunk):
    """The token-chunk plan's (row losses, stats), differentiable in x, the head and its bias."""
    need = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (x, linear_weight, linear_bias)]
    return _TokenChunks.apply(x, linear_weight, linear_bias, target, weight, options, rows_per_chunk, need)
