"""The loss of a patched causal LM: the fused head + cross-entropy inside the output head's
call (a plain nn.Linear, a PEFT LoRA-adapted one, or one in PEFT's modules_to_save), and
transformers' loss function on pintail.cross_entropy where logits are made."""

import ast
import functools
import inspect
import textwrap

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

    def __init__(self, softcap, scale):
        self.head, self.head_forward, self.softcap, self.scale = None, None, softcap, scale
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
        if self.scale != 1:  # logits * s = (x * s) W^T (+ s b)
            x, bias = x * self.scale, bias * self.scale if bias is not None else None
        self.loss = linear_cross_entropy(x, weight, self.labels.to(x.device), linear_bias=bias,
                                         reduction=self.reduction, softcap=self.softcap, out_dtype=torch.float32)
        if not is_dtensor(weight):
            return self.loss
        # tensor parallelism's output hook redistributes what the head returns: an empty DTensor
        # of the logits' layout stands in for them (the loss is on every rank already)
        from torch.distributed.tensor import DTensor, Shard
        empty = torch.empty(*x.shape[:-1], 0, dtype=weight.dtype, device=weight.device)
        return DTensor.from_local(empty, weight.device_mesh, [Shard(x.dim() - 1)])


def fused_loss_forward(model, original, softcap, scale=1.0):
    """The model's forward where, with labels and gradients on, the loss comes from
    pintail.linear_cross_entropy on the last hidden state, inside the head's call: the logits
    are never made (the output's logits are None). Without labels, or without gradients
    (evaluation, which wants logits), the model's own forward runs, its loss on
    pintail.cross_entropy."""
    signature = inspect.signature(original)
    head_loss = _HeadLoss(softcap, scale)
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
        aux_loss = output.get("aux_loss") if isinstance(output, dict) else None
        if aux_loss is not None and hasattr(model, "router_aux_loss_coef"):  # as the MoE models add it
            loss = loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
        if isinstance(output, tuple):
            return (loss, None, *output[1:])
        output["loss"] = loss
        output["logits"] = None
        return output

    return forward


def logit_transform(model, model_class):
    """(scale, softcap) such that the forward's logits are softcap(scale * head(hidden)), read
    from the statements of the forward between its output head's call and its loss: a
    multiplier or divisor of config values (Granite's logits_scaling, Falcon-H1's
    lm_head_multiplier) and Gemma's final-logit softcapping. None if the forward does
    anything else to the logits, or calls no head."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(model_class.forward)))).body[0].body
    except (OSError, TypeError, SyntaxError):
        return None
    try:
        return _read_transform(model, body)
    except (AttributeError, KeyError, TypeError, ValueError):  # a value it cannot read: not a form pintail reads
        return None


def _read_transform(model, body):
    scale, softcap, seen_head, names = 1.0, None, False, {}
    for stmt in body:
        text = ast.unparse(stmt)
        if not seen_head:
            head = _head_assignment(stmt)
            if head is not None:
                seen_head = True
                if head is not True:
                    scale *= _value(model, head, names)
            continue
        if "labels" in text or "loss" in text:
            return scale, softcap
        if "logits" not in text:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                names[stmt.targets[0].id] = stmt.value  # a value a later statement may name
            continue
        value = _scaling(stmt)
        if value is not None:
            factor = _value(model, value[1], names)
            scale = scale * factor if value[0] == "*" else scale / factor
        elif isinstance(stmt, ast.If) and _softcap_block(stmt):
            cap = stmt.test.left
            if isinstance(cap, ast.NamedExpr):  # if (cap := ...) is not None:
                names[cap.target.id], cap = cap.value, cap.value
            softcap = _value(model, cap, names) or None
        else:
            return None
    return None


def _head_assignment(stmt):
    """For `logits = self.lm_head(...)` True, for `logits = self.lm_head(...) * <expr>` the
    expression; else None."""
    if not (isinstance(stmt, ast.Assign) and [ast.unparse(t) for t in stmt.targets] == ["logits"]):
        return None
    value = stmt.value
    is_head = lambda node: isinstance(node, ast.Call) and ast.unparse(node.func) == "self.lm_head"  # noqa: E731
    if is_head(value):
        return True
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult) and is_head(value.left):
        return value.right
    return None


def _scaling(stmt):
    """('*' or '/', expression) for `logits = logits * <expr>` or `logits = logits / <expr>`."""
    if isinstance(stmt, ast.Assign) and [ast.unparse(t) for t in stmt.targets] == ["logits"] and \
            isinstance(stmt.value, ast.BinOp) and ast.unparse(stmt.value.left) == "logits" and \
            isinstance(stmt.value.op, (ast.Mult, ast.Div)):
        return ("*" if isinstance(stmt.value.op, ast.Mult) else "/"), stmt.value.right
    return None


def _softcap_block(stmt):
    """`if <cap> is not None:` then logits = logits / <cap>; tanh; * <cap>."""
    test = stmt.test
    if not (isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.IsNot) and not stmt.orelse):
        return False
    cap = test.left.target if isinstance(test.left, ast.NamedExpr) else test.left
    cap = ast.unparse(cap)
    return [ast.unparse(s) for s in stmt.body] == [f"logits = logits / {cap}", "logits = torch.tanh(logits)",
                                                   f"logits = logits * {cap}"]


def _value(model, node, names):
    """The value of an expression of attributes, argument-free calls and getattr on `self`
    (and of local names bound to such expressions)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id == "self":
            return model
        return _value(model, names[node.id], names)
    if isinstance(node, ast.Attribute):
        return getattr(_value(model, node.value, names), node.attr)
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and not node.keywords:
        args = [_value(model, a, names) for a in node.args]
        return getattr(*args)
    if isinstance(node, ast.Call) and not node.args and not node.keywords:
        return _value(model, node.func, names)()
    raise ValueError(f"pintail.patch: cannot evaluate {ast.unparse(node)}")
