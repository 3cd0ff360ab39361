"""The numerical proof a part must pass before `patch` swaps it in: the module's own forward
and pintail's on the same small random input, outputs and gradients compared."""

import copy

import torch


def stand_in(module, children):
    """A shallow copy of `module` whose parameters (and buffers) are fresh random float32 CPU
    tensors: the module's own code runs on it wherever the module itself lives (a GPU, the
    meta device, shards of FSDP2), and nothing of the module is touched. `children` maps a
    child's name to a small module put in its place, so that a large layer is tried at small
    width."""
    probe = copy.copy(module)
    probe._parameters = {name: torch.nn.Parameter(_random(p.shape)) if p is not None else None
                         for name, p in module._parameters.items()}
    probe._buffers = {name: b.detach().to("cpu", torch.float32) if b is not None and b.dtype.is_floating_point
                      else b for name, b in module._buffers.items()}
    probe._modules = {**module._modules, **children}
    probe._forward_hooks, probe._forward_pre_hooks = {}, {}
    return probe


def _random(shape):
    return torch.randn(tuple(shape)) * 0.5


def agree(reference, candidate, inputs, parameters=(), *, differentiable=None, rtol=2e-5, atol=2e-5):
    """Whether candidate(*inputs) equals reference(*inputs) to float32 rounding: every output
    tensor, and the gradients of the floating inputs (those at the indices `differentiable`,
    default all) and of `parameters` for random upstream gradients. An input the reference
    itself refuses proves nothing (None); any exception in
    the candidate is a disagreement (False)."""
    def run(fn):
        leaves = [t.detach().clone().requires_grad_(differentiable is None or i in differentiable)
                  if _floating(t) else t for i, t in enumerate(inputs)]
        out = fn(*leaves)
        return leaves, [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]

    try:
        ref_leaves, ref_outs = run(reference)
    except Exception:
        return None
    try:
        our_leaves, our_outs = run(candidate)
    except Exception:  # a part the candidate cannot take is a part it does not replace
        return False
    if len(our_outs) != len(ref_outs) or any(o.shape != r.shape or o.dtype != r.dtype or not _close(o, r, rtol, atol)
                                             for o, r in zip(our_outs, ref_outs)):
        return False
    flowing = [(o, r) for o, r in zip(our_outs, ref_outs) if r.requires_grad]
    if not flowing:
        return True
    upstream = [torch.randn(r.shape).to(r.dtype) for _, r in flowing]
    wrt = [i for i, t in enumerate(ref_leaves) if _floating(t) and (differentiable is None or i in differentiable)]
    parameters = [p for p in parameters if p.requires_grad]
    ref_grads = torch.autograd.grad([r for _, r in flowing], [ref_leaves[i] for i in wrt] + parameters, upstream,
                                    allow_unused=True)
    try:
        our_grads = torch.autograd.grad([o for o, _ in flowing], [our_leaves[i] for i in wrt] + parameters, upstream,
                                        allow_unused=True)
    except Exception:
        return False
    return all((a is None) == (b is None) and (a is None or _close(b, a, rtol, atol))
               for a, b in zip(ref_grads, our_grads))


def _floating(t):
    return isinstance(t, torch.Tensor) and t.dtype.is_floating_point


def _close(ours, reference, rtol, atol):
    """Entry-wise, scaled by the reference's size: a sum of products cancels to values far
    below its terms, so the bound is relative to the largest entry."""
    ours, reference = ours.detach().double(), reference.detach().double()
    if ours.shape != reference.shape:
        return False
    scale = reference.abs().max().item() if reference.numel() else 0.0
    return bool(((ours - reference).abs() <= atol * max(scale, 1.0) + rtol * reference.abs()).all())
