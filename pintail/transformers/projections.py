"""Two projections of one input as one GEMM: a gated MLP's gate and up, their weights made
adjacent rows of one storage at patch time (the parameters, their names and the state dict
stay as they were). The forward is one GEMM instead of two, the backward one for both
weights' gradients and one for the input's, with no add of two input gradients."""

import torch
import torch.nn.functional as F


def _plain_linear(module):
    """An nn.Linear itself (not a subclass: PEFT's, a quantised one) without bias or hooks,
    whose weight is an ordinary tensor (not meta, not a DTensor)."""
    weight = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and module.bias is None and type(weight) is torch.nn.Parameter
            and type(weight.data) is torch.Tensor and not weight.is_meta and not module._forward_hooks
            and not module._forward_pre_hooks and "forward" not in vars(module))


def can_join(first, second):
    """Whether the two projections can become one: plain, bias-free nn.Linears of one input
    size, dtype, device and requires_grad."""
    if not (_plain_linear(first) and _plain_linear(second)):
        return False
    a, b = first.weight, second.weight
    return (a.shape[1] == b.shape[1] and a.dtype == b.dtype and a.device == b.device
            and a.requires_grad == b.requires_grad)


def join(first, second):
    """Move the two weights into one (rows of first, then second) storage, in place: each
    Parameter keeps its identity, name and values."""
    joined = torch.cat([first.weight.detach(), second.weight.detach()])
    rows = first.weight.shape[0]
    first.weight.data, second.weight.data = joined[:rows], joined[rows:]


def joined_weight(a, b):
    """[a; b] as one view when b's rows follow a's in one storage (a model moved or cast
    after the patch has them apart again: None)."""
    if a.dim() != 2 or not (a.is_contiguous() and b.is_contiguous()) or a.shape[1] != b.shape[1] \
            or a.dtype != b.dtype or a.device != b.device or a.untyped_storage().data_ptr() \
            != b.untyped_storage().data_ptr() or b.storage_offset() != a.storage_offset() + a.numel():
        return None
    return a.detach().as_strided((a.shape[0] + b.shape[0], a.shape[1]), a.stride(), a.storage_offset())


class _JoinedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, b, joined):
        device = x.device.type
        if torch.is_autocast_enabled(device) and x.dtype != torch.float64:  # as autocast's F.linear casts
            dtype = torch.get_autocast_dtype(device)
            x, joined = x.to(dtype), joined.to(dtype)
        with torch.autocast(device, enabled=False):
            y = F.linear(x, joined)
        ctx.save_for_backward(x, joined)  # the backward's products in the same dtype, as autocast's
        ctx.rows = a.shape[0]
        return y

    @staticmethod
    def backward(ctx, dy):
        x, joined = ctx.saved_tensors
        dx = dy @ joined if ctx.needs_input_grad[0] else None
        da = db = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
            da, db = dw[:ctx.rows], dw[ctx.rows:]
        return dx, da, db, None


def joined_projection(x, first, second):
    """first(x) and second(x) side by side in the last dimension as one GEMM, where both are
    still plain and their weights joined; else None (the caller runs them apart). Eager only:
    the storage check does not trace."""
    if torch.compiler.is_compiling() or not (_plain_linear(first) and _plain_linear(second)):
        return None
    joined = joined_weight(first.weight, second.weight)
    return None if joined is None else _JoinedLinear.apply(x, first.weight, second.weight, joined)
