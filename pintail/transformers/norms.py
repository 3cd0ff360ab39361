"""Norm modules: the rules pintail knows, found for a module class by trying each one against
the class's own forward (float32 values and gradients, then the output dtype of mixed
16-bit / float32 inputs, which tells where a rule casts)."""

import torch

from ..gated import swiglu
from ..norm import layer_norm, rms_norm
from .verify import agree, stand_in


def _eps(module):
    return getattr(module, "variance_epsilon", getattr(module, "eps", None))


def _sum_dtype(x, residual):
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def cast_then_weight(self, x, residual=None):
    """Llama: weight * normalised(x).to(x.dtype), in the dtype those two promote to. With a
    residual (a fused decoder layer): the norm of residual + x, and that sum."""
    return _llama_rule(x, residual, self.weight, _eps(self))


def _llama_rule(x, residual, weight, eps):
    """weight * normalised(x).to(x.dtype): one kernel where the weight is no wider than x; a
    wider weight (float32 beside 16-bit activations, as under autocast) multiplies the
    normalised row rounded to x's dtype first, as the rule does, in a second op."""
    dtype = _sum_dtype(x, residual)
    if torch.promote_types(weight.dtype, dtype) == dtype:
        return rms_norm(x, (x.shape[-1],), weight, eps, residual=residual, out_dtype=dtype)
    out = rms_norm(x, (x.shape[-1],), None, eps, residual=residual, out_dtype=dtype)
    return (weight * out[0], out[1]) if residual is not None else weight * out


def weight_then_cast(self, x, residual=None):
    """OLMo 2, gpt-oss: (weight * normalised(x)).to(x.dtype)."""
    return rms_norm(x, (x.shape[-1],), self.weight, _eps(self), residual=residual, out_dtype=_sum_dtype(x, residual))


def one_plus_weight(self, x, residual=None):
    """Gemma: normalised(x) * (1 + weight) in float32, then x's dtype."""
    return rms_norm(x, (x.shape[-1],), self.weight, _eps(self), residual=residual, weight_offset=1.0,
                    out_dtype=_sum_dtype(x, residual))


def unweighted(self, x, residual=None):
    """A norm without a weight (Gemma 4's v_norm, Llama 4's q/k norm): normalised(x).to(x.dtype)."""
    return rms_norm(x, (x.shape[-1],), None, _eps(self), residual=residual, out_dtype=_sum_dtype(x, residual))


def optional_weight(self, x, residual=None):
    """Gemma 4: normalised(x) * weight in float32 where the module has a scale, else
    normalised(x); then x's dtype."""
    weight = self.weight if getattr(self, "with_scale", True) else None
    return rms_norm(x, (x.shape[-1],), weight, _eps(self), residual=residual, out_dtype=_sum_dtype(x, residual))


def gated(self, x, gate=None):
    """Qwen3-Next's gated norm: (weight * normalised(x).to(x.dtype)) * silu(gate), in float32,
    then x's dtype: the norm's output goes into pintail.swiglu as its `up`."""
    normed = _llama_rule(x, None, self.weight, _eps(self))
    if gate is None:
        return normed
    common = torch.promote_types(gate.dtype, normed.dtype)
    return swiglu(gate.to(common), normed.to(common)).to(x.dtype)


def torch_layer_norm(self, x):
    return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def layer_norm_one_plus(self, x):
    """Nemotron: layer norm with weight + 1 (that sum in the weight's dtype, as the module's)."""
    return layer_norm(x, self.normalized_shape, self.weight + 1.0 if self.weight is not None else None, self.bias,
                      self.eps)


# Tried in this order; the first that passes is the class's rule. Residual-capable rules take
# residual= (a fused decoder layer calls them so).
RULES = {"cast_then_weight": cast_then_weight, "weight_then_cast": weight_then_cast,
         "one_plus_weight": one_plus_weight, "optional_weight": optional_weight, "unweighted": unweighted,
         "layer_norm": torch_layer_norm, "layer_norm_one_plus": layer_norm_one_plus, "gated": gated}
FUSES_RESIDUAL = {"cast_then_weight", "weight_then_cast", "one_plus_weight", "optional_weight", "unweighted"}


def is_norm(module) -> bool:
    """A leaf module named as a norm (…Norm, …RMSNorm, …LayerNorm…) or torch's LayerNorm /
    RMSNorm, with a width to normalise over."""
    if any(True for _ in module.children()):
        return False
    if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
        return True
    name = type(module).__name__
    return ("Norm" in name and "Group" not in name and "Batch" not in name and _eps(module) is not None)


def _width(module):
    weight = module._parameters.get("weight")
    if weight is not None and weight.dim() == 1:
        return weight.shape[0]
    shape = getattr(module, "normalized_shape", None) or getattr(module, "hidden_size", None) or \
        getattr(module, "dim", None)
    return shape[-1] if isinstance(shape, (tuple, list)) else shape if isinstance(shape, int) else 24


def find_rule(cls, module):
    """The name of the first rule in RULES that computes what `cls.forward` computes on
    `module`'s kind of input, or None."""
    original = cls.forward
    width = _width(module)
    probe = stand_in(module, {})
    parameters = [p for p in probe._parameters.values() if p is not None]
    x = torch.randn(3, 2, width) * 2 + 0.5
    gate = torch.randn(3, 2, width)
    takes_gate = _takes_gate(original)
    for name, rule in RULES.items():
        if (name == "gated") != takes_gate:
            continue
        inputs = [x, gate] if takes_gate else [x]
        if not agree(lambda *a: original(probe, *a), lambda *a: rule(probe, *a), inputs, parameters):
            continue
        if _same_dtypes(original, rule, probe, inputs):
            return name
    return None


def _takes_gate(forward):
    import inspect
    return "gate" in inspect.signature(forward).parameters


def _same_dtypes(original, rule, probe, inputs):
    """The rule gives the output dtype the module does for 16-bit inputs with float32
    parameters and for float32 inputs with 16-bit parameters, values within 16-bit rounding."""
    saved = {name: p for name, p in probe._parameters.items()}
    try:
        for x_dtype, p_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                 (torch.bfloat16, torch.bfloat16)):
            probe._parameters.update({name: torch.nn.Parameter(p.detach().to(p_dtype)) for name, p in saved.items()
                                      if p is not None})
            args = [t.to(x_dtype) for t in inputs]
            with torch.no_grad():
                try:
                    want = original(probe, *args)
                except RuntimeError:  # a mix the module itself refuses (torch's LayerNorm): none to match
                    continue
                got = rule(probe, *args)
            if got.dtype != want.dtype or not torch.allclose(got.double(), want.double(), rtol=2**-6, atol=2**-6):
                return False
        return True
    except Exception:
        return False
    finally:
        probe._parameters.update(saved)
