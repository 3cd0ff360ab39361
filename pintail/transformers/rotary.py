"""A family's rotary function (apply_rotary_pos_emb and kin) on pintail's rotary kernel, its
form found by running the function and each candidate on random q, k, cos and sin; the
kernel runs only inside the forwards of patched models' attention modules."""

import inspect
import re
import sys

import torch

from ..rotary import apply_rotary, rotary

# How many forwards of patched attention modules are running (a recomputation by gradient
# checkpointing too): inside them the patched function runs pintail's kernel, elsewhere (an
# unpatched model of the same family in the process) torch's original.
_CALLS = [0]
KNOWN_PARAMETERS = {"cos", "sin", "position_ids", "unsqueeze_dim"}


def _half(cos, sin):
    """Llama / GPT-NeoX: pairs (i, i + w/2) over the first w = cos width features."""
    return cos, sin, False, False


def _half_width(cos, sin):
    """gpt-oss: the same rotation, cos and sin given for the first half of the pairs only."""
    return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), False, False


def _interleaved(cos, sin):
    """GLM-4: pairs (2i, 2i + 1) over the first w features, their angles the first w/2 columns."""
    half = cos.shape[-1] // 2
    return cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1), True, False


def _interleaved_columns(cos, sin):
    """GLM-4V: pairs (2i, 2i + 1), each feature its own column of cos and sin."""
    return cos, sin, True, False


def _interleaved_tail(cos, sin):
    """DeepSeek-V4: pairs (2i, 2i + 1) over the last 2w features, a column a pair."""
    return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1), True, True


# name -> (cos, sin) -> (cos, sin, interleaved, on the last features rather than the first)
FORMS = {"half": _half, "half_width": _half_width, "interleaved": _interleaved,
         "interleaved_columns": _interleaved_columns, "interleaved_tail": _interleaved_tail}


def rotary_functions(module_class):
    """(python module, name) of each apply_rotary* function the class's forward calls from its
    own modeling module."""
    try:
        source = inspect.getsource(module_class.forward)
    except (OSError, TypeError):
        return []
    python_module = sys.modules[module_class.__module__]
    names = sorted(set(re.findall(r"\b(apply_rotary\w*)\(", source)))
    return [(python_module, name) for name in names if underlying(getattr(python_module, name, None)) is not None]


def underlying(function):
    """The Python function behind a module's rotary attribute: itself, or the one that the
    `kernels` package's hub decorator wraps in a module (as transformers marks it), or None."""
    function = getattr(function, "pintail_original", function)
    if inspect.isfunction(function):
        return function
    forward = getattr(type(function), "forward", None)
    if isinstance(function, torch.nn.Module) and inspect.isfunction(forward):
        wrapped = inspect.getclosurevars(forward).nonlocals.get("func")
        return wrapped if inspect.isfunction(wrapped) else None
    return None


COMPLEX = ["xq", "xk", "freqs_cis"]  # Llama 4: the angles as complex numbers, a pair each


def _arity(function):
    """2 for f(q, k, cos, sin, ...), 1 for f(x, cos, sin, ...), None for another signature."""
    names = list(inspect.signature(function).parameters)
    if names == COMPLEX:
        return 2
    for arity in (2, 1):
        if names[arity:arity + 2] == ["cos", "sin"] and set(names[arity + 2:]) <= KNOWN_PARAMETERS:
            return arity
    return None


def candidate(function, form):
    """pintail's kernel in `function`'s signature, cos and sin turned by FORMS[form]."""
    signature = inspect.signature(function)
    arity = _arity(function)

    def rotate(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        values = list(arguments.arguments.values())
        if form == "complex":  # (batch, seq, heads, dim) as Llama 4 calls it; complex angles to cos, sin
            freqs = arguments.arguments["freqs_cis"]
            cos, sin = freqs.real.repeat_interleave(2, -1), freqs.imag.repeat_interleave(2, -1)
            return apply_rotary(values[0], values[1], cos, sin, layout="bshd", interleaved=True)
        unsqueeze_dim = arguments.arguments.get("unsqueeze_dim", 1)
        if arguments.arguments.get("position_ids") is not None or unsqueeze_dim not in (1, 2):
            return function(*args, **kwargs)
        cos, sin, interleaved, tail = FORMS[form](arguments.arguments["cos"], arguments.arguments["sin"])
        layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
        if tail:  # rotate the last features: the leading ones pass through, joined after
            width = cos.shape[-1]
            rotated = [rotary(x[..., -width:], cos, sin, layout=layout, interleaved=True) for x in values[:arity]]
            joined = [torch.cat((x[..., :-width], r), -1) for x, r in zip(values, rotated)]
            return joined[0] if arity == 1 else tuple(joined)
        if arity == 1:
            return rotary(values[0], cos, sin, layout=layout, interleaved=interleaved)
        return apply_rotary(values[0], values[1], cos, sin, layout=layout, interleaved=interleaved)

    return rotate


def find_form(function):
    """The FORMS entry under which pintail computes what `function` computes, for every
    layout and rotary width it accepts (q and k of 32 features, cos of 32, 16 or 8), or None."""
    from .verify import agree

    arity = _arity(function)
    if arity is None:
        return None
    if list(inspect.signature(function).parameters) == COMPLEX:
        ours = candidate(function, "complex")
        freqs = torch.polar(torch.ones(2, 5, 16), torch.randn(2, 5, 16))
        agreed = agree(function, ours, [torch.randn(2, 5, 3, 32), torch.randn(2, 5, 1, 32), freqs],
                       differentiable=range(2))
        return "complex" if agreed else None
    takes_layout = "unsqueeze_dim" in inspect.signature(function).parameters
    for form in FORMS:
        results = []
        for unsqueeze_dim in ((1, 2) if takes_layout else (None,)):
            for width in (32, 16, 8):
                shape = (2, 3, 5, 32) if unsqueeze_dim in (1, None) else (2, 5, 3, 32)
                tensors = [torch.randn(shape), torch.randn(shape[:1] + (1,) + shape[2:] if unsqueeze_dim != 2
                                                           else shape[:2] + (1,) + shape[3:])][:arity]
                cos, sin = torch.randn(2, 5, width), torch.randn(2, 5, width)
                extra = {} if unsqueeze_dim is None else {"unsqueeze_dim": unsqueeze_dim}
                ours = candidate(function, form)
                results.append(agree(lambda *a: function(*a, **extra), lambda *a: ours(*a, **extra),
                                     [*tensors, cos, sin], differentiable=range(arity)))
        if True in results and False not in results:
            return form
    return None


def install(python_module, name, form):
    """Replace the rotary function `name` of `python_module` by pintail's kernel inside patched
    attention forwards (torch's elsewhere): the module attribute where it is a function; where
    the `kernels` package wrapped it in a module (transformers' hub decorator), that module's
    forward, so that the attribute stays what transformers' decorators expect."""
    target = getattr(python_module, name)
    if isinstance(target, torch.nn.Module):
        if not hasattr(target.__dict__.get("forward"), "pintail_original"):
            own = type(target).forward
            target.forward = _scoped(lambda *args, **kwargs: own(target, *args, **kwargs), underlying(target), form)
    elif not hasattr(target, "pintail_original"):
        setattr(python_module, name, _scoped(target, target, form))


def _scoped(original, function, form):
    ours = candidate(function, form)

    def scoped(*args, **kwargs):
        return (ours if _CALLS[0] else original)(*args, **kwargs)

    scoped.pintail_original = original
    scoped.__name__ = function.__name__
    return scoped


def attention_forward(original):
    """An attention module's forward with pintail's rotary kernel on while it runs."""
    def forward(*args, **kwargs):
        _CALLS[0] += 1
        try:
            return original(*args, **kwargs)
        finally:
            _CALLS[0] -= 1

    return forward
