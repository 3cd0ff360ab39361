"""linear_distillation_loss: argument checks, the token-chunk loop over the student's and the
teacher's heads, and the torch.library ops with their autograd."""

import math

import torch

from .. import reference
from .._core.dtensor import refuse_dtensors
from .._core.launch import launch, no_second_derivative, row_alignment
from .._loss import chunks
from .._loss.checks import REDUCTIONS, check_head, check_target, check_temperature
from .._loss.chunks import autocast_head, head_rows
from .._loss.plans import buffer_columns
from .kernels import _distillation_kernel

NAME = "pintail.linear_distillation_loss"
BLOCK, WARPS = 2048, 4


def _rows(student, teacher, target, ignore_index, beta, temperature, loss, grad=None):
    """Each row's loss of student and teacher logits (n, V) into loss; with grad (n,), the
    gradient over the student's logits too, written over them."""
    n, V = student.shape
    if n == 0:
        return
    if not (chunks.on_kernels(student) and chunks.on_kernels(teacher)):
        loss.copy_(reference.distillation_rows(student, teacher, target, ignore_index, beta, temperature, grad))
        return
    mode = 0 if beta == 0 else 1 if beta == 1 else 2
    logs = (math.log(beta), math.log1p(-beta)) if mode == 2 else (0.0, 0.0)
    launch(_distillation_kernel, (n,), student, student.stride(0), teacher, teacher.stride(0),
           target if target is not None else loss, loss, grad if grad is not None else loss, V, ignore_index,
           1.0 / temperature, float(beta), *logs, HAS_TARGET=target is not None, MODE=mode,
           GRADIENT=grad is not None, BLOCK=min(BLOCK, max(16, 1 << (V - 1).bit_length())),
           ALIGN=row_alignment(V, student.stride(0), teacher.stride(0)), num_warps=WARPS)


def _pairs(x, linear_weight, teacher_x, teacher_weight, rows):
    """(row slice, student logits, teacher logits) of each chunk of rows (the heads padded to
    a multiple of 64 classes; the logits' first V columns are the vocabulary's)."""
    head, _ = chunks.padded_head(linear_weight, None, x.dtype)
    teacher_head, _ = chunks.padded_head(teacher_weight, None, teacher_x.dtype)
    for (chunk, student), (_, teacher) in zip(chunks.token_chunks(x, head, None, rows),
                                              chunks.token_chunks(teacher_x, teacher_head, None, rows)):
        yield chunk, student, teacher, head


def _forward(x: torch.Tensor, linear_weight: torch.Tensor, teacher_x: torch.Tensor, teacher_weight: torch.Tensor,
             target: torch.Tensor | None, ignore_index: int, beta: float, temperature: float, rows: int
             ) -> torch.Tensor:
    """Each row's loss (M,), float32 (float64 for float64 x)."""
    M, V = x.shape[0], linear_weight.shape[0]
    loss = x.new_empty(M, dtype=torch.promote_types(x.dtype, torch.float32))
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        for chunk, student, teacher, _ in _pairs(x, linear_weight, teacher_x, teacher_weight, rows):
            _rows(student[:, :V], teacher[:, :V], target[chunk] if target is not None else None, ignore_index, beta,
                  temperature, loss[chunk])
    return loss


def _backward(grad: torch.Tensor, x: torch.Tensor, linear_weight: torch.Tensor, teacher_x: torch.Tensor,
              teacher_weight: torch.Tensor, target: torch.Tensor | None, ignore_index: int, beta: float,
              temperature: float, rows: int, need_input: bool, need_weight: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW) from each row's loss gradient: both chunks' logits made again, the student's
    gradient written over its logits, dx of the chunk's rows from one GEMM and dW summed over
    the chunks in float32. A gradient not asked for is an empty tensor."""
    (M, K), V = x.shape, linear_weight.shape[0]
    compute = torch.promote_types(x.dtype, torch.float32)
    dx = x.new_empty(M, K) if need_input else x.new_empty(0)
    dW_sum = x.new_zeros(buffer_columns(V), K, dtype=compute) if need_weight else x.new_empty(0)
    grad = grad.to(compute).contiguous()
    scratch = x.new_empty(min(rows, M), dtype=compute)
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        for chunk, student, teacher, head in _pairs(x, linear_weight, teacher_x, teacher_weight, rows):
            n = chunk.stop - chunk.start
            _rows(student[:, :V], teacher[:, :V], target[chunk] if target is not None else None, ignore_index, beta,
                  temperature, scratch[:n], grad[chunk])
            if need_input:  # columns past V: zero head rows, zero logits, never written: no term
                torch.mm(student, head, out=dx[chunk])
            if need_weight:
                chunks.add_product(dW_sum, student.t(), x[chunk])
    return dx, chunks.narrowed(dW_sum[:V], linear_weight.dtype) if need_weight else dW_sum


_forward_op = torch.library.custom_op("pintail::linear_distillation", _forward, mutates_args=())
_forward_op.register_fake(lambda x, *rest: x.new_empty(x.shape[0], dtype=torch.promote_types(x.dtype, torch.float32)))
_backward_op = torch.library.custom_op("pintail::linear_distillation_backward", _backward, mutates_args=())


@_backward_op.register_fake
def _backward_fake(grad, x, linear_weight, teacher_x, teacher_weight, target, ignore_index, beta, temperature, rows,
                   need_input, need_weight):
    return (torch.empty_like(x) if need_input else x.new_empty(0),
            torch.empty_like(linear_weight) if need_weight else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, linear_weight, teacher_x, teacher_weight, target, *options = inputs
    ctx.save_for_backward(x, linear_weight, teacher_x, teacher_weight, target)
    ctx.options = tuple(options)


def _backward_of_op(ctx, grad):
    x, linear_weight, teacher_x, teacher_weight, target = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dW = _backward_op(grad, x, linear_weight, teacher_x, teacher_weight, target, *ctx.options, need[0], need[1])
    grads = (dx if need[0] else None, dW if need[1] else None)
    return (*no_second_derivative(grads, x, linear_weight, grad), None, None, None, None, None, None, None)


_forward_op.register_autograd(_backward_of_op, setup_context=_setup_context)


class _KeptLogits(torch.autograd.Function):
    """The budget holds both heads' whole logits: the forward keeps them (two GEMMs), and the
    backward writes the student's gradient over its logits and takes dx and dW from it: four
    GEMMs, where the token chunks make both logits again (six); the teacher's logits are
    made once. Eager only: under torch.compile the write into a tensor the forward kept would
    be copied by functionalization."""

    @staticmethod
    def forward(ctx, x, linear_weight, teacher_x, teacher_weight, target, options):
        ignore_index, beta, temperature = options
        M, V = x.shape[0], linear_weight.shape[0]
        loss = x.new_empty(M, dtype=torch.promote_types(x.dtype, torch.float32))
        head, _ = chunks.padded_head(linear_weight, None, x.dtype)
        teacher_head, _ = chunks.padded_head(teacher_weight, None, teacher_x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            student, teacher = x @ head.t(), teacher_x @ teacher_head.t()
            _rows(student[:, :V], teacher[:, :V], target, ignore_index, beta, temperature, loss)
        ctx.save_for_backward(x, linear_weight, target)
        ctx.logits, ctx.options = (student, teacher), options
        return loss

    @staticmethod
    def backward(ctx, grad):
        if ctx.logits is None:
            raise RuntimeError(f"{NAME}: a second backward through a call whose memory_budget kept the logits (the "
                               f"gradient was written over them); use a smaller budget with retain_graph")
        x, linear_weight, target = ctx.saved_tensors
        (student, teacher), ctx.logits = ctx.logits, None
        ignore_index, beta, temperature = ctx.options
        V = linear_weight.shape[0]
        compute = torch.promote_types(x.dtype, torch.float32)
        need = ctx.needs_input_grad
        with torch.autocast(x.device.type, enabled=False):
            _rows(student[:, :V], teacher[:, :V], target, ignore_index, beta, temperature,
                  x.new_empty(x.shape[0], dtype=compute), grad.to(compute).contiguous())
            dx = student @ chunks.padded_head(linear_weight, None, x.dtype)[0] if need[0] else None
            dW = (student.t() @ x)[:V].to(linear_weight.dtype) if need[1] else None
        return (*no_second_derivative((dx, dW), x, linear_weight, grad), None, None, None, None)


def _keeps_logits(x, linear_weight, teacher_x, memory_budget):
    """Whether the budget holds both whole logits and a backward will want them (eager)."""
    if memory_budget is None or torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    if not (x.requires_grad or linear_weight.requires_grad):
        return False
    return memory_budget >= x.shape[0] * buffer_columns(linear_weight.shape[0]) * (x.element_size()
                                                                                    + teacher_x.element_size())


def linear_distillation_loss(input, linear_weight, teacher_input, teacher_weight, *, target=None, beta=0.0,
                             temperature=1.0, ignore_index=-100, reduction="mean", memory_budget=None):
    """The divergence between a teacher's and a student's distributions over the vocabulary,
    from their hidden states and heads, without either's logits.

    Per row, p_s = softmax(input W^T / T) and p_t = softmax(teacher_input teacher_weight^T / T):
    beta 0 gives KL(p_t || p_s) (forward KL), beta 1 KL(p_s || p_t) (reverse KL), any other
    beta in (0, 1) beta KL(p_t || m) + (1 - beta) KL(p_s || m) with m = beta p_t + (1 - beta)
    p_s (the generalised Jensen-Shannon divergence; 0.5: JSD).

    - input (*, K) and linear_weight (V, K): the student; teacher_input (*, K_t) and
      teacher_weight (V, K_t): the teacher, whose gradients are never computed.
    - target (*): rows whose target is ignore_index are left out (no target: every row counts).
    - reduction: "mean" over the counted rows, "sum", or "none" (per row, float32).
    - memory_budget: bytes of workspace (a chunk of rows of both logits, and the float32 sum
      of dW for a 16-bit student head): as many rows a chunk as fit; None: 1024 rows. A
      budget that holds both whole logits keeps them from the forward to the backward in
      eager mode (four GEMMs, the teacher's logits made once; a second backward then raises).
    The rows go in token chunks over the whole vocabulary: the forward runs both GEMMs of a
    chunk and a kernel over the pair of rows; the backward runs them again, writes the
    student's gradient over its logits and takes dx and dW from it (six GEMMs in all).
    """
    refuse_dtensors("pintail.linear_distillation_loss", input=input, linear_weight=linear_weight,
                    teacher_input=teacher_input, teacher_weight=teacher_weight)
    check_head(NAME, input, linear_weight, None)
    check_head(NAME, teacher_input, teacher_weight, None, "teacher_input", "teacher_weight")
    if teacher_weight.shape[0] != linear_weight.shape[0]:
        raise ValueError(f"{NAME}: teacher_weight has {teacher_weight.shape[0]} classes, linear_weight "
                         f"{linear_weight.shape[0]}: both heads must cover the same vocabulary")
    if teacher_input.shape[:-1] != input.shape[:-1]:
        raise ValueError(f"{NAME}: teacher_input's leading shape {tuple(teacher_input.shape[:-1])} differs from "
                         f"input's {tuple(input.shape[:-1])}")
    if target is not None:
        check_target(NAME, target, input.shape[:-1], input.device)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"{NAME}: beta must be a number in [0, 1], got {beta!r}")
    check_temperature(NAME, temperature)
    if reduction not in REDUCTIONS:
        raise ValueError(f"{NAME}: {reduction!r} is not a valid value for reduction; expected one of {REDUCTIONS}")
    input, _ = autocast_head(input, None)
    teacher_input, _ = autocast_head(teacher_input, None)
    (V, K), M = linear_weight.shape, input.numel() // input.shape[-1]
    x = input.reshape(M, K)
    teacher_x = teacher_input.reshape(M, teacher_input.shape[-1])
    buffers = 1 + teacher_x.element_size() / x.element_size()
    t = target.reshape(-1).contiguous() if target is not None else None
    if _keeps_logits(x, linear_weight, teacher_x, memory_budget):
        per_row = _KeptLogits.apply(x, linear_weight.contiguous(), teacher_x.detach(), teacher_weight.detach(), t,
                                    (ignore_index, float(beta), float(temperature)))
    else:
        rows = head_rows(NAME, M, V, K, x, linear_weight, memory_budget, buffers)
        per_row = _forward_op(x, linear_weight, teacher_x.detach(), teacher_weight.detach(), t, ignore_index,
                              float(beta), float(temperature), rows)
    if reduction == "none":
        return per_row.reshape(input.shape[:-1])
    if reduction == "sum":
        return per_row.sum()
    counted = (t != ignore_index).sum() if t is not None else per_row.new_tensor(float(M))
    return per_row.sum() / counted
