"""The loss of a patched causal LM: the fused head + cross-entropy inside the output head's
call (a plain nn.Linear, a PEFT LoRA-adapted one, or one in PEFT's modules_to_save), and
transformers' loss function on pintail.cross_entropy where logits are made."""

import functools
import inspect

import torch
import torch.nn.functional as F

from .._core.dtensor import is_dtensor
from ..cross_entropy import cross_entropy
from ..linear_cross_entropy import linear_cross_entropy


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   **kwargs):
    """transformers' ForCausalLMLoss on pintail.cross_entropy: labels shifted left by one, a
    mean over the kept tokens, or a sum divided by num_items_in_batch (gradient
    accumulation); float32 from 16-bit logits without their float32 copy; the logits are
    never written to."""
    shift_labels = _shifted(labels, shift_labels, ignore_index)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device),
                         ignore_index=ignore_index, reduction=reduction, out_dtype=torch.float32)
    return _per_item(loss, num_items_in_batch)


def _shifted(labels, shift_labels, ignore_index):
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _per_item(loss, num_items_in_batch):
    if num_items_in_batch is None:
        return loss
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def base_linear(head):
    """The nn.Linear under a head that PEFT wrapped (a LoRA layer's base_layer, a
    modules_to_save wrapper's original module), or the head itself; None if there is none."""
    while not isinstance(head, torch.nn.Linear):
        head = getattr(head, "base_layer", None) or getattr(head, "original_module", None)
        if head is None:
            return None
    return head


def head_operands(head, hidden):
    """(input, weight, bias) whose linear map is the head's output on `hidden`: an nn.Linear's
    own; PEFT's modules_to_save, the active copy's; a LoRA-adapted head's W x + s B A x as
    [W, B_1, ...] [x, s A_1 x, ...] (the base weight beside each active adapter's B, the
    hidden state beside its A x, scaled): one GEMM, exactly the adapted head."""
    if isinstance(head, torch.nn.Linear):
        return hidden, head.weight, head.bias
    if hasattr(head, "modules_to_save") and hasattr(head, "original_module"):
        active = head.active_adapter if isinstance(head.active_adapter, str) else head.active_adapter[0]
        use_copy = not head.disable_adapters and active in head.modules_to_save
        return head_operands(head.modules_to_save[active] if use_copy else head.original_module, hidden)
    if not (hasattr(head, "base_layer") and hasattr(head, "lora_A")):
        raise TypeError(f"pintail.patch: an output head of type {type(head).__name__} has no fused loss")
    x, weight, bias = head_operands(head.base_layer, hidden)
    if head.disable_adapters or head.merged:
        return x, weight, bias
    inputs, weights = [x], [weight]
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        if name in getattr(head, "lora_variant", {}):
            raise NotImplementedError(f"pintail.patch: the output head's adapter {name!r} is a LoRA variant "
                                      f"({type(head.lora_variant[name]).__name__}); only plain LoRA has a fused loss")
        A, B = head.lora_A[name], head.lora_B[name]
        low_rank = A(head.lora_dropout[name](hidden.to(A.weight.dtype))) * head.scaling[name]
        inputs.append(low_rank.to(x.dtype))
        weights.append(B.weight.to(weight.dtype))
    if len(inputs) == 1:
        return x, weight, bias
    return torch.cat(inputs, -1), torch.cat(weights, 1), bias


class _HeadLoss:
    """The output head's forward. While `labels` is set, it returns the fused loss of its input
    (the last hidden state) in place of the logits: computed inside the head's own call, so
    that what wraps that call (FSDP's gathering of a sharded weight before the forward and the
    backward, and its reduction of the gradient after) sees the loss as the head's output.
    `attach` moves it to the module the model calls as its head now (PEFT wraps the head it
    was first set on)."""

    def __init__(self, softcap):
        self.head, self.head_forward, self.softcap = None, None, softcap
        self.labels, self.reduction, self.loss = None, "mean", None

    def attach(self, head):
        if head is self.head:
            return
        if self.head is not None and self.head.__dict__.get("forward") is self:
            del self.head.forward  # back to its class's forward
        self.head, self.head_forward = head, head.forward
        head.forward = self

    def __call__(self, hidden, *args, **kwargs):
        if self.labels is None:
            return self.head_forward(hidden, *args, **kwargs)
        x, weight, bias = head_operands(self.head, hidden)
        self.loss = linear_cross_entropy(x, weight, self.labels.to(x.device), linear_bias=bias,
                                         reduction=self.reduction, softcap=self.softcap, out_dtype=torch.float32)
        if not is_dtensor(weight):
            return self.loss
        # tensor parallelism's output hook redistributes what the head returns: an empty DTensor
        # of the logits' layout stands in for them (the loss is on every rank already)
        from torch.distributed.tensor import DTensor, Shard
        empty = torch.empty(*x.shape[:-1], 0, dtype=weight.dtype, device=weight.device)
        return DTensor.from_local(empty, weight.device_mesh, [Shard(x.dim() - 1)])


def fused_loss_forward(model, original, softcap):
    """The model's forward where, with labels and gradients on, the loss comes from
    pintail.linear_cross_entropy on the last hidden state, inside the head's call: the logits
    are never made (the output's logits are None). Without labels, or without gradients
    (evaluation, which wants logits), the model's own forward runs, its loss on
    pintail.cross_entropy."""
    signature = inspect.signature(original)
    head_loss = _HeadLoss(softcap)
    head_loss.attach(model.get_output_embeddings())

    @functools.wraps(original)  # its signature too: the Trainer keeps the dataset columns the forward names
    def forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        labels = bound.arguments.get("labels")
        if labels is None or not torch.is_grad_enabled() or bound.arguments.get("logits_to_keep", 0) not in (0, None):
            return original(*args, **kwargs)
        extra = dict(bound.arguments.get("kwargs", {}))
        bound.arguments["labels"] = None
        num_items = extra.get("num_items_in_batch")
        head_loss.attach(model.get_output_embeddings())
        head_loss.labels = _shifted(labels, extra.get("shift_labels"), -100)
        head_loss.reduction = "sum" if num_items is not None else "mean"
        try:
            output = original(*bound.args, **bound.kwargs)
        finally:
            head_loss.labels = None
        loss, head_loss.loss = head_loss.loss, None
        if loss is None:
            raise RuntimeError(f"pintail.patch: {type(model).__name__}'s forward did not call its output head")
        loss = _per_item(loss, num_items)
        if isinstance(output, tuple):
            return (loss, None, *output[1:])
        output["loss"] = loss
        output["logits"] = None
        return output

    return forward
