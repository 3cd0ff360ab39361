"""Gated MLPs: down(act(gate(x)) * up(x)) with gate and up as two projections or as the two
halves of one (gate first), the activation SiLU, exact GELU or tanh GELU. A module class's
form and activation are found by running its own forward and each candidate on a stand-in
with small projections."""

import copy

import torch

from ..gated import geglu, swiglu
from .loss import base_linear
from .projections import joined_projection
from .verify import agree, stand_in

# name -> (pintail function, its keyword arguments)
ACTIVATIONS = {"silu": (swiglu, {}), "gelu": (geglu, {"approximate": "none"}),
               "gelu_tanh": (geglu, {"approximate": "tanh"})}
# the config's activation name -> the candidate tried first
HINTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
         "gelu_fast": "gelu_tanh"}


def gated_mlp_form(module):
    """"separate" (gate_proj, up_proj, down_proj), "fused" (gate_up_proj, down_proj), or None:
    the projections nn.Linear (or one that PEFT adapted)."""
    def linear(name):
        child = getattr(module, name, None)
        return isinstance(child, torch.nn.Module) and base_linear(child) is not None

    if linear("down_proj") and linear("gate_proj") and linear("up_proj"):
        return "separate"
    if linear("down_proj") and linear("gate_up_proj"):
        return "fused"
    return None


def mlp_forward(form, activation):
    act, options = ACTIVATIONS[activation]
    if form == "fused":
        def forward(self, x):
            return self.down_proj(act(self.gate_up_proj(x), **options))
    else:
        def forward(self, x):
            gate_up = joined_projection(x, self.gate_proj, self.up_proj)
            if gate_up is not None:
                return self.down_proj(act(gate_up, **options))
            return self.down_proj(act(self.gate_proj(x), self.up_proj(x), **options))
    return forward


def find_activation(cls, module, form, hint=None):
    """The activation under which mlp_forward(form, ·) computes what `cls.forward` computes on
    a stand-in of `module` (hidden 16, intermediate 24), or None."""
    hidden, inner = 16, 24

    def small(name, n_in, n_out):
        return torch.nn.Linear(n_in, n_out, bias=base_linear(getattr(module, name)).bias is not None)

    children = {"down_proj": small("down_proj", inner, hidden)}
    if form == "fused":
        children["gate_up_proj"] = small("gate_up_proj", hidden, 2 * inner)
    else:
        children.update(gate_proj=small("gate_proj", hidden, inner), up_proj=small("up_proj", hidden, inner))
    probe = stand_in(module, children)
    parameters = [p for child in children.values() for p in child.parameters()]
    return _first_agreeing(lambda t: cls.forward(probe, t), lambda name: mlp_forward(form, name), probe,
                           _wide_range(2, 3, hidden), parameters, hint)


def gate_function(activation):
    """A mixture-of-experts module's _apply_gate (transformers' grouped and batched experts
    paths call it on each token's gate_up projection, gate first) on pintail's fused activation."""
    act, options = ACTIVATIONS[activation]

    def apply_gate(self, gate_up):
        return act(gate_up, **options)
    return apply_gate


def find_gate_activation(cls, module, hint=None):
    """The activation under which gate_function computes what `cls._apply_gate` computes (on
    a copy of the module without its parameters: the gate reads none), or None."""
    probe = copy.copy(module)
    probe._parameters = {}
    return _first_agreeing(lambda t: cls._apply_gate(probe, t), gate_function, probe, _wide_range(5, 2 * 12), (),
                           hint)


def _first_agreeing(reference, method_for, probe, x, parameters, hint):
    """The first activation (the config's hint first) whose method, on probe, agrees with
    reference on x, or None."""
    for name in sorted(ACTIVATIONS, key=lambda name: name != HINTS.get(hint)):
        method = method_for(name)
        if agree(reference, lambda t: method(probe, t), [x], parameters):
            return name
    return None


def _wide_range(*shape):
    """Random inputs with some large entries: a clamp inside a module's activation (DeepSeek-V4's
    and gpt-oss's swiglu_limit) acts only on values past it."""
    x = torch.randn(*shape) * 3
    x.view(-1)[::7] *= 40
    return x
