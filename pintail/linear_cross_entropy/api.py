"""linear_cross_entropy: argument checks, the plans' loops, the torch.library ops and autograd."""

import torch
import torch.nn.functional as F

from .. import parallel
from .._core.dtensor import is_dtensor, refuse_dtensors, vocabulary_shard
from .._core.launch import no_second_derivative
from .._loss import chunks
from .._loss.checks import (Reduction, TargetCheck, check_class_weight, check_head, check_loss_options,
                            check_target_values, checked)
from .._loss.kernels import STATE_COLUMNS
from ..cross_entropy import cross_entropy
from . import plans, tokens
from .plans import NAME


# --------------------------------------------------------------- tensor-level functions


def _forward(x: torch.Tensor, linear_weight: torch.Tensor, linear_bias: torch.Tensor | None, target: torch.Tensor,
             weight: torch.Tensor | None, ignore_index: int, smoothing: float, z_scale: float, softcap: float,
             z_ratio: torch.Tensor | None, memory_budget: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and (max, log-sum) pairs of the logits x W^T + b (float32; float64 for
    float64 x), chunk by chunk over the vocabulary: no (M, V) tensor."""
    M, K = x.shape
    V = linear_weight.shape[0]
    compute = torch.promote_types(x.dtype, torch.float32)
    loss = x.new_empty(M, dtype=compute)
    stats = x.new_empty(M, 2, dtype=compute)
    if M == 0:
        return loss, stats
    columns = plans.chunk_columns(M, V, K, x.element_size(), memory_budget, accumulates=False)
    state = x.new_empty(M, STATE_COLUMNS, dtype=compute)
    weight_total = chunks.weight_total(weight, smoothing, compute)
    options = (ignore_index, smoothing, z_scale, softcap, z_ratio)
    for start, stop, logits in chunks.logit_chunks(x, linear_weight, linear_bias, columns):
        chunks.fold(logits, start, V, target, weight, weight_total, state, loss, stats, options, start == 0, stop == V)
    return loss, stats


def _backward(grad: torch.Tensor, x: torch.Tensor, linear_weight: torch.Tensor, linear_bias: torch.Tensor | None,
              target: torch.Tensor, weight: torch.Tensor | None, stats: torch.Tensor, ignore_index: int,
              smoothing: float, z_scale: float, softcap: float, z_ratio: torch.Tensor | None,
              memory_budget: int | None, need_input: bool, need_weight: bool, need_bias: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW, db) from the gradient of each row's loss (grad, shape (M,)), the logits
    recomputed chunk by chunk (chunks.head_gradients) in chunks that fit the budget; a
    gradient not asked for is an empty tensor."""
    (M, K), V = x.shape, linear_weight.shape[0]
    columns = plans.chunk_columns(M, V, K, x.element_size(), memory_budget, chunks.accumulates(x, need_input))
    return chunks.head_gradients(grad, x, linear_weight, linear_bias, target, weight, stats,
                                 (ignore_index, smoothing, z_scale, softcap, z_ratio), columns, need_input,
                                 need_weight, need_bias)


# ------------------------------------------------------------- torch.library and autograd
# One path, eager and compiled: a call's host time is small beside its GEMMs.

_forward_op = torch.library.custom_op("pintail::linear_cross_entropy_forward", _forward, mutates_args=())


@_forward_op.register_fake
def _linear_cross_entropy_forward_fake(x, linear_weight, linear_bias, target, weight, ignore_index, smoothing,
                                       z_scale, softcap, z_ratio, memory_budget):
    """Per row: loss (M,) and (max, log-sum) (M, 2); float32, float64 for float64 x."""
    M, dtype = x.shape[0], torch.promote_types(x.dtype, torch.float32)
    return x.new_empty(M, dtype=dtype), x.new_empty(M, 2, dtype=dtype)


_backward_op = torch.library.custom_op("pintail::linear_cross_entropy_backward", _backward, mutates_args=())


@_backward_op.register_fake
def _linear_cross_entropy_backward_fake(grad, x, linear_weight, linear_bias, target, weight, stats, ignore_index,
                                        smoothing, z_scale, softcap, z_ratio, memory_budget, need_input,
                                        need_weight, need_bias):
    """dx, dW, db like x, linear_weight and linear_bias, or empty where not asked for."""
    need_bias = need_bias and linear_bias is not None
    return (torch.empty_like(x) if need_input else x.new_empty(0),
            torch.empty_like(linear_weight) if need_weight else x.new_empty(0),
            torch.empty_like(linear_bias) if need_bias else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, linear_weight, linear_bias, target, weight, *options = inputs
    ctx.save_for_backward(x, linear_weight, linear_bias, target, weight, output[1], options[4])
    ctx.options = (options[0], options[1], options[2], options[3])
    ctx.memory_budget = options[5]


def _backward_of_op(ctx, grad, _stats):
    x, linear_weight, linear_bias, target, weight, stats, z_ratio = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dW, db = _backward_op(grad, x, linear_weight, linear_bias, target, weight, stats, *ctx.options, z_ratio,
                              ctx.memory_budget, need[0], need[1], need[2] and linear_bias is not None)
    grads = (dx if need[0] else None, dW if need[1] else None, db if need[2] and linear_bias is not None else None)
    return (*no_second_derivative(grads, x, linear_weight, linear_bias, grad), None, None, None, None, None,
            None, None, None)


_forward_op.register_autograd(_backward_of_op, setup_context=_setup_context)


class _KeptLogits(torch.autograd.Function):
    """The budget holds the whole logits: the forward keeps them, and the backward writes
    their gradient over them and takes dx, dW and db from it (three GEMMs, as the
    composition, at the memory of one copy of the logits). Eager only: under torch.compile
    the write into a tensor the forward kept would be copied by functionalization."""

    @staticmethod
    def forward(ctx, x, linear_weight, linear_bias, target, weight, options):
        M, V = x.shape[0], linear_weight.shape[0]
        compute = torch.promote_types(x.dtype, torch.float32)
        loss, stats = x.new_empty(M, dtype=compute), x.new_empty(M, 2, dtype=compute)
        state = x.new_empty(M, STATE_COLUMNS, dtype=compute)
        head, bias = chunks.padded_head(linear_weight, linear_bias, x.dtype)
        logits = torch.mm(x, head.t()) if bias is None else torch.addmm(bias, x, head.t())
        chunks.fold(logits[:, :V], 0, V, target, weight, chunks.weight_total(weight, options[1], compute), state, loss,
                    stats, options, True, True)
        ctx.save_for_backward(x, linear_weight, target, weight, stats)
        ctx.logits, ctx.options, ctx.has_bias = logits, options, linear_bias is not None
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad, _):
        if ctx.logits is None:
            raise RuntimeError(f"{NAME}: a second backward through a call whose memory_budget kept the logits "
                               f"(their gradient was written over them); use a smaller budget with retain_graph")
        x, linear_weight, target, weight, stats = ctx.saved_tensors
        logits, ctx.logits = ctx.logits, None
        options = ctx.options
        V = linear_weight.shape[0]
        chunks.gradient(logits[:, :V], 0, V, target, weight, chunks.weight_total(weight, options[1], stats.dtype), stats,
                        grad.to(stats.dtype).expand(x.shape[0]), options)
        need = ctx.needs_input_grad
        dx = logits @ chunks.padded_head(linear_weight, None, x.dtype)[0] if need[0] else None
        dW = (logits.t() @ x)[:V] if need[1] else None
        db = logits[:, :V].sum(0, dtype=stats.dtype).to(linear_weight.dtype) if need[2] and ctx.has_bias else None
        return (*no_second_derivative((dx, dW, db), x, linear_weight, grad), None, None, None)


# ------------------------------------------------------------------------ public API


def _check(input, linear_weight, target, linear_bias, weight, reduction, label_smoothing, z_loss, softcap, out_dtype):
    """Validate the arguments as torch does (input (*, K), class-index target (*) or
    probabilities (*, V)); returns whether targets are probabilities."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{NAME}: target must be a tensor, got {type(target).__name__}")
    check_head(NAME, input, linear_weight, linear_bias)
    V = linear_weight.shape[0]
    check_class_weight(NAME, weight, V, input.device)
    check_loss_options(NAME, reduction, label_smoothing, z_loss, softcap)
    if out_dtype not in (None, torch.float32):
        raise ValueError(f"{NAME}: out_dtype must be None (the input's dtype) or torch.float32, got {out_dtype}")
    if target.device != input.device:
        raise ValueError(f"{NAME}: target is on {target.device}, expected input's device {input.device}")
    if target.dtype.is_floating_point:
        expected = (*input.shape[:-1], V)
        if tuple(target.shape) != expected:
            raise ValueError(f"{NAME}: probability targets must have shape {expected} (input's leading shape, "
                             f"classes), got {tuple(target.shape)}")
        return True
    if target.dtype not in (torch.int64, torch.int32, torch.uint8):
        raise TypeError(f"{NAME}: class-index targets must be int64, int32 or uint8, got {target.dtype}")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"{NAME}: target must have input's leading shape {tuple(input.shape[:-1])} for input of "
                         f"shape {tuple(input.shape)}, got {tuple(target.shape)}")
    return False


def _check_budget(memory_budget, M, V, K, x, needs_input_grad):
    if memory_budget is None:
        return
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int):
        raise TypeError(f"{NAME}: memory_budget must be None or an int (bytes), got {memory_budget!r}")
    least = plans.minimum_budget(M, V, K, x.element_size(), chunks.accumulates(x, needs_input_grad))
    if memory_budget < least:
        raise ValueError(f"{NAME}: memory_budget={memory_budget} bytes is below the least this call needs, {least} "
                         f"bytes ({M} rows x {plans.MIN_CHUNK_COLUMNS} classes of logits, and a float32 (rows, "
                         f"hidden) sum of the input's gradient where it is 16-bit)")


def _parallel_columns(x, linear_weight, memory_budget):
    """The classes a chunk of a rank's rows of the head takes in the forward and the backward."""
    (M, K), V = x.shape, linear_weight.shape[0]
    need_input = torch.is_grad_enabled() and x.requires_grad
    return tuple(plans.chunk_columns(M, V, K, x.element_size(), memory_budget, sums)
                 for sums in (False, chunks.accumulates(x, need_input)))


def _plan(x, linear_weight, linear_bias, head_weight, reduction, memory_budget):
    """The plan this call takes (plans.choose)."""
    grad = torch.is_grad_enabled()
    need = [grad and t is not None and t.requires_grad for t in (x, head_weight, linear_bias)]
    (M, K), V = x.shape, linear_weight.shape[0]
    return plans.choose(M, V, K, x.element_size(), memory_budget, gradients=any(need),
                        uniform_rows=reduction != "none", can_keep=not torch.compiler.is_compiling(),
                        sums_dx=need[0] and x.element_size() < 4, sums_dW=need[1] and head_weight.element_size() < 4)


def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, weight=None, reduction="mean",
                         ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, return_lse=False,
                         memory_budget=None, check_target=True, out_dtype=None, process_group=None):
    """cross_entropy(linear(input, linear_weight, linear_bias), target, ...) without the logits.

    What torch.nn.functional.linear_cross_entropy returns (ignore_index=None means -100, as
    there), value and gradients of input, linear_weight and linear_bias, computed chunk by
    chunk over the vocabulary: a log-sum-exp pass over the chunks in the forward, and in
    the backward each chunk's logits again, their gradient written over them, then dx and
    that chunk's rows of dW from it. Exact: no gradient is skipped or approximated.

    - input (*, hidden) with class-index target (*) (int64, int32 or uint8), as a model
      gives them, e.g. (batch, seq, hidden) and (batch, seq); reduction="none" returns (*).
      (torch takes the classes of an input of 3 or more dims from dim 1 of the logits.)
    - linear_weight (classes, hidden), linear_bias (classes,), in input's dtype and device;
      under autocast the three are cast to autocast's dtype first, as F.linear does.
    - weight, reduction, ignore_index, label_smoothing as F.cross_entropy; z_loss, softcap
      and out_dtype as pintail.cross_entropy; return_lse also returns each row's float32
      log-sum-exp (shape (*)).
    - memory_budget: bytes of workspace (one chunk of logits in input's dtype, and the
      float32 (rows, hidden) sum of dx for 16-bit inputs): the widest chunks that fit.
      None: chunks of about 1/32 of the vocabulary. A budget that holds the whole logits
      keeps them from the forward to the backward in eager mode (three GEMMs, as the
      composition; a second backward then raises), and runs them as one chunk under
      torch.compile. Below the least workspace a call needs: ValueError.
    - check_target: an out-of-range class index raises IndexError in eager mode (a host
      wait for one small kernel); without the check, under torch.compile and in CUDA graph
      capture, its row's loss and gradient are NaN and nothing is read out of bounds.
    - Probability targets (floating point, shape (*, classes)) give torch's result through
      pintail.cross_entropy on the whole logits (held in memory).
    - process_group: a column-parallel head split over the group's ranks: linear_weight and
      linear_bias are this rank's rows (the ranks' rows in rank order make the vocabulary),
      input the full hidden state and target the global class indices (both the same on
      every rank), weight the whole vocabulary's class weights. Every rank returns the full
      loss; dW and db are its rows' gradients, dx is summed over the ranks (an all-reduce of
      (tokens, hidden) in the backward). Class-index targets.
    Gradients are computed only for the tensors that require them (a frozen head costs no
    dW GEMM). A second derivative raises.
    """
    if is_dtensor(linear_weight) and process_group is None:  # a head split over the vocabulary
        input, linear_weight, linear_bias, process_group = vocabulary_shard("pintail.linear_cross_entropy", input,
                                                                            linear_weight, linear_bias)
    refuse_dtensors("pintail.linear_cross_entropy", input=input, linear_weight=linear_weight, target=target,
                    linear_bias=linear_bias, weight=weight)
    ignore_index = -100 if ignore_index is None else ignore_index
    input, linear_weight, linear_bias, head_weight = chunks.autocast_inputs(input, linear_weight, linear_bias)
    split = process_group is not None
    prob_target = _check(input, linear_weight, target, linear_bias, None if split else weight, reduction,
                         label_smoothing, z_loss, softcap, out_dtype)
    if split and prob_target:
        raise ValueError(f"{NAME}: process_group takes class-index targets, got {target.dtype} probabilities")
    if weight is not None and weight.requires_grad and torch.is_grad_enabled() and not prob_target:
        raise RuntimeError(f"{NAME}: not differentiable with respect to weight for class-index targets (as torch's "
                           f"nll_loss); pass a weight that does not require grad")
    V, K = linear_weight.shape
    batch_shape = input.shape[:-1]
    if prob_target:
        logits = F.linear(input, linear_weight, linear_bias).reshape(-1, V)
        result = cross_entropy(logits, target.reshape(-1, V), weight, ignore_index, reduction, label_smoothing,
                               z_loss=z_loss, softcap=softcap, return_lse=return_lse, out_dtype=out_dtype)
        if reduction != "none" and not return_lse:
            return result
        outputs = list(result) if return_lse else [result]
        outputs = [o.reshape(batch_shape) if o.dim() else o for o in outputs]
        return tuple(outputs) if return_lse else outputs[0]
    x = input.reshape(-1, K)
    M = x.shape[0]
    _check_budget(memory_budget, M, V, K, x, input.requires_grad and torch.is_grad_enabled())
    t = target.reshape(-1).contiguous()
    weight = weight.contiguous() if weight is not None else None
    target_check = None
    tracing = torch.compiler.is_compiling() or (input.is_cuda and torch.cuda.is_current_stream_capturing())
    if split:
        V = parallel.vocabulary_slice(process_group, V, NAME)[1]  # the whole vocabulary, for the target check
    if check_target and not tracing and M > 0:
        if chunks.on_kernels(x) and not split:
            target_check = TargetCheck(t, V, ignore_index, NAME)
        else:
            check_target_values(t, V, ignore_index, NAME)
    compute = torch.promote_types(input.dtype, torch.float32)
    loss_dtype = torch.promote_types(input.dtype, out_dtype) if out_dtype is not None else input.dtype
    reduce = Reduction(reduction, t, weight, ignore_index, False, batch_shape, compute, loss_dtype)
    z_ratio = reduce.z_ratio(z_loss)
    softcap = 0.0 if softcap is None else float(softcap)
    options = (ignore_index, float(label_smoothing), float(z_loss), softcap, z_ratio)

    def rows_and_stats():
        if process_group is not None:
            return parallel.head_rows(x, linear_weight.contiguous(), linear_bias, t, weight, options, process_group,
                                      _parallel_columns(x, linear_weight, memory_budget), NAME)[0]
        plan = _plan(x, linear_weight, linear_bias, head_weight, reduction, memory_budget)
        if plan.kind == "logits":
            return _KeptLogits.apply(x, linear_weight.contiguous(), linear_bias, t, weight, options)
        if plan.kind == "tokens":
            return tokens.rows_and_stats(x, head_weight.contiguous(), linear_bias, t, weight, options, plan.width)
        return _forward_op(x, linear_weight.contiguous(), linear_bias, t, weight, *options[:4], z_ratio, memory_budget)

    rows, stats = checked(target_check, rows_and_stats)
    loss = reduce(rows).to(loss_dtype)
    if return_lse:
        return loss, stats.detach().sum(1).reshape(batch_shape).float()
    return loss
