"""log_probs and linear_log_probs: argument checks, the kernels' launches, the token-chunk
loop over a head, and the torch.library ops with their autograd."""

import torch

from .. import parallel, reference
from .._core.dtensor import refuse_dtensors
from .._core.launch import as_rows, cdiv, launch, no_second_derivative, row_alignment
from .._loss import chunks
from .._loss import plans as loss_plans
from .._loss.checks import check_head, check_target, check_temperature
from .._loss.chunks import autocast_head, head_rows
from .kernels import _backward_kernel, _forward_kernel

# The forward's chunk of a row, and the backward's (a program a row and chunk).
FORWARD_BLOCK, FORWARD_WARPS = 4096, 4
BACKWARD_BLOCK, BACKWARD_WARPS = 2048, 4


def _rows_forward(x, target, ignore_index, temperature, softcap, entropy, lp, H, stats, first_class=0,
                  num_classes=-1):
    """lp, H (with entropy) and (max, log-sum) of each row of x (M, V), written into the given
    float32 tensors. lp None: x holds classes first_class ... of num_classes (a rank's slice),
    and stats (M, 4) gets each row's partial state (kernels.py) instead."""
    M, V = x.shape
    if M == 0:
        return
    num_classes = V if num_classes < 0 else num_classes
    if not chunks.on_kernels(x):
        reference.log_probs_rows(x, target, ignore_index, temperature, softcap, entropy, lp, H, stats, first_class,
                                 num_classes)
        return
    partial = lp is None
    launch(_forward_kernel, (M,), x, x.stride(0), target, stats if partial else lp,
           H if entropy and not partial else stats, stats, V, first_class, num_classes, ignore_index,
           1.0 / temperature, softcap, SOFTCAP=softcap > 0, ENTROPY=entropy, PARTIAL=partial,
           BLOCK=min(FORWARD_BLOCK, max(16, 1 << (V - 1).bit_length())), ALIGN=row_alignment(V, x.stride(0)),
           num_warps=FORWARD_WARPS)


def _rows_backward(dx, x, target, stats, H, grad_lp, grad_H, ignore_index, temperature, softcap, entropy,
                   first_class=0, num_classes=-1):
    """Write into dx (M, V; may be x itself) the gradient of lp and H times grad_lp, grad_H; x
    holds classes first_class ... of num_classes (-1: all of them)."""
    M, V = x.shape
    if M == 0:
        return
    num_classes = V if num_classes < 0 else num_classes
    if not chunks.on_kernels(x):
        dx.copy_(reference.log_probs_rows_backward(grad_lp, grad_H, x, target, stats, H, ignore_index, temperature,
                                                   softcap, entropy, first_class, num_classes))
        return
    block = min(BACKWARD_BLOCK, max(16, 1 << (V - 1).bit_length()))
    launch(_backward_kernel, (M, cdiv(V, block)), dx, dx.stride(0), x, x.stride(0), target, stats,
           H if entropy else stats, grad_lp, grad_H if entropy else grad_lp, V, first_class, num_classes,
           ignore_index, 1.0 / temperature,
           softcap, SOFTCAP=softcap > 0, ENTROPY=entropy, BLOCK=block,
           ALIGN=row_alignment(V, x.stride(0), dx.stride(0)), num_warps=BACKWARD_WARPS)


def _outputs(x, M, entropy):
    compute = torch.promote_types(x.dtype, torch.float32)
    return (x.new_empty(M, dtype=compute), x.new_empty(M if entropy else 0, dtype=compute),
            x.new_empty(M, 2, dtype=compute))


def _row_grads(grad_lp, grad_H, M, dtype, entropy):
    """The incoming gradients as contiguous (M,) tensors (zeros for an output not used)."""
    grad_lp = grad_lp.to(dtype).contiguous() if grad_lp is not None else torch.zeros(M, dtype=dtype,
                                                                                      device=grad_H.device)
    if not entropy:
        return grad_lp, grad_lp
    return grad_lp, grad_H.to(dtype).contiguous() if grad_H is not None else torch.zeros_like(grad_lp)


# ------------------------------------------------------------------------- on logits


@torch.library.custom_op("pintail::log_probs", mutates_args=())
def _log_probs_op(x: torch.Tensor, target: torch.Tensor, ignore_index: int, temperature: float, softcap: float,
                  entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lp (M,), H (M,) or empty, (max, log-sum) (M, 2)) of logits x (M, V), float32 (float64
    for float64 x)."""
    lp, H, stats = _outputs(x, x.shape[0], entropy)
    _rows_forward(x, target, ignore_index, temperature, softcap, entropy, lp, H, stats)
    return lp, H, stats


@_log_probs_op.register_fake
def _log_probs_fake(x, target, ignore_index, temperature, softcap, entropy):
    return _outputs(x, x.shape[0], entropy)


@torch.library.custom_op("pintail::log_probs_backward", mutates_args=())
def _log_probs_backward_op(grad_lp: torch.Tensor, grad_H: torch.Tensor, x: torch.Tensor, target: torch.Tensor,
                           stats: torch.Tensor, H: torch.Tensor, ignore_index: int, temperature: float,
                           softcap: float, entropy: bool) -> torch.Tensor:
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    _rows_backward(dx, x, target, stats, H, grad_lp, grad_H, ignore_index, temperature, softcap, entropy)
    return dx


@_log_probs_backward_op.register_fake
def _log_probs_backward_fake(grad_lp, grad_H, x, target, stats, H, ignore_index, temperature, softcap, entropy):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _log_probs_setup(ctx, inputs, output):
    x, target, *options = inputs
    ctx.save_for_backward(x, target, output[2], output[1])
    ctx.options = tuple(options)


def _log_probs_backward(ctx, grad_lp, grad_H, _stats):
    x, target, stats, H = ctx.saved_tensors
    entropy = ctx.options[-1]
    grad_lp, grad_H = _row_grads(grad_lp, grad_H, x.shape[0], stats.dtype, entropy)
    dx = _log_probs_backward_op(grad_lp, grad_H, x, target, stats, H, *ctx.options)
    return no_second_derivative((dx,), x, grad_lp, grad_H)[0], None, None, None, None, None


_log_probs_op.register_autograd(_log_probs_backward, setup_context=_log_probs_setup)


# ---------------------------------------------------------------------- from a head


def _head_forward(x: torch.Tensor, linear_weight: torch.Tensor, linear_bias: torch.Tensor | None,
                  target: torch.Tensor, ignore_index: int, temperature: float, softcap: float, entropy: bool,
                  rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lp, H, stats) of the logits x W^T + b, `rows` rows at a time over the whole vocabulary."""
    M, V = x.shape[0], linear_weight.shape[0]
    lp, H, stats = _outputs(x, M, entropy)
    head, bias = chunks.padded_head(linear_weight, linear_bias, x.dtype)
    with torch.autocast(x.device.type, enabled=False):
        for chunk, logits in chunks.token_chunks(x, head, bias, rows):
            _rows_forward(logits[:, :V], target[chunk], ignore_index, temperature, softcap, entropy, lp[chunk],
                          H[chunk] if entropy else H, stats[chunk])
    return lp, H, stats


def _head_backward(grad_lp: torch.Tensor, grad_H: torch.Tensor, x: torch.Tensor, linear_weight: torch.Tensor,
                   linear_bias: torch.Tensor | None, target: torch.Tensor, stats: torch.Tensor, H: torch.Tensor,
                   ignore_index: int, temperature: float, softcap: float, entropy: bool, rows: int, need_input: bool,
                   need_weight: bool, need_bias: bool, first_class: int = 0, num_classes: int = -1
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW, db): each chunk's logits made again and their gradient written over them; dx of
    its rows complete from one GEMM, dW and db summed over the chunks in float32. A gradient
    not asked for is an empty tensor. The head's rows are classes first_class ... of
    num_classes (-1: the whole vocabulary)."""
    M, K = x.shape
    V = linear_weight.shape[0]
    need_bias = need_bias and linear_bias is not None
    compute = stats.dtype
    dx = x.new_empty(M, K) if need_input else x.new_empty(0)
    dW_sum = x.new_zeros(loss_plans.buffer_columns(V), K, dtype=compute) if need_weight else x.new_empty(0)
    db = x.new_zeros(V, dtype=compute) if need_bias else x.new_empty(0)
    head, bias = chunks.padded_head(linear_weight, linear_bias, x.dtype)
    with torch.autocast(x.device.type, enabled=False):
        for chunk, logits in chunks.token_chunks(x, head, bias, rows):
            _rows_backward(logits[:, :V], logits[:, :V], target[chunk], stats[chunk], H[chunk] if entropy else H,
                           grad_lp[chunk], grad_H[chunk] if entropy else grad_lp, ignore_index, temperature,
                           softcap, entropy, first_class, num_classes)
            if need_input:  # columns past V: zero head rows, so zero logits, never written: no term
                torch.mm(logits, head, out=dx[chunk])
            if need_weight:
                chunks.add_product(dW_sum, logits.t(), x[chunk])
            if need_bias:
                db += logits[:, :V].sum(0, dtype=compute)
    dW = chunks.narrowed(dW_sum[:V], linear_weight.dtype) if need_weight else dW_sum
    return dx, dW, db.to(linear_bias.dtype) if need_bias else db


_head_forward_op = torch.library.custom_op("pintail::linear_log_probs", _head_forward, mutates_args=())


@_head_forward_op.register_fake
def _head_forward_fake(x, linear_weight, linear_bias, target, ignore_index, temperature, softcap, entropy, rows):
    return _outputs(x, x.shape[0], entropy)


_head_backward_op = torch.library.custom_op("pintail::linear_log_probs_backward", _head_backward, mutates_args=())


@_head_backward_op.register_fake
def _head_backward_fake(grad_lp, grad_H, x, linear_weight, linear_bias, target, stats, H, ignore_index, temperature,
                        softcap, entropy, rows, need_input, need_weight, need_bias, first_class=0, num_classes=-1):
    need_bias = need_bias and linear_bias is not None
    return (torch.empty_like(x) if need_input else x.new_empty(0),
            torch.empty_like(linear_weight) if need_weight else x.new_empty(0),
            torch.empty_like(linear_bias) if need_bias else x.new_empty(0))


def _head_setup(ctx, inputs, output):
    x, linear_weight, linear_bias, target, *options = inputs
    ctx.save_for_backward(x, linear_weight, linear_bias, target, output[2], output[1])
    ctx.options = tuple(options)


def _head_backward_of_op(ctx, grad_lp, grad_H, _stats):
    x, linear_weight, linear_bias, target, stats, H = ctx.saved_tensors
    entropy = ctx.options[-2]
    grad_lp, grad_H = _row_grads(grad_lp, grad_H, x.shape[0], stats.dtype, entropy)
    need = ctx.needs_input_grad
    dx, dW, db = _head_backward_op(grad_lp, grad_H, x, linear_weight, linear_bias, target, stats, H, *ctx.options,
                                   need[0], need[1], need[2] and linear_bias is not None)
    grads = (dx if need[0] else None, dW if need[1] else None, db if need[2] and linear_bias is not None else None)
    return (*no_second_derivative(grads, x, linear_weight, linear_bias, grad_lp, grad_H), None, None, None, None,
            None, None)


_head_forward_op.register_autograd(_head_backward_of_op, setup_context=_head_setup)


class _KeptLogits(torch.autograd.Function):
    """The budget holds the whole logits: the forward keeps them (one GEMM), and the backward
    writes their gradient over them and takes dx, dW and db from it: three GEMMs, as the
    composition, where the token chunks make each chunk's logits again (four). A log-prob's
    upstream gradient is known only in the backward, so the logits themselves are what is
    kept. Eager only: under torch.compile the write into a tensor the forward kept would be
    copied by functionalization."""

    @staticmethod
    def forward(ctx, x, linear_weight, linear_bias, target, options):
        ignore_index, temperature, softcap, entropy, _ = options
        M, V = x.shape[0], linear_weight.shape[0]
        lp, H, stats = _outputs(x, M, entropy)
        head, bias = chunks.padded_head(linear_weight, linear_bias, x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            logits = torch.mm(x, head.t()) if bias is None else torch.addmm(bias, x, head.t())
            _rows_forward(logits[:, :V], target, ignore_index, temperature, softcap, entropy, lp, H, stats)
        ctx.save_for_backward(x, linear_weight, target, stats, H)
        ctx.logits, ctx.options, ctx.has_bias = logits, options, linear_bias is not None
        ctx.mark_non_differentiable(stats)
        return lp, H, stats

    @staticmethod
    def backward(ctx, grad_lp, grad_H, _stats):
        if ctx.logits is None:
            raise RuntimeError("pintail.linear_log_probs: a second backward through a call whose memory_budget kept "
                               "the logits (their gradient was written over them); use a smaller budget with "
                               "retain_graph")
        x, linear_weight, target, stats, H = ctx.saved_tensors
        logits, ctx.logits = ctx.logits, None
        ignore_index, temperature, softcap, entropy, _ = ctx.options
        V = linear_weight.shape[0]
        grad_lp, grad_H = _row_grads(grad_lp, grad_H, x.shape[0], stats.dtype, entropy)
        need = ctx.needs_input_grad
        with torch.autocast(x.device.type, enabled=False):
            _rows_backward(logits[:, :V], logits[:, :V], target, stats, H, grad_lp, grad_H if entropy else grad_lp,
                           ignore_index, temperature, softcap, entropy)
            dx = logits @ chunks.padded_head(linear_weight, None, x.dtype)[0] if need[0] else None
            dW = (logits.t() @ x)[:V].to(linear_weight.dtype) if need[1] else None
            db = logits[:, :V].sum(0, dtype=stats.dtype).to(linear_weight.dtype) if need[2] and ctx.has_bias else None
        return (*no_second_derivative((dx, dW, db), x, linear_weight, grad_lp, grad_H), None, None)


def _keeps_logits(x, linear_weight, linear_bias, memory_budget):
    """Whether the budget holds the whole logits and a backward will want them (eager)."""
    if memory_budget is None or torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    if not any(t is not None and t.requires_grad for t in (x, linear_weight, linear_bias)):
        return False
    return memory_budget >= x.shape[0] * loss_plans.buffer_columns(linear_weight.shape[0]) * x.element_size()


# ------------------------------------------------------- a vocabulary split over ranks


def _head_state(x: torch.Tensor, linear_weight: torch.Tensor, linear_bias: torch.Tensor | None, target: torch.Tensor,
                ignore_index: int, temperature: float, softcap: float, entropy: bool, rows: int, first_class: int,
                num_classes: int) -> torch.Tensor:
    """Each row's (max, sum of exp, entropy sum, z_t or 0) over this rank's classes (M, 4)."""
    M, V = x.shape[0], linear_weight.shape[0]
    state = x.new_empty(M, 4, dtype=torch.promote_types(x.dtype, torch.float32))
    head, bias = chunks.padded_head(linear_weight, linear_bias, x.dtype)
    with torch.autocast(x.device.type, enabled=False):
        for chunk, logits in chunks.token_chunks(x, head, bias, rows):
            _rows_forward(logits[:, :V], target[chunk], ignore_index, temperature, softcap, entropy, None, None,
                          state[chunk], first_class, num_classes)
    return state


_head_state_op = torch.library.custom_op("pintail::linear_log_probs_state", _head_state, mutates_args=())
_head_state_op.register_fake(lambda x, *rest: x.new_empty(x.shape[0], 4,
                                                           dtype=torch.promote_types(x.dtype, torch.float32)))


def _combine(state, target, ignore_index, num_classes, entropy, group):
    """(lp, H, (max, log-sum)) of every row over the whole vocabulary from the ranks' states:
    an all-reduce of the max (4 bytes a row), then of the rescaled sums and z_t (12)."""
    row_max = state[:, 0]
    global_max = parallel.all_reduce(row_max, "max", group)
    shift = torch.where(global_max == -float("inf"), 0.0, global_max)
    scale = torch.exp(row_max - shift)  # 0 for a rank whose classes are all -inf
    step = torch.where(row_max == -float("inf"), 0.0, row_max - shift)
    packed = torch.stack([state[:, 1] * scale, scale * (state[:, 2] + step * state[:, 1]), state[:, 3]], 1)
    total, moment, z_t = parallel.all_reduce(packed, "sum", group).unbind(1)
    log_sum = torch.log(total)
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < num_classes)
    lp = torch.where(ignored, 0.0, torch.where(in_range, (z_t - shift) - log_sum, float("nan")))
    H = torch.where(ignored, 0.0, torch.where(in_range, log_sum - moment / total, float("nan")))
    return lp, H if entropy else H[:0], torch.stack([shift, log_sum], 1)


class _ParallelHead(torch.autograd.Function):
    """lp and H of a head whose rows are split over a group; the backward gives this rank's
    dW and db and dx summed over the ranks."""

    @staticmethod
    def forward(ctx, x, linear_weight, linear_bias, target, options, first_class, num_classes, group):
        ignore_index, temperature, softcap, entropy, rows = options
        state = _head_state_op(x, linear_weight, linear_bias, target, *options, first_class, num_classes)
        lp, H, stats = _combine(state, target, ignore_index, num_classes, entropy, group)
        ctx.save_for_backward(x, linear_weight, linear_bias, target, stats, H)
        ctx.options, ctx.slice, ctx.group = options, (first_class, num_classes), group
        ctx.mark_non_differentiable(stats)
        return lp, H, stats

    @staticmethod
    def backward(ctx, grad_lp, grad_H, _stats):
        x, linear_weight, linear_bias, target, stats, H = ctx.saved_tensors
        entropy = ctx.options[3]
        grad_lp, grad_H = _row_grads(grad_lp, grad_H, x.shape[0], stats.dtype, entropy)
        need = ctx.needs_input_grad
        dx, dW, db = _head_backward_op(grad_lp, grad_H, x, linear_weight, linear_bias, target, stats, H, *ctx.options,
                                       need[0], need[1], need[2] and linear_bias is not None, *ctx.slice)
        if need[0]:
            dx = parallel.all_reduce(dx, "sum", ctx.group)  # x feeds every rank's slice
        return (dx if need[0] else None, dW if need[1] else None, db if need[2] and linear_bias is not None else None,
                None, None, None, None, None)


# ------------------------------------------------------------------------ public API


def _check_options(name, temperature, softcap, ignore_index):
    check_temperature(name, temperature)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not softcap > 0):
        raise ValueError(f"{name}: softcap must be None or a number > 0, got {softcap!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{name}: ignore_index must be an int, got {ignore_index!r}")


def _returned(lp, H, shape, return_entropy):
    lp = lp.reshape(shape)
    return (lp, H.reshape(shape)) if return_entropy else lp


def log_probs(input, target, *, temperature=1.0, softcap=None, ignore_index=-100, return_entropy=False):
    """log_softmax(cap(input) / temperature) at each row's target, float32, without a
    (*, V) tensor of log-probabilities: what RL fine-tuning (GRPO, PPO) takes of each
    generated token.

    - input (*, V) logits, any float dtype; target (*) class indices (int64, int32, uint8).
    - softcap: logits become softcap * tanh(logits / softcap) first (as cross_entropy), then
      are divided by temperature.
    - lp is 0 where target == ignore_index; a class index out of range gives NaN (no check:
      no host wait).
    - return_entropy: also H = -sum p log p of each row's distribution (0 on ignored rows).
    Returns lp (and H) of shape (*), float32 (float64 for float64 input), differentiable in
    input through both.
    """
    refuse_dtensors("pintail.log_probs", input=input, target=target)
    name = "pintail.log_probs"
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{name}: input must be a tensor, got {type(input).__name__}")
    if not input.dtype.is_floating_point or input.dim() == 0:
        raise ValueError(f"{name}: input must be floating point logits of shape (*, classes), got {input.dtype} "
                         f"of shape {tuple(input.shape)}")
    check_target(name, target, input.shape[:-1], input.device)
    _check_options(name, temperature, softcap, ignore_index)
    if input.shape[-1] == 0:
        raise ValueError(f"{name}: input must have at least one class, got shape {tuple(input.shape)}")
    x = as_rows(input, input.dim() - 1)
    t = target.reshape(-1).contiguous()
    lp, H, _ = _log_probs_op(x, t, ignore_index, float(temperature), float(softcap or 0.0), bool(return_entropy))
    return _returned(lp, H, target.shape, return_entropy)


def linear_log_probs(input, linear_weight, target, *, linear_bias=None, temperature=1.0, softcap=None,
                     ignore_index=-100, return_entropy=False, memory_budget=None, process_group=None):
    """log_probs(linear(input, linear_weight, linear_bias), target, ...) without the logits.

    - input (*, hidden), linear_weight (classes, hidden), linear_bias (classes,), target (*).
      Under autocast input and bias take autocast's dtype (as F.linear) and a float32 head
      gets a float32 gradient.
    - Rows go in token chunks: a chunk's logits over the whole vocabulary by one GEMM into a
      reused buffer, the kernel over them; the backward makes each chunk's logits again,
      writes their gradient over them and takes dx of those rows and their share of dW
      (summed in float32) from it: four GEMMs in all, no (*, classes) tensor.
    - memory_budget: bytes of workspace (the chunk's logits, and the float32 (classes,
      hidden) sum of dW for a 16-bit head whose gradient is wanted): as many rows a chunk as
      fit. None: 1024 rows. Below the least: ValueError. A budget that holds the whole
      logits keeps them from the forward to the backward in eager mode (three GEMMs, as the
      composition; a second backward then raises).
    - process_group: a head split over the group's ranks by rows of the vocabulary, as
      linear_cross_entropy takes it: linear_weight and linear_bias are this rank's rows (in
      rank order), input and target the same on every rank. Every rank returns lp and H over
      the whole vocabulary (two all-reduces of 4 and 12 bytes a row); dW and db are its rows'
      gradients, dx is summed over the ranks (an all-reduce in the backward).
    Gradients for input, linear_weight and linear_bias, through lp and H.
    """
    refuse_dtensors("pintail.linear_log_probs", input=input, linear_weight=linear_weight, target=target,
                    linear_bias=linear_bias)
    name = "pintail.linear_log_probs"
    check_head(name, input, linear_weight, linear_bias)
    check_target(name, target, input.shape[:-1], input.device)
    _check_options(name, temperature, softcap, ignore_index)
    input, linear_bias = autocast_head(input, linear_bias)
    (V, K), M = linear_weight.shape, input.numel() // max(input.shape[-1], 1)
    x = input.reshape(M, K)
    kept = process_group is None and _keeps_logits(x, linear_weight, linear_bias, memory_budget)
    rows = 0 if kept else head_rows(name, M, V, K, x, linear_weight, memory_budget, buffers=1)
    t = target.reshape(-1).contiguous()
    options = (ignore_index, float(temperature), float(softcap or 0.0), bool(return_entropy), rows)
    if kept:
        lp, H, _ = _KeptLogits.apply(x, linear_weight.contiguous(), linear_bias, t, options)
    elif process_group is not None:
        first_class, num_classes = parallel.vocabulary_slice(process_group, V, name)
        lp, H, _ = _ParallelHead.apply(x, linear_weight, linear_bias, t, options, first_class, num_classes,
                                       process_group)
    else:
        lp, H, _ = _head_forward_op(x, linear_weight, linear_bias, t, *options)
    return _returned(lp, H, target.shape, return_entropy)
