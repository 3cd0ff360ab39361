"""float64 end to end, every op and option: pintail computes float64 in float64 (the torch
path, on every device), so it equals torch to 1e-12 relative, forward and gradients."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import pintail
from helpers import assert_matches
from test_cross_entropy import gradient_scale, torch_cross_entropy
from test_norm import gradient_scales, torch_norm
from test_rotary import hf_rotary, widen

pytestmark = pytest.mark.uses_reference
F64 = torch.float64


def grads(outs, leaves, seed=0):
    outs = outs if isinstance(outs, tuple) else (outs,)
    generator = torch.Generator().manual_seed(seed)
    ups = [torch.randn(o.shape, generator=generator, dtype=F64).to(o.device) for o in outs]
    return torch.autograd.grad(outs, leaves, ups)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_softmax(log, dim, device):
    x = (torch.randn(5, 7, 9, dtype=F64, device=device) * 4).requires_grad_()
    ours, theirs = (pintail.log_softmax, torch.log_softmax) if log else (pintail.softmax, torch.softmax)
    y, y_ref = ours(x, dim), theirs(x, dim)
    assert y.dtype == F64
    assert_matches(y, y_ref)
    assert_matches(grads(y, x)[0], grads(y_ref, x)[0])


CE_OPTIONS = [dict(reduction=r, label_smoothing=e, weight=w, z_loss=z, softcap=c)
              for r, e, w, z, c in itertools.product(["mean", "sum", "none"], [0.0, 0.2], [False, True],
                                                     [0.0, 1e-3], [None, 7.0])]


@pytest.mark.parametrize("options", CE_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("targets", ["classes", "probabilities"])
def test_cross_entropy(options, targets, device):
    M, V = 11, 37
    options = dict(options)
    x = (torch.randn(M, V, dtype=F64, device=device) * 3).requires_grad_()
    if targets == "classes":
        target = torch.randint(0, V, (M,), device=device)
        target[3] = -100
    else:
        target = torch.softmax(torch.randn(M, V, dtype=F64, device=device), 1)
    if options.pop("weight"):
        options["weight"] = torch.rand(V, dtype=F64, device=device) + 0.1
    loss, z, lse = pintail.cross_entropy(x, target, return_z_loss=True, return_lse=True, **options)
    loss_ref, z_ref, lse_ref = torch_cross_entropy(x, target, **options)
    assert loss.dtype == F64
    for got, want in ((loss, loss_ref), (z, z_ref), (lse, lse_ref)):
        assert_matches(got, want)
    (dx,), (dx_ref,) = grads(loss, x), grads(loss_ref, x)
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(0), dtype=F64).to(device)
    assert_matches(dx, dx_ref, scale=gradient_scale(x.detach(), target, upstream, **options))


@pytest.mark.parametrize("kind, extras", [("rms", {}), ("rms", {"residual": True}), ("rms", {"bias": True}),
                                          ("rms", {"weight_offset": 1.0}), ("layer", {}), ("layer", {"bias": True})])
def test_norms(kind, extras, device):
    N = 40
    x = torch.randn(3, 4, N, dtype=F64, device=device, requires_grad=True)
    w = torch.randn(N, dtype=F64, device=device, requires_grad=True)
    b = torch.randn(N, dtype=F64, device=device, requires_grad=True) if extras.get("bias") else None
    r = torch.randn(3, 4, N, dtype=F64, device=device, requires_grad=True) if extras.get("residual") else None
    offset = extras.get("weight_offset", 0.0)
    eps = 1e-6
    if kind == "rms":
        out = pintail.rms_norm(x, (N,), w, eps, residual=r, bias=b, weight_offset=offset)
    else:
        out = pintail.layer_norm(x, (N,), w, b, eps)
    y_ref, h_ref = torch_norm(kind, x, (N,), w, b, eps, r, offset)
    outs, refs = ((out[0], out[1]), (y_ref, h_ref)) if r is not None else ((out,), (y_ref,))
    leaves = [t for t in (x, w, b, r) if t is not None]
    scales = gradient_scales(kind, (h_ref if h_ref is not None else x).detach(), (N,), w, offset, eps,
                             [torch.ones_like(y_ref)])
    for got, want in zip(outs, refs):
        assert got.dtype == F64
        assert_matches(got, want, scale=scales["y"] if got is outs[0] else None)
    names = [n for n, t in zip(("x", "weight", "bias", "residual"), (x, w, b, r)) if t is not None]
    for got, want, name in zip(grads(outs, leaves), grads(refs, leaves), names):
        assert_matches(got, want, scale=scales[name])


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("interleaved, rotary_dim", [(False, 16), (True, 16), (False, 8), (True, 8)])
@pytest.mark.parametrize("positions", [False, True])
def test_rotary(layout, interleaved, rotary_dim, positions, device):
    B, S, H, D = 2, 5, 3, 16
    q = torch.randn(B, S, H, D, dtype=F64, device=device)
    k = torch.randn(B, S, 1, D, dtype=F64, device=device)
    if layout == "bhsd":
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    q.requires_grad_(), k.requires_grad_()
    cos, sin = torch.randn(9, rotary_dim // 2, dtype=F64, device=device), torch.randn(9, rotary_dim // 2, dtype=F64,
                                                                                      device=device)
    position_ids = torch.randint(0, 9, (B, S), device=device) if positions else None
    rows = position_ids if positions else torch.arange(S, device=device).expand(B, S)
    outs = pintail.apply_rotary(q, k, cos, sin, position_ids=position_ids, layout=layout, rotary_dim=rotary_dim,
                                interleaved=interleaved)
    move = (lambda t: t.transpose(1, 2)) if layout == "bhsd" else (lambda t: t)
    c, s = widen(cos[rows], interleaved), widen(sin[rows], interleaved)
    refs = tuple(move(hf_rotary(move(t), c, s, interleaved)) for t in (q, k))
    for got, want in zip(outs, refs):
        assert got.dtype == F64
        assert_matches(got, want)
    for got, want in zip(grads(outs, (q, k)), grads(refs, (q, k))):
        assert_matches(got, want)


def test_float64_cross_entropy_mean_with_weights_is_float64(device):
    """The mean's denominator and the row gradients stay float64 (they were float32: a
    relative error of 3.5e-8 in the loss at 16 x 1000 with class weights)."""
    x = torch.randn(16, 1000, dtype=F64, device=device, requires_grad=True)
    target = torch.randint(0, 1000, (16,), device=device)
    weight = torch.rand(1000, dtype=F64, device=device) * 2
    loss = pintail.cross_entropy(x, target, weight)
    loss_ref = F.cross_entropy(x, target, weight)
    assert abs(loss.item() - loss_ref.item()) <= 1e-14 * abs(loss_ref.item())
    (dx,), (dx_ref,) = torch.autograd.grad(loss, x), torch.autograd.grad(loss_ref, x)
    assert ((dx - dx_ref).abs() <= 1e-14 * dx_ref.abs().max()).all()
