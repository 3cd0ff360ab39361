"""cross_entropy: argument checks, launch by plan, autograd and the torch.library ops with their fakes."""

import torch

from .. import parallel, reference
from .._core.dtensor import refuse_dtensors
from .._core.launch import KERNEL_DTYPES, as_rows, cdiv, launch, no_second_derivative, runs_kernels
from .._loss import plans as loss_plans
from .._loss.checks import (Reduction, TargetCheck, check_class_weight, check_loss_options, check_target_values,
                            checked)
from . import plans
from .kernels import _backward_kernel, _backward_probs_kernel, _forward_kernel, _forward_probs_kernel, _reduce_kernel

NAME = "pintail.cross_entropy"

# --------------------------------------------------------------- tensor-level functions


def _weight_rows(weight, V, shift, per_class, placeholder):
    """(weights, row stride) as the forward kernels read them: with SHIFT (rows from their
    first boundary, `shift` elements apart) where the kernel reads every class's weight
    (per_class: smoothing, or probability targets), a table of `shift` rows, row h =
    weight[h:] (0 past V), each on a 16-byte boundary: a logits row with h classes before its
    first boundary reads its chunks' weights as vectors from table row h (from the weights
    themselves, at weight + h + j, they are 2-byte loads). Row 0 is the weights: w[t] reads
    it. Else the weights themselves (stride 1), or the placeholder without weights (never
    read). The backward reads the weights themselves: its table (SHIFT 64) cost more than it
    saved."""
    if weight is None:
        return placeholder, 1
    if not (shift and per_class):
        return weight, 1
    stride = cdiv(V, 16) * 16  # Triton specialises it as 16-divisible: the rows' loads are vectors
    padded = torch.nn.functional.pad(weight, (0, stride + shift - V))
    return padded.as_strided((shift, stride), (1, 1)).contiguous(), stride


def _mass_rows(M, weight, smoothing, prob_target):
    """Rows of the forward's mass output: B = sum_j w_j y'_j a row for probability targets,
    W = sum_j w_j a row for class weights with smoothing; else none."""
    return M if prob_target or (weight is not None and smoothing > 0) else 0


REDUCE_CODES = {"none": 0, "sum": 1, "mean": 2}


def _launch_forward(x, target, weight, ignore_index, smoothing, z_scale, softcap, prob_target, z_ratio, reduction,
                    out_dtype=None):
    """Per-row loss, (max, log-sum) pairs and mass (_mass_rows), float32, of x[M, V] (lse =
    max + log-sum); with reduction sum / mean also the reduced loss (0-d, out_dtype, default
    x's) and the mean's denominator (float32), from a second one-program kernel."""
    M, V = x.shape
    device = x.device
    loss = torch.empty(M, dtype=torch.float32, device=device)
    stats = torch.empty(M, 2, dtype=torch.float32, device=device)
    mass = torch.empty(_mass_rows(M, weight, smoothing, prob_target), dtype=torch.float32, device=device)
    reduce = REDUCE_CODES[reduction]
    out = torch.empty((), dtype=out_dtype or x.dtype, device=device) if reduce else loss
    denominator = torch.empty((), dtype=torch.float32, device=device) if reduce == 2 else loss
    if M == 0:
        return loss, stats, mass, out.fill_(0.0 if reduce == 1 else float("nan")), denominator.fill_(0.0)
    has_weight = weight is not None
    w = weight if has_weight else loss  # any pointer: never read without HAS_WEIGHT
    align, shift = plans._vectors(V, "forward", (x, target) if prob_target else (x,))
    weights, weight_stride = _weight_rows(weight, V, shift, smoothing > 0 or prob_target, loss)
    block = plans._forward_block(V, smoothing, prob_target)
    common = dict(HAS_WEIGHT=has_weight, SOFTCAP=softcap > 0, BLOCK=block, ALIGN=align, SHIFT=shift,
                  EVEN=shift == 0 and V % block == 0, num_warps=plans.FORWARD_WARPS)
    if prob_target:
        launch(_forward_probs_kernel, (M,), x, target, weights, weight_stride, loss, stats, mass, V, x.stride(0),
               target.stride(0), smoothing, z_scale, softcap, **common)
    else:
        launch(_forward_kernel, (M,), x, target, weights, weight_stride, loss, stats, mass, V, x.stride(0),
               ignore_index, smoothing, z_scale, softcap, z_ratio if z_ratio is not None else loss,
               SMOOTH=smoothing > 0, Z_RATIO=z_ratio is not None, **common)
    if reduce:
        launch(_reduce_kernel, (1,), loss, target, w, out, denominator, M, V, ignore_index, REDUCE=reduce,
               HAS_WEIGHT=has_weight, PROB=prob_target, BLOCK=plans.REDUCE_BLOCK, num_warps=plans.REDUCE_WARPS)
    return loss, stats, mass, out, denominator


def _forward(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int,
             smoothing: float, z_scale: float, softcap: float, prob_target: bool, z_ratio: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss, (max, log-sum) pair and mass (_mass_rows), all float32, of x[M, V]:
    lse = max + log-sum. z_ratio (0-d, or None for 1) multiplies z_scale: Reduction.z_ratio."""
    if not (runs_kernels(x) and x.dtype in KERNEL_DTYPES):
        return reference.cross_entropy_rows(x, target, weight, ignore_index, smoothing,
                                            z_scale * z_ratio if z_ratio is not None else z_scale, softcap,
                                            prob_target)
    return _launch_forward(x, target, weight, ignore_index, smoothing, z_scale, softcap, prob_target, z_ratio,
                           "none")[:3]


def _backward(grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
              stats: torch.Tensor, mass: torch.Tensor, ignore_index: int, smoothing: float, z_scale: float,
              softcap: float, prob_target: bool, z_ratio: torch.Tensor | None, inplace: bool,
              denominator: torch.Tensor | None = None) -> torch.Tensor:
    """dloss/dx[M, V] from the gradient of each row's loss (grad of shape (M,)), or from the
    gradient of their sum (a 0-d grad), or of their mean (0-d, with its denominator)."""
    M, V = x.shape
    if not (runs_kernels(x) and x.dtype in KERNEL_DTYPES):
        dx = reference.cross_entropy_rows_backward(grad, x, target, weight, stats, ignore_index,
                                                   smoothing, z_scale * z_ratio if z_ratio is not None else z_scale,
                                                   softcap, prob_target)
        return x.copy_(dx) if inplace else dx
    dx = x if inplace else torch.empty_like(x)
    if M == 0 or V == 0:
        return dx
    has_weight = weight is not None
    w = weight if has_weight else stats
    grad_stride = grad.stride(0) if grad.dim() else 0
    align, shift = plans._vectors(V, "backward", (x, dx, target) if prob_target else (x, dx))
    block, chunks = loss_plans.backward_chunks(V, shift, loss_plans.heavy_body(weight, smoothing, softcap))
    grid = (M, chunks)
    common = dict(HAS_WEIGHT=has_weight, SOFTCAP=softcap > 0, MEAN=denominator is not None, BLOCK=block,
                  ALIGN=align, SHIFT=shift, num_warps=loss_plans.BACKWARD_WARPS)
    denominator = denominator if denominator is not None else stats
    if prob_target:
        launch(_backward_probs_kernel, grid, dx, x, target, w, stats, mass, grad, denominator, V, x.stride(0),
               target.stride(0), dx.stride(0), grad_stride, smoothing, z_scale, softcap, **common)
    else:
        launch(_backward_kernel, grid, dx, x, target, w, stats, mass, grad, denominator, V, x.stride(0), dx.stride(0),
               grad_stride, ignore_index, smoothing, z_scale, softcap, z_ratio if z_ratio is not None else stats,
               SMOOTH=smoothing > 0, Z_RATIO=z_ratio is not None, **common)
    return dx


# ------------------------------------------------------------- autograd and torch.library
# As for softmax: eager calls take a plain autograd.Function (custom-op dispatch costs tens
# of microseconds of host time); torch.compile reaches the same functions as custom ops.


def _probability_target_grads(grad, x, y, weight, stats, smoothing, softcap, need_target, need_weight):
    """(dloss/dy, dloss/dweight) for probability targets, in torch (an (M, V) temporary, made
    only when the targets or the class weights require a gradient). Per row, with
    lse - x' = (max - x') + log-sum and y' = (1 - e) y + e / V:
        loss = sum_j w_j y'_j (lse - x'_j) + z lse^2
        dloss/dy_j = (1 - e) w_j (lse - x'_j),   dloss/dw_j = y'_j (lse - x'_j)"""
    compute = stats.dtype  # float32, float64 for float64 logits
    x = x.to(compute)
    if softcap > 0:
        x = softcap * torch.tanh(x / softcap)
    gap = ((stats[:, :1] - x) + stats[:, 1:]) * grad.to(compute)[:, None]
    dtarget = dweight = None
    if need_target:
        dtarget = gap * (1 - smoothing)
        dtarget = (dtarget * weight.to(compute) if weight is not None else dtarget).to(y.dtype)
    if need_weight:
        dweight = (gap * ((1 - smoothing) * y.to(compute) + smoothing / x.shape[1])).sum(0).to(weight.dtype)
    return dtarget, dweight


class _CrossEntropy(torch.autograd.Function):
    """Eager path: the kernels and the reduction as one autograd node. sum and mean are
    reduced by one kernel after the forward and un-reduced inside the backward kernel: a
    chain of small torch ops costs more host time than the kernels at LM sizes."""

    @staticmethod
    def forward(ctx, x, target, weight, options, reduce, inplace):
        fused = runs_kernels(x) and x.dtype in KERNEL_DTYPES and reduce.reduction != "none"
        if fused:
            _, stats, mass, loss, denominator = _launch_forward(x, target, weight, *options, reduce.reduction,
                                                                reduce.out_dtype)
            denominator = denominator if reduce.reduction == "mean" else None
        else:
            rows, stats, mass = _forward(x, target, weight, *options)
            loss, denominator = reduce(rows).to(reduce.out_dtype), None
        ctx.save_for_backward(x, target, weight, stats, mass, denominator)
        ctx.options, ctx.reduce, ctx.inplace, ctx.fused = options, reduce, inplace, fused
        ctx.mark_non_differentiable(stats)
        ctx.set_materialize_grads(False)
        return loss, stats

    @staticmethod
    def backward(ctx, grad, _):
        x, target, weight, stats, mass, denominator = ctx.saved_tensors
        dtarget = dweight = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:  # first: they read the logits, which an
            grad_rows = ctx.reduce.row_gradients(grad, x.shape[0])  # in-place dx overwrites
            dtarget, dweight = _probability_target_grads(grad_rows, x, target, weight, stats, ctx.options[1],
                                                         ctx.options[3], *ctx.needs_input_grad[1:3])
        if ctx.fused and ctx.reduce.reduction != "none":  # the kernel un-reduces the scalar grad itself
            dx = _backward(grad, x, target, weight, stats, mass, *ctx.options, ctx.inplace, denominator)
        else:
            dx = _backward(ctx.reduce.row_gradients(grad, x.shape[0]), x, target, weight, stats, mass,
                           *ctx.options, ctx.inplace)
        if ctx.inplace:
            # The kernel wrote over the logits behind autograd's back: any other node that saved
            # them now raises autograd's "modified by an inplace operation" instead of
            # computing with the gradient's values.
            torch.autograd.graph.increment_version(x)
        return no_second_derivative((dx, dtarget, dweight, None, None, None), x, target, weight, grad)


_forward_op = torch.library.custom_op("pintail::cross_entropy_forward", _forward, mutates_args=())


@_forward_op.register_fake
def _cross_entropy_forward_fake(x, target, weight, ignore_index, smoothing, z_scale, softcap, prob_target, z_ratio):
    """Per row: loss (M,), (max, log-sum) (M, 2) and mass (_mass_rows); float32, float64 for
    float64 logits."""
    M, dtype = x.shape[0], torch.promote_types(x.dtype, torch.float32)
    return (x.new_empty(M, dtype=dtype), x.new_empty(M, 2, dtype=dtype),
            x.new_empty(_mass_rows(M, weight, smoothing, prob_target), dtype=dtype))


def _backward_no_inplace(grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                         stats: torch.Tensor, mass: torch.Tensor, ignore_index: int, smoothing: float,
                         z_scale: float, softcap: float, prob_target: bool, z_ratio: torch.Tensor | None
                         ) -> torch.Tensor:
    return _backward(grad, x, target, weight, stats, mass, ignore_index, smoothing, z_scale, softcap,
                     prob_target, z_ratio, inplace=False)


_backward_op = torch.library.custom_op("pintail::cross_entropy_backward", _backward_no_inplace, mutates_args=())


@_backward_op.register_fake
def _cross_entropy_backward_fake(grad, x, target, weight, stats, mass, ignore_index, smoothing, z_scale, softcap,
                                 prob_target, z_ratio):
    """dx: torch.empty_like of the (M, V) logits."""
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, target, weight, *options = inputs
    _, stats, mass = output
    ctx.save_for_backward(x, target, weight, stats, mass)
    ctx.options = tuple(options)


def _backward_of_op(ctx, grad, _stats, _mass):
    x, target, weight, stats, mass = ctx.saved_tensors
    dx = _backward_op(grad, x, target, weight, stats, mass, *ctx.options)
    dtarget = dweight = None
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        dtarget, dweight = _probability_target_grads(grad, x, target, weight, stats, ctx.options[1], ctx.options[3],
                                                     *ctx.needs_input_grad[1:3])
    return dx, dtarget, dweight, None, None, None, None, None, None


_forward_op.register_autograd(_backward_of_op, setup_context=_setup_context)


def _loss_and_stats(x, target, weight, options, reduce, inplace):
    """(the reduced loss in reduce.out_dtype, (max, log-sum) per row). Under torch.compile through
    the custom ops, with the reduction as traced torch ops (and the gradient never written in place)."""
    if torch.compiler.is_compiling():
        rows, stats, _ = _forward_op(x, target, weight, *options)
        return reduce(rows).to(reduce.out_dtype), stats
    return _CrossEntropy.apply(x, target, weight, options, reduce, inplace)


# ------------------------------------------------------------------------ public API


def _check(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap):
    """Validate the arguments as torch does; returns whether targets are probabilities."""
    name = NAME
    if not isinstance(input, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"{name}: input and target must be tensors, got {type(input).__name__} and "
                        f"{type(target).__name__}")
    if not input.dtype.is_floating_point:
        raise TypeError(f"{name}: input must be floating point logits, got dtype {input.dtype}")
    if input.dim() == 0:
        raise ValueError(f"{name}: input must have shape (C), (N, C) or (N, C, d1, ...), got a 0-d tensor")
    check_loss_options(name, reduction, label_smoothing, z_loss, softcap)
    if target.device != input.device:
        raise ValueError(f"{name}: target is on {target.device}, expected input's device {input.device}")
    C = input.shape[0] if input.dim() == 1 else input.shape[1]
    check_class_weight(name, weight, C, input.device)
    prob_target = target.dtype.is_floating_point
    if prob_target:
        if target.shape != input.shape:
            raise ValueError(f"{name}: probability targets must have the input's shape {tuple(input.shape)}, "
                             f"got {tuple(target.shape)}")
        if ignore_index != -100:
            raise ValueError(f"{name}: ignore_index is not supported for probability (floating point) "
                             f"targets, got ignore_index={ignore_index}")
    else:
        if target.dtype not in (torch.int64, torch.int32, torch.uint8):
            raise TypeError(f"{name}: class-index targets must be int64, int32 or uint8, got {target.dtype}")
        expected = () if input.dim() == 1 else (input.shape[0], *input.shape[2:])
        if tuple(target.shape) != expected:
            raise ValueError(f"{name}: target must have shape {expected} for input of shape "
                             f"{tuple(input.shape)}, got {tuple(target.shape)}")
    return prob_target


def _parallel_cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
                           return_z_loss, return_lse, check_target, out_dtype, group):
    """pintail.cross_entropy with process_group: see its docstring."""
    name = NAME
    if target.dtype.is_floating_point:
        raise ValueError(f"{name}: process_group takes class-index targets, got {target.dtype} probabilities")
    if weight is not None and (not isinstance(weight, torch.Tensor) or weight.dim() != 1):
        raise ValueError(f"{name}: weight must be a 1-D tensor of the whole vocabulary's classes")
    _check(input, target, None, ignore_index, reduction, label_smoothing, z_loss, softcap)
    class_dim = 1 if input.dim() > 1 else 0
    x = as_rows(input, class_dim)
    t = (target if target.dim() == 1 else target.reshape(-1)).contiguous()
    first_class, num_classes = parallel.vocabulary_slice(group, x.shape[1], name)
    tracing = torch.compiler.is_compiling() or (input.is_cuda and torch.cuda.is_current_stream_capturing())
    if check_target and not tracing and t.numel():
        check_target_values(t, num_classes, ignore_index, name)
    compute = torch.promote_types(input.dtype, torch.float32)
    loss_dtype = torch.promote_types(input.dtype, out_dtype) if out_dtype is not None else input.dtype
    weight = weight.contiguous() if weight is not None else None
    reduce = Reduction(reduction, t, weight, ignore_index, False, target.shape, compute, loss_dtype)
    z_ratio = reduce.z_ratio(z_loss)
    options = (ignore_index, float(label_smoothing), float(z_loss), 0.0 if softcap is None else float(softcap),
               z_ratio)
    (rows, stats), _ = parallel.logits_rows(x, t, weight, options, group, name)
    outputs = [reduce(rows).to(loss_dtype)]
    lse = stats.detach().sum(1)
    if return_z_loss:
        kept = (t != ignore_index).to(lse.dtype)
        outputs.append(reduce(z_loss * lse**2 * kept * (z_ratio if z_ratio is not None else 1)).to(loss_dtype))
    if return_lse:
        outputs.append(lse.reshape(target.shape))
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
                  z_loss=0.0, softcap=None, return_z_loss=False, return_lse=False, inplace_backward=False,
                  check_target=True, out_dtype=None, process_group=None):
    """torch.nn.functional.cross_entropy, with Triton kernels on CUDA, plus extras.

    Takes what torch takes: input (C), (N, C) or (N, C, d1, ...) with classes on dim 1;
    class-index targets (int64, int32 or uint8) or class-probability targets (floating point,
    the input's shape); weight, ignore_index, reduction, label_smoothing. Returns what torch
    returns, in the input's dtype (computed in float32), or in out_dtype.

    Keyword-only extras:
    - z_loss: adds z_loss * lse^2 for every kept row (lse: the row's log-sum-exp): each row's
      term with reduction "none", their sum with "sum", their mean over the kept rows with
      "mean", also where class weights make the loss a weighted mean (a per-token penalty, as
      PaLM defines it: scaling every class weight leaves it unchanged).
    - softcap: logits become softcap * tanh(logits / softcap) first; the gradient goes through.
    - return_z_loss / return_lse: also return the z-loss term alone (reduced as the loss) and
      the float32 log-sum-exp of each row (target's shape), both without gradient, in that
      order after the loss: (loss, z_loss, lse).
    - inplace_backward: write the gradient into the logits' storage instead of a new tensor.
      Saves the (N, C) gradient's memory; the logits hold the gradient after backward, so use
      it only when nothing reads them afterwards. Another autograd node that saved the logits
      and runs its backward later raises autograd's "modified by an inplace operation" error.
      Leaf logits (made by the caller, not by an op) are never overwritten, and under
      torch.compile the gradient gets its own tensor.
    - out_dtype: None (torch's rule: the input's dtype) or torch.float32: the loss, the z-loss
      term and reduction="none" losses in float32, computed from 16-bit logits without a
      float32 copy of them (what transformers' loss gives after upcasting the logits, without
      the upcast); the gradient stays in the logits' dtype.
    - check_target: in eager mode an out-of-range class index raises IndexError. A
      one-program kernel counts such targets before the forward; the host waits for that
      kernel only (not for the forward, which is launched before the wait), and scans the
      targets to name the bad one only when the count is not 0. With check_target=False, under
      torch.compile and while a CUDA graph is being captured there is no check: the kernels
      never read out of bounds, and a row with an out-of-range target gets a NaN loss and a
      NaN gradient, so the error shows in the loss.

    - process_group: the classes are split over the group's ranks (a vocabulary-parallel
      head): input holds this rank's slice of the classes (the ranks' slices in rank order
      make the vocabulary; sizes may differ), target the global class indices (the same on
      every rank), weight the whole vocabulary's class weights. Every rank returns the loss
      of the full logits and gets its slice of their gradient. Two all-reduces of 4 and 12
      bytes a row; the slice sizes are gathered once per group and size. Class-index targets.

    Rows of (N, C, d1, ...) inputs are gathered into an (N*d1*..., C) copy (classes are not
    contiguous there); (C) and (N, C) inputs with unit class stride are used in place.
    """
    refuse_dtensors("pintail.cross_entropy", input=input, target=target, weight=weight)
    if process_group is not None:
        return _parallel_cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                                      softcap, return_z_loss, return_lse, check_target, out_dtype, process_group)
    prob_target = _check(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap)
    if out_dtype not in (None, torch.float32):
        raise ValueError(f"pintail.cross_entropy: out_dtype must be None (the input's dtype) or torch.float32, "
                         f"got {out_dtype}")
    if not prob_target and weight is not None and weight.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("pintail.cross_entropy: not differentiable with respect to weight for class-index "
                           "targets (as torch's nll_loss); pass a weight that does not require grad")
    softcap = 0.0 if softcap is None else softcap  # 0: none, for the kernels
    C = input.shape[0] if input.dim() == 1 else input.shape[1]
    batch_shape = target.shape if not prob_target else (input.shape[:1] + input.shape[2:] if input.dim() > 1 else ())
    class_dim = 1 if input.dim() > 1 else 0
    x = as_rows(input, class_dim)
    if prob_target:
        t = as_rows(target, class_dim)
    else:  # the kernels index targets and weights with unit stride
        t = (target if target.dim() == 1 else target.reshape(-1)).contiguous()
    weight = weight.contiguous() if weight is not None else None
    target_check = None
    if not prob_target:
        tracing = torch.compiler.is_compiling() or (input.is_cuda and torch.cuda.is_current_stream_capturing())
        if check_target and not tracing and t.numel() > 0:
            if runs_kernels(x) and x.dtype in KERNEL_DTYPES:
                target_check = TargetCheck(t, C, ignore_index, NAME)
            else:
                check_target_values(t, C, ignore_index, NAME)
    loss_dtype = torch.promote_types(input.dtype, out_dtype) if out_dtype is not None else input.dtype
    reduce = Reduction(reduction, t, weight, ignore_index, prob_target, batch_shape,
                        torch.promote_types(input.dtype, torch.float32), loss_dtype)
    z_ratio = reduce.z_ratio(z_loss)
    options = (ignore_index, float(label_smoothing), float(z_loss), float(softcap), prob_target, z_ratio)
    # in place only over an intermediate (e.g. a matmul's output), never over a leaf the caller made
    loss, stats = checked(target_check, lambda: _loss_and_stats(x, t, weight, options, reduce,
                                                                inplace_backward and not input.is_leaf))
    outputs = [loss]
    lse = stats.detach().sum(1) if return_z_loss or return_lse else None
    if return_z_loss:
        kept = torch.ones_like(lse) if prob_target else (t != ignore_index).float()
        z_rows = z_loss * lse**2 * kept * (z_ratio if z_ratio is not None else 1)
        outputs.append(reduce(z_rows).to(loss_dtype))
    if return_lse:
        outputs.append(lse.reshape(batch_shape))
    return outputs[0] if len(outputs) == 1 else tuple(outputs)
