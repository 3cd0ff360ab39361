"""Drop-in nn.Module versions of the ops: same constructor arguments as torch.nn."""

import torch

from .cross_entropy import cross_entropy
from .distillation import linear_distillation_loss
from .linear_cross_entropy import linear_cross_entropy
from .log_probs import linear_log_probs, log_probs
from .norm import layer_norm, rms_norm
from .softmax import log_softmax, softmax


class Softmax(torch.nn.Softmax):
    """torch.nn.Softmax running pintail.softmax."""

    def forward(self, input):
        return softmax(input, self.dim)


class LogSoftmax(torch.nn.LogSoftmax):
    """torch.nn.LogSoftmax running pintail.log_softmax."""

    def forward(self, input):
        return log_softmax(input, self.dim)


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """torch.nn.CrossEntropyLoss running pintail.cross_entropy; the keyword-only extras of
    pintail.cross_entropy (z_loss, softcap, inplace_backward, out_dtype) can be set at construction."""

    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                 label_smoothing=0.0, *, z_loss=0.0, softcap=None, inplace_backward=False, out_dtype=None):
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.z_loss, self.softcap, self.inplace_backward = z_loss, softcap, inplace_backward
        self.out_dtype = out_dtype

    def forward(self, input, target):
        return cross_entropy(input, target, self.weight, self.ignore_index, self.reduction, self.label_smoothing,
                             z_loss=self.z_loss, softcap=self.softcap, inplace_backward=self.inplace_backward,
                             out_dtype=self.out_dtype)


class _LinearCrossEntropyLossBase(torch.nn.Module):
    """torch.nn.LinearCrossEntropyLoss's constructor and state (`linear`, the `weight` buffer)
    for a torch without it (before 2.13)."""

    def __init__(self, in_features, num_classes, *, out_features=(), bias=False, device=None, dtype=None,
                 reduction="mean", weight=None, ignore_index=None, label_smoothing=0.0, options=None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.reduction, self.num_classes, self.out_features = reduction, num_classes, out_features
        self.ignore_index, self.label_smoothing, self.options = ignore_index, label_smoothing, options
        self.linear = torch.nn.Linear(in_features, num_classes, bias=bias, device=device, dtype=dtype)


class LinearCrossEntropyLoss(getattr(torch.nn, "LinearCrossEntropyLoss", _LinearCrossEntropyLossBase)):
    """torch.nn.LinearCrossEntropyLoss running pintail.linear_cross_entropy: the same
    constructor (out_features () only) and state dict (the head is `linear`, a torch.nn.Linear;
    tie it to an embedding by assigning the embedding's weight to `linear.weight`), plus
    pintail.linear_cross_entropy's z_loss, softcap, memory_budget and out_dtype."""

    def __init__(self, in_features, num_classes, *, out_features=(), bias=False, device=None, dtype=None,
                 reduction="mean", weight=None, ignore_index=None, label_smoothing=0.0, options=None, z_loss=0.0,
                 softcap=None, memory_budget=None, out_dtype=None):
        if tuple(out_features) != ():
            raise ValueError(f"pintail.nn.LinearCrossEntropyLoss: out_features must be (), got {out_features}")
        if options is not None:
            raise ValueError("pintail.nn.LinearCrossEntropyLoss: options (torch's chunking) must be None; "
                             "memory_budget sets the chunks")
        super().__init__(in_features, num_classes, bias=bias, device=device, dtype=dtype, reduction=reduction,
                         weight=weight, ignore_index=ignore_index, label_smoothing=label_smoothing)
        self.z_loss, self.softcap, self.memory_budget, self.out_dtype = z_loss, softcap, memory_budget, out_dtype

    def forward(self, input, target):
        return linear_cross_entropy(input, self.linear.weight, target, linear_bias=self.linear.bias,
                                    weight=self.weight, reduction=self.reduction, ignore_index=self.ignore_index,
                                    label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
                                    memory_budget=self.memory_budget, out_dtype=self.out_dtype)


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm running pintail.rms_norm (same constructor, same state dict), plus
    what model norms need: weight_offset (y = x^ * (offset + weight), Gemma's 1 + weight,
    all in float32) and out_dtype (y's dtype; default the input's)."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None, *,
                 weight_offset=0.0, out_dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.weight_offset, self.out_dtype = weight_offset, out_dtype

    def forward(self, input):
        return rms_norm(input, self.normalized_shape, self.weight, self.eps, weight_offset=self.weight_offset,
                        out_dtype=self.out_dtype)


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm running pintail.layer_norm (same constructor, same state dict)."""

    def forward(self, input):
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class LogProbs(torch.nn.Module):
    """pintail.log_probs as a module: forward(logits, target) -> lp, or (lp, entropy)."""

    def __init__(self, *, temperature=1.0, softcap=None, ignore_index=-100, return_entropy=False):
        super().__init__()
        self.temperature, self.softcap, self.ignore_index = temperature, softcap, ignore_index
        self.return_entropy = return_entropy

    def forward(self, input, target):
        return log_probs(input, target, temperature=self.temperature, softcap=self.softcap,
                         ignore_index=self.ignore_index, return_entropy=self.return_entropy)


class LinearLogProbs(torch.nn.Module):
    """A language-model head (self.linear, as torch.nn.Linear) with pintail.linear_log_probs:
    forward(hidden, target) -> lp, or (lp, entropy), without the logits."""

    def __init__(self, in_features, num_classes, *, bias=False, device=None, dtype=None, temperature=1.0,
                 softcap=None, ignore_index=-100, return_entropy=False, memory_budget=None):
        super().__init__()
        self.linear = torch.nn.Linear(in_features, num_classes, bias=bias, device=device, dtype=dtype)
        self.temperature, self.softcap, self.ignore_index = temperature, softcap, ignore_index
        self.return_entropy, self.memory_budget = return_entropy, memory_budget

    def forward(self, input, target):
        return linear_log_probs(input, self.linear.weight, target, linear_bias=self.linear.bias,
                                temperature=self.temperature, softcap=self.softcap, ignore_index=self.ignore_index,
                                return_entropy=self.return_entropy, memory_budget=self.memory_budget)


class LinearDistillationLoss(torch.nn.Module):
    """pintail.linear_distillation_loss as a module: forward(input, linear_weight,
    teacher_input, teacher_weight, target=None), the heads' weights passed in (they belong to
    the student and the teacher models)."""

    def __init__(self, *, beta=0.0, temperature=1.0, ignore_index=-100, reduction="mean", memory_budget=None):
        super().__init__()
        self.beta, self.temperature, self.ignore_index = beta, temperature, ignore_index
        self.reduction, self.memory_budget = reduction, memory_budget

    def forward(self, input, linear_weight, teacher_input, teacher_weight, target=None):
        return linear_distillation_loss(input, linear_weight, teacher_input, teacher_weight, target=target,
                                        beta=self.beta, temperature=self.temperature, ignore_index=self.ignore_index,
                                        reduction=self.reduction, memory_budget=self.memory_budget)
