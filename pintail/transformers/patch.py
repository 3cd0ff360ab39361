"""pintail.patch: pintail's kernels inside a Hugging Face language model, in place.

Every part is found by structure in the language model (its norms, its decoder layers'
residual adds, its gated MLPs, its rotary function, its output head) and proven equal to
what it replaces on a small random input before it is swapped in. FAMILIES says, per
model_type, what a patch must find; a family not listed gets what is found."""

import inspect
import logging
import types
import warnings

from . import layers, mlp as mlps, norms as norm_rules, projections, rotary as rotaries
from .families import FAMILIES
from .loss import base_linear, causal_lm_loss, fused_loss_forward, logit_transform

log = logging.getLogger("pintail")


def _own_class(module, test):
    """The first class in the module's hierarchy that passes `test`: a wrapper's subclass
    (FSDP2's FSDPLlamaDecoderLayer) resolves to the class it wraps."""
    return next((cls for cls in type(module).__mro__ if test(cls)), None)


def _transformers_class(module):
    return _own_class(module, lambda cls: cls.__module__.startswith("transformers.models."))


def _config_value(config, name):
    text = getattr(config, "get_text_config", lambda: config)()
    return getattr(text, name, getattr(config, name, None))


class _Plan:
    """What a patch finds (the summary) and the changes that apply it."""

    def __init__(self):
        self.summary = {"norms": {}, "residual": {}, "mlp": {}, "joined": {}, "rotary": {}, "loss": None,
                        "torch": {}}
        self.changes = []

    def keep(self, what, why):
        self.summary["torch"][what] = why


def _norm_key(m):
    """A norm's class name, and whether it has no weight (one class may have both kinds)."""
    return _norm_class(m).__name__ + (" (no weight)" if m._parameters.get("weight") is None else "")


def _norm_class(m):
    return _own_class(m, lambda c: "forward" in vars(c))


def _plan_norms(plan, decoder):
    rules = {}
    for m in decoder.modules():
        if not norm_rules.is_norm(m):
            continue
        cls, key = _norm_class(m), _norm_key(m)
        if key not in rules:
            rules[key] = norm_rules.find_rule(cls, m)
        if rules[key] is None:
            continue
        forward = types.MethodType(norm_rules.RULES[rules[key]], m)
        plan.changes.append(lambda m=m, forward=forward: setattr(m, "forward", forward))
    for key, rule in rules.items():
        if rule is None:
            plan.keep(f"norm {key}", "its forward matches no rule of pintail's")
        else:
            plan.summary["norms"][key] = rule
    return rules


def _plan_residual(plan, decoder, rules):
    seen = {}
    for m in decoder.modules():
        cls = _transformers_class(m)
        if cls is None or "DecoderLayer" not in cls.__name__ and "Block" not in cls.__name__ \
                and not cls.__name__.endswith("Layer"):
            continue
        if cls not in seen:
            seen[cls] = layers.layer_form(cls)
            form = seen[cls]
            if form is None:
                if layers.starts_as_pre_norm(cls):
                    plan.keep(f"residual {cls.__name__}", "its forward is not a form pintail fuses")
                continue
            # the norm that takes the residual: before the MLP
            norm = getattr(m, layers.SANDWICH_NAMES[form][1] if form in layers.SANDWICH_NAMES
                           else "post_attention_layernorm", None)
            rule = rules.get(_norm_key(norm)) if norm is not None else None
            if rule not in norm_rules.FUSES_RESIDUAL:
                plan.keep(f"residual {cls.__name__}", "its norm before the MLP takes no residual in pintail")
                seen[cls] = None
                continue
            plan.summary["residual"][cls.__name__] = form
        if seen[cls] is not None:
            forward = layers.layer_forward(cls, seen[cls])
            plan.changes.append(lambda m=m, f=forward: setattr(m, "__class__", layers.fused_layer_class(type(m), f)))


def _plan_mlp(plan, decoder, config, join):
    found = {}
    hint = _config_value(config, "hidden_activation") or _config_value(config, "hidden_act")
    hint = hint if isinstance(hint, str) else None
    for m in decoder.modules():
        form = mlps.gated_mlp_form(m)
        cls = _transformers_class(m)
        if form is None or cls is None:
            continue
        if cls not in found:
            found[cls] = mlps.find_activation(cls, m, form, hint)
            if found[cls] is None:
                plan.keep(f"mlp {cls.__name__}", "its activation has no pintail kernel")
            else:
                plan.summary["mlp"][cls.__name__] = f"{found[cls]} {form}"
        if found[cls] is not None:
            forward = types.MethodType(mlps.mlp_forward(form, found[cls]), m)
            plan.changes.append(lambda m=m, forward=forward: setattr(m, "forward", forward))
            if join and form == "separate" and projections.can_join(m.gate_proj, m.up_proj):
                plan.summary["joined"][cls.__name__] = "gate_proj + up_proj"
                plan.changes.append(lambda m=m: projections.join(m.gate_proj, m.up_proj))
    gates = {}
    for m in decoder.modules():
        cls = _transformers_class(m)
        if cls is None or not callable(getattr(cls, "_apply_gate", None)) or not getattr(m, "has_gate", False):
            continue
        if cls not in gates:
            gates[cls] = mlps.find_gate_activation(cls, m, hint)
            if gates[cls] is None:
                plan.keep(f"experts {cls.__name__}", "its gate has no pintail kernel")
            else:
                plan.summary["mlp"][cls.__name__] = f"{gates[cls]} experts"
        if gates[cls] is not None:
            gate = types.MethodType(mlps.gate_function(gates[cls]), m)
            plan.changes.append(lambda m=m, gate=gate: setattr(m, "_apply_gate", gate))
    for m in decoder.modules():
        name = type(m).__name__
        if name.endswith("Experts") and _transformers_class(m) not in gates:
            plan.keep(f"experts {name}", "mixture-of-experts experts of a form pintail has no kernel for")


def _plan_rotary(plan, decoder):
    forms, attention = {}, []
    for m in decoder.modules():
        cls = _transformers_class(m)
        if cls is None:
            continue
        functions = rotaries.rotary_functions(cls)
        for python_module, name in functions:
            key = (python_module, name)
            if key not in forms:
                function = getattr(python_module, name)
                forms[key] = rotaries.find_form(rotaries.underlying(function))
                if forms[key] is None:
                    plan.keep(f"rotary {name}", "its form has no pintail kernel")
                    continue
                plan.summary["rotary"][name] = forms[key]
                plan.changes.append(lambda p=python_module, n=name, form=forms[key]: rotaries.install(p, n, form))
        if any(forms.get(key) for key in functions):
            attention.append(m)
    for m in attention:
        plan.changes.append(lambda m=m: setattr(m, "forward", rotaries.attention_forward(m.forward)))


def _plan_loss(plan, model, name):
    head = model.get_output_embeddings()
    if base_linear(head) is None or "labels" not in inspect.signature(model.forward).parameters:
        plan.keep("loss", "no nn.Linear output head with labels")
        return
    transform = logit_transform(model, _transformers_class(model))
    if transform is None:
        plan.keep("loss", f"{name}.forward is not a form pintail fuses (the output head called on the last hidden "
                          f"state, then only scaled or softcapped)")
        plan.changes.append(lambda: setattr(model, "loss_function", causal_lm_loss))
        return
    scale, softcap = transform
    plan.summary["loss"] = "fused" + (", softcap" if softcap is not None else "") + (", scaled" if scale != 1 else "")
    plan.changes.append(lambda: setattr(model, "forward", fused_loss_forward(model, model.forward, softcap, scale)))
    plan.changes.append(lambda: setattr(model, "loss_function", causal_lm_loss))


def patch(model, *, norms=True, rotary=True, loss=True, mlp=True, residual=True, join_projections=True,
          strict=False):
    """Run pintail's kernels inside a Hugging Face language model (in place; returns the model,
    with what was done in `model.pintail_summary`).

    - norms: each norm module of the language model runs pintail.rms_norm / layer_norm under
      the rule its class's forward follows (weight before or after the cast, 1 + weight, no
      weight, gated by silu, LayerNorm, Nemotron's weight + 1): a forward swap, so
      parameters, names and the state dict are unchanged.
    - residual (with norms): in each decoder layer of a form pintail knows (pre-norm, with
      dropouts, sandwich), the residual add that feeds a norm runs in that norm's kernel.
    - mlp: gated MLPs (two projections or one fused gate_up) run pintail.swiglu / geglu.
    - join_projections (with mlp): a gated MLP's gate_proj and up_proj weights move into one
      storage (each parameter keeps its name, values and place in the state dict), so their
      forward is one GEMM and their backward two, with no add of two input gradients.
      Plain bias-free nn.Linears only (not PEFT's, FSDP2's or quantised ones); a model moved
      or cast after the patch runs them apart again, as it does under torch.compile.
    - rotary: the model's apply_rotary_pos_emb (its form: halves, gpt-oss's half-width angles,
      GLM's interleaved pairs; partial widths) runs pintail's kernel while this model's
      attention runs (elsewhere torch's original).
    - loss: with labels and gradients on, the loss is pintail.linear_cross_entropy inside the
      output head's call, the logits never made (None in the output); the forward's
      softcapping and logit multipliers go into it; the MoE auxiliary loss is added as the
      model adds it. Without labels (generate) the logits are as before.
    Each part is first run against the module it replaces on a small random input (values
    and gradients to float32 rounding); a part that differs stays torch's. A warning names
    what stays torch's, where a family in FAMILIES differs from its entry, and what a family
    not in it was found to have; with strict=True that is a RuntimeError, raised before
    anything changes. The model may be
    wrapped (FSDP2, DDP's module, a PEFT model: its base model is patched). Patching twice
    changes nothing more.
    """
    model_class = _transformers_class(model)
    if model_class is None and callable(getattr(model, "get_base_model", None)):
        patch(model.get_base_model(), norms=norms, rotary=rotary, loss=loss, mlp=mlp, residual=residual,
              join_projections=join_projections, strict=strict)
        return model  # a PEFT model: its transformers model patched
    if model_class is None or not hasattr(model, "config"):
        raise TypeError(f"pintail.patch: expected a Hugging Face transformers model, got {type(model).__name__}")
    name = model_class.__name__
    done = getattr(model, "_pintail_patched", set())
    parts = (("norms", norms), ("rotary", rotary), ("loss", loss), ("mlp", mlp), ("residual", residual and norms))
    wanted = {part for part, on in parts if on} - done
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
    plan = _Plan()
    rules = {}
    if "norms" in wanted:
        rules = _plan_norms(plan, decoder)
    if "residual" in wanted:
        _plan_residual(plan, decoder, rules or _plan_norms(_Plan(), decoder))
    if "mlp" in wanted:
        _plan_mlp(plan, decoder, model.config, join_projections)
    if "rotary" in wanted:
        _plan_rotary(plan, decoder)
    if "loss" in wanted:
        _plan_loss(plan, model, name)
    _check(plan.summary, model.config.model_type, name, wanted, strict)
    for change in plan.changes:
        change()
    model._pintail_patched = done | wanted
    model.pintail_summary = _merge(getattr(model, "pintail_summary", None), plan.summary)
    log.info("pintail.patch %s: %s", name, model.pintail_summary)
    return model


PART_OF = {"norms": "norms", "residual": "residual", "mlp": "mlp", "experts": "mlp", "rotary": "rotary",
           "loss": "loss", "norm": "norms"}


def _check(summary, model_type, name, wanted, strict):
    """Warn (strict: raise) where parts stay torch's and where a family in FAMILIES differs
    from its entry; a family not in it is named as found by structure."""
    expected = FAMILIES.get(model_type)
    differing = [part for part in summary if expected is not None and part != "torch" and part in wanted
                 and _form(summary[part]) != expected[part]]
    problems = [f"differs from pintail's entry for {model_type}: {part}: expected {expected[part]!r}, "
                f"found {summary[part]!r}" for part in differing]
    left = [f"{what} ({why})" for what, why in summary["torch"].items() if PART_OF[what.split()[0]] in wanted]
    if left:
        problems.append("left to torch: " + "; ".join(left))
    if expected is None:
        found = {k: v for k, v in summary.items() if k != "torch"}
        log.info("pintail.patch: %s: %s is not in pintail's families; found by structure: %s", name, model_type, found)
        if problems:
            problems.insert(0, f"{model_type} is not in pintail's families; found by structure: {found}")
    if problems:
        message = f"pintail.patch: {name}: " + "; ".join(problems)
        if strict:
            raise RuntimeError(message)
        warnings.warn(message, stacklevel=3)


def _form(found):
    """What an entry compares: the loss's kind without the config's options (softcap, scale)."""
    return found.split(",")[0] if isinstance(found, str) else found


def _merge(old, new):
    if old is None:
        return new
    merged = {part: (dict(old[part], **new[part]) if isinstance(new[part], dict) else new[part] or old[part])
              for part in new}
    return merged
