"""Cross-entropy over a vocabulary split across the ranks of a process group, for every loss
that takes process_group: logits split by classes (cross_entropy) or a head split by rows
(linear_cross_entropy).

Each rank holds the logits (or the head's rows) of its slice of the classes, in rank order.
A rank folds its slice into five float32 values a row with linear_cross_entropy's kernel
(max, sum of exp, the smoothing sum, the target's logit); the ranks then combine them in two
all-reduces: the max (4 bytes a row), then the rescaled sum of exp, the target's logit and
the smoothing sum about the global max (12 bytes a row). Every rank then has each row's
log-sum-exp and loss; the backward needs no communication for the logits (each rank's
gradient is its slice), and one all-reduce of dx for a column-parallel head.
"""

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.distributed.distributed_c10d import _resolve_process_group

from ._loss.chunks import fold, gradient, head_gradients, head_state, weight_total
from ._loss.kernels import STATE_COLUMNS

_SLICES = {}


def all_reduce(tensor, op, group):
    """A functional all-reduce ("sum" or "max") over the group: traced by torch.compile. Its
    result waited for: eager mode's is a wrapper subclass that a kernel launch cannot read."""
    return funcol.wait_tensor(funcol.all_reduce(tensor, op, group))


def vocabulary_slice(group, local_classes: int, name: str) -> tuple[int, int]:
    """(this rank's first class, the whole vocabulary's size): the ranks' slice sizes in rank
    order, gathered once per group and size (one host wait, then cached; under torch.compile
    at trace time, a constant of the graph)."""
    if group is None or not dist.is_initialized():
        raise ValueError(f"{name}: process_group needs torch.distributed initialised and a group, got {group!r}")
    world = dist.get_world_size(group)
    if world < 2:
        raise ValueError(f"{name}: process_group has {world} rank; call without process_group")
    return _gathered_slice(group.group_name, local_classes)


@torch.compiler.assume_constant_result
def _gathered_slice(group_name, local_classes):
    key = (group_name, local_classes)
    if key not in _SLICES:
        group = _resolve_process_group(group_name)
        sizes = [None] * dist.get_world_size(group)
        dist.all_gather_object(sizes, local_classes, group=group)
        rank = dist.get_rank(group)
        _SLICES[key] = (sum(sizes[:rank]), sum(sizes))
    return _SLICES[key]


def local_state(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, first_class: int,
                num_classes: int, smoothing: float, softcap: float) -> torch.Tensor:
    """Each row's (max, sum of exp(x - max), anchor, sum_j v_j (x_j - anchor), target logit or
    0) over this rank's logits x (M, n), classes first_class ..., float32."""
    compute = torch.promote_types(x.dtype, torch.float32)
    state = x.new_empty(x.shape[0], STATE_COLUMNS, dtype=compute)
    if x.shape[0] and x.shape[1]:
        options = (-100, smoothing, 0.0, softcap, None)
        fold(x, first_class, num_classes, target, weight, weight_total(weight, smoothing, compute), state, state,
              state, options, True, False)
    elif x.shape[0]:
        state.copy_(torch.tensor([-float("inf"), 0.0, 0.0, 0.0, 0.0], dtype=compute))
    return state


def _local_state_fake(x, target, weight, first_class, num_classes, smoothing, softcap):
    return x.new_empty(x.shape[0], STATE_COLUMNS, dtype=torch.promote_types(x.dtype, torch.float32))


_local_state_op = torch.library.custom_op("pintail::vocab_parallel_state", local_state, mutates_args=())
_local_state_op.register_fake(_local_state_fake)


def slice_gradient(grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                   stats: torch.Tensor, first_class: int, num_classes: int, ignore_index: int, smoothing: float,
                   z_scale: float, softcap: float, z_ratio: torch.Tensor | None) -> torch.Tensor:
    """This rank's slice of the gradient of the row losses (times grad) from the global
    (max, log-sum) of every row."""
    dx = x.clone(memory_format=torch.contiguous_format)
    if x.shape[0] and x.shape[1]:
        options = (ignore_index, smoothing, z_scale, softcap, z_ratio)
        gradient(dx, first_class, num_classes, target, weight, weight_total(weight, smoothing, stats.dtype), stats,
                  grad.to(stats.dtype).expand(x.shape[0]), options)
    return dx


_slice_gradient_op = torch.library.custom_op("pintail::vocab_parallel_gradient", slice_gradient, mutates_args=())
_slice_gradient_op.register_fake(lambda grad, x, *rest: torch.empty_like(x, memory_format=torch.contiguous_format))


def combine(state, local_mass, target, weight, num_classes, group, ignore_index, smoothing, z_scale, z_ratio):
    """(row losses, (max, log-sum) of every row) over the whole vocabulary, on every rank,
    from each rank's state and the sum of its classes' smoothing weights (local_mass)."""
    row_max = state[:, 0]
    global_max = all_reduce(row_max, "max", group)
    shift = torch.where(global_max == -float("inf"), 0.0, global_max)
    finite = torch.where(row_max == -float("inf"), shift, row_max)
    about_own_max = state[:, 3] - local_mass * (finite - state[:, 2])  # sum_j v_j (x_j - own max)
    packed = torch.stack([state[:, 1] * torch.exp(row_max - shift), state[:, 4],
                          about_own_max + local_mass * (finite - shift)], 1)
    total, target_logit, about_max = all_reduce(packed, "sum", group).unbind(1)
    log_sum = torch.log(total)
    lse = shift + log_sum
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < num_classes)
    safe = torch.where(in_range & ~ignored, target, 0).long()
    w_t = weight.to(lse.dtype)[safe] if weight is not None else torch.ones_like(lse)
    z = z_scale * z_ratio if z_ratio is not None else z_scale
    rows = (1 - smoothing) * w_t * ((shift - target_logit) + log_sum) + z * lse * lse
    if smoothing > 0:
        total_weight = weight.to(lse.dtype).sum() if weight is not None else num_classes
        rows = rows + smoothing / num_classes * (total_weight * log_sum - about_max)
    rows = torch.where(ignored, 0.0, rows)
    rows = torch.where(in_range | ignored, rows, float("nan"))
    return rows, torch.stack([shift, log_sum], 1)


def local_mass(weight, first_class, n, smoothing, dtype, device):
    """The sum of this rank's classes' smoothing weights (its class count without weights)."""
    if not smoothing > 0:
        return torch.zeros((), dtype=dtype, device=device)
    if weight is None:
        return torch.full((), float(n), dtype=dtype, device=device)
    return weight[first_class:first_class + n].to(dtype).sum()


class _ParallelRows(torch.autograd.Function):
    """Row losses and stats of a rank's logits slice; the backward is its gradient slice."""

    @staticmethod
    def forward(ctx, x, target, weight, options, first_class, num_classes, group):
        ignore_index, smoothing, z_scale, softcap, z_ratio = options
        state = _local_state_op(x, target, weight, first_class, num_classes, smoothing, softcap)
        mass = local_mass(weight, first_class, x.shape[1], smoothing, state.dtype, x.device)
        rows, stats = combine(state, mass, target, weight, num_classes, group, ignore_index, smoothing, z_scale,
                              z_ratio)
        ctx.save_for_backward(x, target, weight, stats, z_ratio)
        ctx.options, ctx.first_class, ctx.num_classes = options, first_class, num_classes
        ctx.mark_non_differentiable(stats)
        return rows, stats

    @staticmethod
    def backward(ctx, grad, _):
        x, target, weight, stats, z_ratio = ctx.saved_tensors
        ignore_index, smoothing, z_scale, softcap, _ = ctx.options
        dx = _slice_gradient_op(grad, x, target, weight, stats, ctx.first_class, ctx.num_classes, ignore_index,
                                smoothing, z_scale, softcap, z_ratio)
        return dx, None, None, None, None, None, None


def logits_rows(x, target, weight, options, group, name):
    """(row losses, stats) of logits rows x (M, local classes) split over `group`."""
    first_class, num_classes = vocabulary_slice(group, x.shape[1], name)
    if weight is not None and weight.shape[0] != num_classes:
        raise ValueError(f"{name}: weight must have one entry per class of the whole vocabulary ({num_classes}, "
                         f"the ranks' slices together), got {weight.shape[0]}")
    return _ParallelRows.apply(x, target, weight, options, first_class, num_classes, group), num_classes


def _head_state(x: torch.Tensor, linear_weight: torch.Tensor, linear_bias: torch.Tensor | None, target: torch.Tensor,
                weight: torch.Tensor | None, first_class: int, num_classes: int, smoothing: float, softcap: float,
                columns: int) -> torch.Tensor:
    return head_state(x, linear_weight, linear_bias, target, weight, first_class, num_classes, smoothing, softcap,
                      columns)


_head_state_op = torch.library.custom_op("pintail::vocab_parallel_head_state", _head_state, mutates_args=())
_head_state_op.register_fake(lambda x, *rest: x.new_empty(x.shape[0], STATE_COLUMNS,
                                                           dtype=torch.promote_types(x.dtype, torch.float32)))


def _head_backward(grad: torch.Tensor, x: torch.Tensor, linear_weight: torch.Tensor, linear_bias: torch.Tensor | None,
                   target: torch.Tensor, weight: torch.Tensor | None, stats: torch.Tensor, ignore_index: int,
                   smoothing: float, z_scale: float, softcap: float, z_ratio: torch.Tensor | None, columns: int,
                   need_input: bool, need_weight: bool, need_bias: bool, first_class: int, num_classes: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return head_gradients(grad, x, linear_weight, linear_bias, target, weight, stats,
                          (ignore_index, smoothing, z_scale, softcap, z_ratio), columns, need_input, need_weight,
                          need_bias, first_class, num_classes)


_head_backward_op = torch.library.custom_op("pintail::vocab_parallel_head_backward", _head_backward, mutates_args=())


@_head_backward_op.register_fake
def _head_backward_fake(grad, x, linear_weight, linear_bias, target, weight, stats, ignore_index, smoothing, z_scale,
                        softcap, z_ratio, columns, need_input, need_weight, need_bias, first_class, num_classes):
    """dx, dW, db like x, linear_weight and linear_bias, or empty where not asked for."""
    need_bias = need_bias and linear_bias is not None
    return (torch.empty_like(x) if need_input else x.new_empty(0),
            torch.empty_like(linear_weight) if need_weight else x.new_empty(0),
            torch.empty_like(linear_bias) if need_bias else x.new_empty(0))


class _ParallelHead(torch.autograd.Function):
    """Row losses and stats of a column-parallel head: this rank's rows of W (and b) over the
    full x; the backward gives this rank's dW, db and dx summed over the ranks."""

    @staticmethod
    def forward(ctx, x, linear_weight, linear_bias, target, weight, options, first_class, num_classes, group,
                columns):
        ignore_index, smoothing, z_scale, softcap, z_ratio = options
        state = _head_state_op(x, linear_weight, linear_bias, target, weight, first_class, num_classes, smoothing,
                               softcap, columns[0])
        mass = local_mass(weight, first_class, linear_weight.shape[0], smoothing, state.dtype, x.device)
        rows, stats = combine(state, mass, target, weight, num_classes, group, ignore_index, smoothing, z_scale,
                              z_ratio)
        ctx.save_for_backward(x, linear_weight, linear_bias, target, weight, stats, z_ratio)
        ctx.options, ctx.slice, ctx.group, ctx.columns = options, (first_class, num_classes), group, columns[1]
        ctx.mark_non_differentiable(stats)
        return rows, stats

    @staticmethod
    def backward(ctx, grad, _):
        x, linear_weight, linear_bias, target, weight, stats, z_ratio = ctx.saved_tensors
        ignore_index, smoothing, z_scale, softcap, _ = ctx.options
        need = ctx.needs_input_grad
        dx, dW, db = _head_backward_op(grad, x, linear_weight, linear_bias, target, weight, stats, ignore_index,
                                       smoothing, z_scale, softcap, z_ratio, ctx.columns, need[0], need[1],
                                       need[2] and linear_bias is not None, *ctx.slice)
        if need[0]:
            dx = all_reduce(dx, "sum", ctx.group)  # x feeds every rank's slice
        return (dx if need[0] else None, dW if need[1] else None, db if need[2] and linear_bias is not None else None,
                None, None, None, None, None, None, None)


def head_rows(x, linear_weight, linear_bias, target, weight, options, group, columns, name):
    """(row losses, stats) of a head whose rows are split over `group`; columns: the classes a
    chunk in the forward and in the backward (the caller's plan)."""
    first_class, num_classes = vocabulary_slice(group, linear_weight.shape[0], name)
    if weight is not None and weight.shape[0] != num_classes:
        raise ValueError(f"{name}: weight must have one entry per class of the whole vocabulary ({num_classes}, "
                         f"the ranks' slices together), got {weight.shape[0]}")
    return _ParallelHead.apply(x, linear_weight, linear_bias, target, weight, options, first_class, num_classes,
                               group, columns), num_classes
