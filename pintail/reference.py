"""Plain PyTorch versions of the ops: the CPU path (and float64 anywhere)."""

import torch


def softmax_forward(x, dim, log, out_dtype):
    op = torch.log_softmax if log else torch.softmax
    return op(x, dim, dtype=out_dtype)


def softmax_backward(y, dy, dim, log, in_dtype):
    compute = torch.promote_types(y.dtype, torch.float32)
    y, dy = y.to(compute), dy.to(compute)
    if log:
        dx = dy - y.exp() * dy.sum(dim, keepdim=True)
    else:
        dx = y * (dy - (y * dy).sum(dim, keepdim=True))
    return dx.to(in_dtype)
