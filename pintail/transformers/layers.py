"""Decoder layers whose residual add feeds a norm: that add runs inside the norm's kernel
(rms_norm(..., residual=)), forward and backward. A layer is rewritten only where its
forward is, statement by statement, one of the forms below."""

import ast
import inspect
import textwrap

SANDWICH_NAMES = {"sandwich": ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
                  "sandwich_glm": ("post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")}


def _sandwich(post_attention, pre_mlp, post_mlp):
    return [f"hidden_states = self.{post_attention}(hidden_states)", "hidden_states = residual + hidden_states",
            "residual = hidden_states", f"hidden_states = self.{pre_mlp}(hidden_states)",
            "hidden_states = self.mlp(hidden_states)", f"hidden_states = self.{post_mlp}(hidden_states)",
            "hidden_states = residual + hidden_states", "return hidden_states"]


# The statements of a decoder layer's forward after its attention call, per form.
LAYER_FORMS = {
    "pre": ["hidden_states = residual + hidden_states", "residual = hidden_states",
            "hidden_states = self.post_attention_layernorm(hidden_states)", "hidden_states = self.mlp(hidden_states)",
            "hidden_states = residual + hidden_states", "return hidden_states"],
    "pre_mlp_pair": ["hidden_states = residual + hidden_states", "residual = hidden_states",
                     "hidden_states = self.post_attention_layernorm(hidden_states)",
                     "hidden_states, _ = self.mlp(hidden_states)",
                     "hidden_states = residual + hidden_states", "return hidden_states"],
    "pre_scaled": ["hidden_states = residual + hidden_states * self.residual_multiplier", "residual = hidden_states",
                   "hidden_states = self.post_attention_layernorm(hidden_states)",
                   "hidden_states = self.mlp(hidden_states)",
                   "hidden_states = residual + hidden_states * self.residual_multiplier", "return hidden_states"],
    "pre_dropout": ["hidden_states = residual + self.resid_attn_dropout(hidden_states)", "residual = hidden_states",
                    "hidden_states = self.post_attention_layernorm(hidden_states)",
                    "hidden_states = self.mlp(hidden_states)",
                    "hidden_states = residual + self.resid_mlp_dropout(hidden_states)", "return hidden_states"],
    **{form: _sandwich(*names) for form, names in SANDWICH_NAMES.items()},
}
LAYER_HEAD = ["residual = hidden_states", "hidden_states = self.input_layernorm(hidden_states)"]


def layer_form(layer_class):
    """The LAYER_FORMS entry the layer's forward is, or None: the input norm, attention called
    with each of the layer's arguments by its own name, then the form's statements."""
    function = inspect.unwrap(layer_class.forward)
    body = _statements(layer_class)
    if [ast.unparse(stmt) for stmt in body[:2]] != LAYER_HEAD or len(body) < 3:
        return None
    call = body[2].value if isinstance(body[2], ast.Assign) else None
    if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "self.self_attn" and not call.args):
        return None
    passed = [k.arg or "**" + ast.unparse(k.value) for k in call.keywords]
    if any(k.arg and ast.unparse(k.value) != k.arg for k in call.keywords):
        return None
    parameters = [p for p in inspect.signature(function).parameters.values() if p.name != "self"]
    expected = [p.name if p.kind != p.VAR_KEYWORD else "**" + p.name for p in parameters]
    if sorted(passed) != sorted(expected):
        return None
    rest = [ast.unparse(s) for s in body[3:]]
    return next((form for form, statements in LAYER_FORMS.items() if rest == statements), None)


def starts_as_pre_norm(layer_class) -> bool:
    """Whether the layer's forward opens as a pre-norm block (its residual adds could feed a norm)."""
    return [ast.unparse(stmt) for stmt in _statements(layer_class)[:2]] == LAYER_HEAD


def _statements(layer_class):
    """The statements of the layer's forward, docstrings left out ([] where its source is not
    to be had)."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(layer_class.forward)))).body[0].body
    except (OSError, TypeError, SyntaxError):
        return []
    return [stmt for stmt in body if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))]


def layer_forward(layer_class, form):
    """The decoder layer's forward with the residual add before a norm fused into that norm's
    kernel: its backward adds the residual stream's gradient in the same pass. Arguments go
    to attention by name, as the original passes them."""
    signature = inspect.signature(inspect.unwrap(layer_class.forward))
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD), None)
    sandwich = SANDWICH_NAMES.get(form)

    def forward(self, hidden_states, *args, **kwargs):
        if args:  # positional arguments take their names from the original signature
            arguments = signature.bind(self, hidden_states, *args, **kwargs).arguments
            kwargs = {**arguments.pop(var_keyword, {}), **arguments} if var_keyword else arguments
            for name in ("self", "hidden_states"):
                kwargs.pop(name)
        residual = hidden_states
        attended = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)[0]
        if sandwich:
            post_attention, pre_mlp, post_mlp = (getattr(self, name) for name in sandwich)
            normed, residual = pre_mlp(post_attention(attended), residual=residual)
            return residual + post_mlp(self.mlp(normed))
        if form == "pre_dropout":
            attended = self.resid_attn_dropout(attended)
        if form == "pre_scaled":  # Granite
            attended = attended * self.residual_multiplier
        normed, residual = self.post_attention_layernorm(attended, residual=residual)
        out = self.mlp(normed)
        if form == "pre_mlp_pair":
            out = out[0]
        if form == "pre_scaled":
            return residual + out * self.residual_multiplier
        return residual + (self.resid_mlp_dropout(out) if form == "pre_dropout" else out)

    return forward


_FUSED_LAYER_CLASSES = {}


def fused_layer_class(cls, forward):
    """A subclass of the decoder layer's class (same name) whose forward is the fused one: it
    goes where the class's own forward went, so transformers' gradient checkpointing, which
    wraps the forward of each subclass of GradientCheckpointingLayer, recomputes it (a forward
    set on the instance would run outside that wrapper, never checkpointed)."""
    if cls not in _FUSED_LAYER_CLASSES:
        _FUSED_LAYER_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                                "__qualname__": cls.__qualname__})
    return _FUSED_LAYER_CLASSES[cls]
