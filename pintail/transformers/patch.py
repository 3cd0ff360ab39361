"""pintail.patch: pintail's kernels in a Hugging Face causal language model, in place."""

import ast
import importlib
import inspect
import textwrap
import types
import warnings
from dataclasses import dataclass

import torch

from ..gated import geglu, swiglu
from ..norm import layer_norm, rms_norm
from ..rotary import apply_rotary
from .loss import base_linear, causal_lm_loss, fused_loss_forward


@dataclass(frozen=True)
class Family:
    """What pintail patches in one model family: `module`, the transformers.models package;
    `norms`, each norm class name and its output rule (NORM_FORWARDS); `rotary`, whether its
    attention calls the module's apply_rotary_pos_emb; `mlp`, its gated MLP class and whether
    it projects gate and up apart ("separate": gate_proj, up_proj) or as one ("fused":
    gate_up_proj, gate first); None for a plain MLP; `layer`, its decoder layer class and the
    form of its residual adds (LAYER_FORMS), None where no add feeds a norm (post-norm
    OLMo 2, GPT-2 and GPT-NeoX's parallel blocks)."""
    module: str
    norms: dict
    rotary: bool = True
    mlp: tuple = None
    layer: tuple = None


# Qwen3's, OLMo 2's and Gemma 3's q/k norms are modules of their norm class: patched with the others.
FAMILIES = {
    "LlamaForCausalLM": Family("llama", {"LlamaRMSNorm": "cast_then_weight"}, mlp=("LlamaMLP", "separate"),
                               layer=("LlamaDecoderLayer", "pre")),
    "MistralForCausalLM": Family("mistral", {"MistralRMSNorm": "cast_then_weight"}, mlp=("MistralMLP", "separate"),
                                 layer=("MistralDecoderLayer", "pre")),
    "Qwen2ForCausalLM": Family("qwen2", {"Qwen2RMSNorm": "cast_then_weight"}, mlp=("Qwen2MLP", "separate"),
                               layer=("Qwen2DecoderLayer", "pre")),
    "Qwen3ForCausalLM": Family("qwen3", {"Qwen3RMSNorm": "cast_then_weight"}, mlp=("Qwen3MLP", "separate"),
                               layer=("Qwen3DecoderLayer", "pre")),
    "Phi3ForCausalLM": Family("phi3", {"Phi3RMSNorm": "cast_then_weight"}, mlp=("Phi3MLP", "fused"),
                              layer=("Phi3DecoderLayer", "pre_dropout")),
    "Olmo2ForCausalLM": Family("olmo2", {"Olmo2RMSNorm": "weight_then_cast"}, mlp=("Olmo2MLP", "separate")),
    "Gemma2ForCausalLM": Family("gemma2", {"Gemma2RMSNorm": "one_plus_weight"}, mlp=("Gemma2MLP", "separate"),
                                layer=("Gemma2DecoderLayer", "sandwich")),
    "Gemma3ForCausalLM": Family("gemma3", {"Gemma3RMSNorm": "one_plus_weight"}, mlp=("Gemma3MLP", "separate"),
                                layer=("Gemma3DecoderLayer", "sandwich")),
    "GPTNeoXForCausalLM": Family("gpt_neox", {"LayerNorm": "layer_norm"}),  # partial rotary
    "GPT2LMHeadModel": Family("gpt2", {"LayerNorm": "layer_norm"}, rotary=False),
}


def _sum_dtype(x, residual):
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def _cast_then_weight(self, x, residual=None):
    """Llama: weight * normalised(x).to(x.dtype), in the dtype those two promote to. With a
    residual (a patched decoder layer): the norm of residual + x, and that sum."""
    return rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon, residual=residual,
                    out_dtype=torch.promote_types(self.weight.dtype, _sum_dtype(x, residual)))


def _weight_then_cast(self, x):
    """OLMo 2: (weight * normalised(x)).to(x.dtype)."""
    return rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)


def _one_plus_weight(self, x, residual=None):
    """Gemma: normalised(x) * (1 + weight), in float32, then x's dtype (with a residual as
    _cast_then_weight)."""
    return rms_norm(x, (x.shape[-1],), self.weight, self.eps, residual=residual, weight_offset=1.0,
                    out_dtype=_sum_dtype(x, residual))


def _layer_norm(self, x):
    return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


# The config's activation name -> (pintail function, its extra arguments); gated MLPs with
# any other activation stay on torch.
GATED_ACTIVATIONS = {"silu": (swiglu, {}), "swish": (swiglu, {}), "gelu": (geglu, {"approximate": "none"}),
                     "gelu_pytorch_tanh": (geglu, {"approximate": "tanh"}),
                     "gelu_new": (geglu, {"approximate": "tanh"})}


def _mlp_forward(form, act, options):
    """A gated MLP's forward on pintail's fused activation."""
    if form == "fused":
        def forward(self, x):
            return self.down_proj(act(self.gate_up_proj(x), **options))
    else:
        def forward(self, x):
            return self.down_proj(act(self.gate_proj(x), self.up_proj(x), **options))
    return forward


NORM_FORWARDS = {"cast_then_weight": _cast_then_weight, "weight_then_cast": _weight_then_cast,
                 "one_plus_weight": _one_plus_weight, "layer_norm": _layer_norm}


# The statements of a decoder layer's forward after its attention call, per form: the patch
# fuses the add that feeds a norm into that norm's kernel, and leaves any other layer alone.
LAYER_FORMS = {
    "pre": ["hidden_states = residual + hidden_states", "residual = hidden_states",
            "hidden_states = self.post_attention_layernorm(hidden_states)", "hidden_states = self.mlp(hidden_states)",
            "hidden_states = residual + hidden_states", "return hidden_states"],
    "pre_dropout": ["hidden_states = residual + self.resid_attn_dropout(hidden_states)", "residual = hidden_states",
                    "hidden_states = self.post_attention_layernorm(hidden_states)",
                    "hidden_states = self.mlp(hidden_states)",
                    "hidden_states = residual + self.resid_mlp_dropout(hidden_states)", "return hidden_states"],
    "sandwich": ["hidden_states = self.post_attention_layernorm(hidden_states)",
                 "hidden_states = residual + hidden_states", "residual = hidden_states",
                 "hidden_states = self.pre_feedforward_layernorm(hidden_states)",
                 "hidden_states = self.mlp(hidden_states)", "hidden_states = self.post_feedforward_layernorm(hidden_states)",
                 "hidden_states = residual + hidden_states", "return hidden_states"],
}
LAYER_HEAD = ["residual = hidden_states", "hidden_states = self.input_layernorm(hidden_states)"]


def _layer_form_matches(layer_class, form) -> bool:
    """Whether the layer's forward is, statement by statement, the form pintail rewrites: the
    input norm, attention called with each of the layer's arguments by its own name, then
    LAYER_FORMS[form]."""
    function = inspect.unwrap(layer_class.forward)
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body
    except (OSError, TypeError, SyntaxError):
        return False
    body = [stmt for stmt in body if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))]
    if [ast.unparse(stmt) for stmt in body[:2]] != LAYER_HEAD or len(body) != 3 + len(LAYER_FORMS[form]):
        return False
    call = body[2].value if isinstance(body[2], ast.Assign) else None
    if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "self.self_attn" and not call.args):
        return False
    passed = [k.arg or "**" + ast.unparse(k.value) for k in call.keywords]
    if any(k.arg and ast.unparse(k.value) != k.arg for k in call.keywords):
        return False
    parameters = [p for p in inspect.signature(function).parameters.values() if p.name != "self"]
    expected = [p.name if p.kind != p.VAR_KEYWORD else "**" + p.name for p in parameters]
    return sorted(passed) == sorted(expected) and [ast.unparse(s) for s in body[3:]] == LAYER_FORMS[form]


def _layer_forward(layer_class, form):
    """The decoder layer's forward with the residual add before a norm fused into that
    norm's kernel (rms_norm(..., residual=)): its backward adds the residual stream's
    gradient in the same pass. Arguments go to attention by name, as the original passes them."""
    signature = inspect.signature(inspect.unwrap(layer_class.forward))
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD), None)

    def forward(self, hidden_states, *args, **kwargs):
        if args:  # positional arguments take their names from the original signature
            arguments = signature.bind(self, hidden_states, *args, **kwargs).arguments
            kwargs = {**arguments.pop(var_keyword, {}), **arguments} if var_keyword else arguments
            for name in ("self", "hidden_states"):
                kwargs.pop(name)
        residual = hidden_states
        attended = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)[0]
        if form == "sandwich":
            normed, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(attended),
                                                              residual=residual)
            return residual + self.post_feedforward_layernorm(self.mlp(normed))
        if form == "pre_dropout":
            attended = self.resid_attn_dropout(attended)
        normed, residual = self.post_attention_layernorm(attended, residual=residual)
        out = self.mlp(normed)
        return residual + (self.resid_mlp_dropout(out) if form == "pre_dropout" else out)

    return forward


_FUSED_LAYER_CLASSES = {}


def _fused_layer_class(cls, forward):
    """A subclass of the decoder layer's class (same name) whose forward is the fused one: it
    goes where the class's own forward went, so transformers' gradient checkpointing, which
    wraps the forward of each subclass of GradientCheckpointingLayer, recomputes it (a forward
    set on the instance would run outside that wrapper, never checkpointed)."""
    if cls not in _FUSED_LAYER_CLASSES:
        _FUSED_LAYER_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                                "__qualname__": cls.__qualname__})
    return _FUSED_LAYER_CLASSES[cls]


# How many forwards of attention modules patched for rotary are running (a recomputation by
# gradient checkpointing too): the family's apply_rotary_pos_emb runs pintail's kernel only
# inside them, torch's elsewhere (an unpatched model of the same family in the process).
_ROTARY_CALLS = [0]


def _scoped_rotary(original):
    """transformers' apply_rotary_pos_emb (`original`), on pintail's fused q/k kernel inside a
    patched model's forward: cos and sin per token (batch, seq, rotary width), q and k (batch,
    heads, seq, head_dim) for unsqueeze_dim 1 or (batch, seq, heads, head_dim) for 2; features
    past the rotary width pass through (GPT-NeoX, Phi's partial rotary)."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not _ROTARY_CALLS[0] or unsqueeze_dim not in (1, 2):
            return original(q, k, cos, sin, unsqueeze_dim)
        return apply_rotary(q, k, cos, sin, layout="bhsd" if unsqueeze_dim == 1 else "bshd")

    apply_rotary_pos_emb.pintail_original = original
    return apply_rotary_pos_emb


def _rotary_forward(original):
    """An attention module's forward with pintail's rotary kernel on while it runs."""
    def forward(*args, **kwargs):
        _ROTARY_CALLS[0] += 1
        try:
            return original(*args, **kwargs)
        finally:
            _ROTARY_CALLS[0] -= 1

    return forward


def _own_class(module, names, by="__name__"):
    """The class of `module` named in `names`, also under a wrapper's subclass of it (FSDP2's
    fully_shard makes a LlamaDecoderLayer an FSDPLlamaDecoderLayer); None if none is."""
    return next((cls for cls in type(module).__mro__ if getattr(cls, by) in names), None)


def patch(model, *, norms=True, rotary=True, loss=True, mlp=True, residual=True):
    """Run pintail's kernels inside a Hugging Face causal LM (in place; returns the model).

    - norms: each norm module of the family runs pintail.rms_norm / layer_norm with the
      family's dtype rule (a forward swap: parameters, names and the state dict unchanged).
    - rotary: the family's apply_rotary_pos_emb runs pintail.apply_rotary with the model's own
      cos and sin while this model's forward runs (the function in the family's transformers
      module is replaced by one that runs torch's original outside patched models).
    - loss: with labels (and gradients on) the loss is pintail.linear_cross_entropy on the last
      hidden state, no logits (None in the output); labels shifted as transformers does,
      ignore_index -100, num_items_in_batch for gradient accumulation, Gemma's final-logit
      softcapping, float32. Without labels (generate) the logits are as before.
    - mlp: the gated MLPs (SwiGLU, Gemma's tanh GeGLU, Phi-3's fused gate_up) run pintail.swiglu /
      geglu (a forward swap); an activation pintail does not have is left to torch, with a
      warning that names it.
    - residual (with norms): in each decoder layer the residual add that feeds a norm runs in
      that norm's kernel, forward and backward (the layer becomes a subclass of its class, of
      the same name, whose forward fuses them); a layer whose forward differs from the form
      pintail rewrites stays as it is, with a warning.
    The model may be wrapped: FSDP2's fully_shard, DDP's module, a PEFT model (its base model is
    patched; an output head with LoRA adapters or in modules_to_save keeps its fused loss).
    Supported: FAMILIES. An unsupported model, or a module or function the patch expects and
    does not find, raises before anything is changed. Patching twice changes nothing more.
    """
    model_class = _own_class(model, FAMILIES)
    if model_class is None and callable(getattr(model, "get_base_model", None)):
        patch(model.get_base_model(), norms=norms, rotary=rotary, loss=loss, mlp=mlp, residual=residual)
        return model  # a PEFT model: its transformers model patched
    name = (model_class or type(model)).__name__
    family = FAMILIES.get(name)
    if family is None:
        raise TypeError(f"pintail.patch: {name} is not supported; supported: {', '.join(FAMILIES)}")
    done = getattr(model, "_pintail_patched", set())
    parts = (("norms", norms), ("rotary", rotary), ("loss", loss), ("mlp", mlp), ("residual", residual and norms))
    wanted = {part for part, on in parts if on} - done
    modeling = importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")
    changes = []
    if "norms" in wanted:
        found = [m for m in model.modules() if _own_class(m, family.norms)]
        if not found:
            raise RuntimeError(f"pintail.patch: {name} has no module of {sorted(family.norms)} to patch")
        for m in found:
            forward = types.MethodType(NORM_FORWARDS[family.norms[_own_class(m, family.norms).__name__]], m)
            changes.append(lambda m=m, forward=forward: setattr(m, "forward", forward))
    if "residual" in wanted and family.layer is not None:
        layer_class, form = family.layer
        found = [m for m in model.modules() if _own_class(m, (layer_class,))]
        if not found:
            raise RuntimeError(f"pintail.patch: {name} has no {layer_class} module to patch")
        if _layer_form_matches(_own_class(found[0], (layer_class,)), form):
            layer_forward = _layer_forward(_own_class(found[0], (layer_class,)), form)
            for m in found:
                changes.append(lambda m=m, f=layer_forward: setattr(m, "__class__", _fused_layer_class(type(m), f)))
        else:
            warnings.warn(f"pintail.patch: {name}'s {layer_class}.forward is not the form pintail fuses ({form}); "
                          f"its residual adds stay on torch", stacklevel=2)
    if "mlp" in wanted and family.mlp is not None:
        mlp_class, form = family.mlp
        found = [m for m in model.modules() if _own_class(m, (mlp_class,))]
        if not found:
            raise RuntimeError(f"pintail.patch: {name} has no {mlp_class} module to patch")
        config = getattr(model.config, "get_text_config", lambda: model.config)()
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if activation in GATED_ACTIVATIONS:
            act, options = GATED_ACTIVATIONS[activation]
            for m in found:
                forward = types.MethodType(_mlp_forward(form, act, options), m)
                changes.append(lambda m=m, forward=forward: setattr(m, "forward", forward))
        else:
            warnings.warn(f"pintail.patch: {name}'s MLP activation {activation!r} has no pintail kernel; its "
                          f"{mlp_class} modules stay on torch", stacklevel=2)
    if "loss" in wanted:
        head = model.get_output_embeddings()
        if base_linear(head) is None:
            raise RuntimeError(f"pintail.patch: {name}'s output head is {type(head).__name__}, expected nn.Linear "
                               f"(or one that PEFT adapted)")
        if "labels" not in inspect.signature(model.forward).parameters:
            raise RuntimeError(f"pintail.patch: {name}.forward takes no labels")
        softcap = getattr(model.config, "final_logit_softcapping", None)
        changes.append(lambda: setattr(model, "forward", fused_loss_forward(model, model.forward, softcap)))
        changes.append(lambda: setattr(model, "loss_function", causal_lm_loss))
    if "rotary" in wanted and family.rotary:
        original = getattr(modeling, "apply_rotary_pos_emb", None)
        if not callable(original):
            raise RuntimeError(f"pintail.patch: {name}: {modeling.__name__} has no apply_rotary_pos_emb to patch")
        attention = [m for m in model.modules() if _own_class(m, (modeling.__name__,), "__module__")
                     and "apply_rotary_pos_emb" in inspect.getsource(type(m).forward)]
        if not attention:
            raise RuntimeError(f"pintail.patch: {name} has no module whose forward calls apply_rotary_pos_emb")
        if not hasattr(original, "pintail_original"):
            changes.append(lambda: setattr(modeling, "apply_rotary_pos_emb", _scoped_rotary(original)))
        for m in attention:
            changes.append(lambda m=m: setattr(m, "forward", _rotary_forward(m.forward)))
    for change in changes:
        change()
    model._pintail_patched = done | wanted
    return model
