"""pintail.swiglu / geglu against float64 torch: values and both gradients, every dtype,
views of one fused projection, the fused gate_up form, extreme values, empty inputs, bad
input; the kernels counted."""

import importlib

import pytest
import torch
import torch.nn.functional as F

import pintail
from helpers import DTYPES, assert_matches

api = importlib.import_module("pintail.gated.api")

CASES = [("swiglu", None), ("geglu", "tanh"), ("geglu", "none")]


def ours(kind, approximate, gate, up=None):
    return pintail.swiglu(gate, up) if kind == "swiglu" else pintail.geglu(gate, up, approximate)


def truth(kind, approximate, gate, up):
    g, u = gate.double(), up.double()
    return (F.silu(g) if kind == "swiglu" else F.gelu(g, approximate=approximate)) * u


def derivative_scale(kind, gate):
    """|act'(gate)| bounds: at most about 1.1 for both activations."""
    return 1.2


@pytest.mark.parametrize("kind,approximate", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 33), (2, 3, 1000), (4, 1)], ids=str)
def test_matches_torch(kind, approximate, dtype, shape, device):
    gate = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_()
    up = torch.randn(shape, device=device).to(dtype).requires_grad_()
    y = ours(kind, approximate, gate, up)
    want = truth(kind, approximate, gate, up)
    assert y.shape == gate.shape and y.dtype == dtype
    # one rounding of the float32 result: entry by entry within the dtype's unit, at |y|'s scale
    assert_matches(y, want, scale=(gate.double().abs() + 1) * up.double().abs())
    dy = torch.randn(shape, device=device, dtype=torch.float64)
    dgate, dup = torch.autograd.grad(y, (gate, up), dy.to(dtype))
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    want_dgate, want_dup = torch.autograd.grad(truth(kind, approximate, g64, u64), (g64, u64), dy)
    assert_matches(dgate, want_dgate, scale=(dy.abs() * u64.abs()).detach() * derivative_scale(kind, gate))
    assert_matches(dup, want_dup, scale=(dy.abs() * (g64.abs() + 1)).detach())


@pytest.mark.parametrize("kind,approximate", CASES)
def test_views_of_one_projection_and_fused(kind, approximate, device):
    """gate and up sliced out of one (tokens, 2N) projection; and that projection passed whole
    (gate, then up): the same values and gradients, the fused gradient one (tokens, 2N) tensor."""
    N = 40
    projection = torch.randn(2, 5, 2 * N, device=device, requires_grad=True)
    gate, up = projection[..., :N], projection[..., N:]
    y = ours(kind, approximate, gate, up)
    fused = ours(kind, approximate, projection)
    assert torch.equal(y, fused)
    dy = torch.randn_like(y)
    (grad_views,) = torch.autograd.grad(y, projection, dy)
    (grad_fused,) = torch.autograd.grad(fused, projection, dy)
    assert torch.equal(grad_views, grad_fused)
    p64 = projection.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(truth(kind, approximate, p64[..., :N], p64[..., N:]), p64, dy.double())
    scale = 2 * (dy.double().abs().amax(-1, True) + 1) * (p64.detach().abs() + 1).amax(-1, True)
    assert_matches(grad_fused, want, scale=scale)


@pytest.mark.parametrize("kind,approximate", CASES)
def test_extreme_and_empty(kind, approximate, device):
    gate = torch.tensor([[-1e4, -80.0, -10.0, 0.0, 10.0, 80.0, 1e4, 3.0]], device=device, requires_grad=True)
    up = torch.full_like(gate, 2.0).requires_grad_()
    y = ours(kind, approximate, gate, up)
    assert_matches(y, truth(kind, approximate, gate, up), scale=1.0)
    dgate, dup = torch.autograd.grad(y.sum(), (gate, up))
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    want = torch.autograd.grad(truth(kind, approximate, g64, u64).sum(), (g64, u64))
    assert_matches(dgate, want[0], scale=1.0)
    assert_matches(dup, want[1], scale=1.0)
    empty = torch.randn(0, 16, device=device, requires_grad=True)
    out = ours(kind, approximate, empty, empty * 2)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert empty.grad.shape == (0, 16)


@pytest.mark.uses_reference
def test_float64(device):
    gate = torch.randn(5, 24, dtype=torch.float64, device=device, requires_grad=True)
    up = torch.randn(5, 24, dtype=torch.float64, device=device, requires_grad=True)
    for kind, approximate in CASES:
        y = ours(kind, approximate, gate, up)
        want = truth(kind, approximate, gate, up)
        assert torch.allclose(y, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(torch.autograd.grad(y.sum(), (gate, up)), torch.autograd.grad(want.sum(), (gate, up))):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.kernels_only
def test_one_launch_each_way(device, monkeypatch):
    launched = []
    real = api.launch
    monkeypatch.setattr(api, "launch", lambda kernel, grid, *a, **k: (launched.append(kernel.__name__),
                                                                      real(kernel, grid, *a, **k)))
    gate = torch.randn(6, 3000, device=device, requires_grad=True)
    up = torch.randn(6, 3000, device=device, requires_grad=True)
    pintail.swiglu(gate, up).sum().backward()
    assert launched == ["_gated_forward_kernel", "_gated_backward_kernel"]


def test_saves_only_its_inputs(device):
    """The backward keeps gate and up and nothing of their size beyond them."""
    gate = torch.randn(8, 64, device=device, requires_grad=True)
    up = torch.randn(8, 64, device=device, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        pintail.swiglu(gate * 1, up * 1)
    assert len(saved) == 2 and all(t.shape == (8, 64) for t in saved)


def test_bad_input(device):
    gate = torch.randn(4, 6, device=device)
    cases = [
        (ValueError, r"up has shape \(4, 5\), expected gate's \(4, 6\)", lambda: pintail.swiglu(gate, gate[:, :5])),
        (TypeError, "up has dtype torch.float64, expected gate's torch.float32",
         lambda: pintail.swiglu(gate, gate.double())),
        (ValueError, "a fused gate_up must have an even last dim", lambda: pintail.swiglu(gate[:, :5])),
        (ValueError, "approximate must be 'tanh' or 'none'", lambda: pintail.geglu(gate, gate, "erf")),
        (ValueError, "gate must be a floating point tensor", lambda: pintail.swiglu(gate.long(), gate.long())),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.large
@pytest.mark.parametrize("kind,approximate", CASES[:2])
def test_past_2_to_the_31_elements(kind, approximate, device):
    """Offsets in int64: (8200, 262144) bf16 gate and up, 2^31 + 2^21 elements each; the first,
    middle and last rows' values and gradients as float64 torch."""
    if device.type != "cuda":
        pytest.skip("needs 26 GB of GPU memory")
    M, N = 8200, 262144
    gate = torch.randn(M, N, device=device, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(M, N, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = ours(kind, approximate, gate, up)
    dy = torch.randn_like(y)
    dgate, dup = torch.autograd.grad(y, (gate, up), dy)
    for r in (0, M // 2, M - 1):
        g64, u64 = gate[r].detach().double().requires_grad_(), up[r].detach().double().requires_grad_()
        want = truth(kind, approximate, g64, u64)
        dg_truth, du_truth = torch.autograd.grad(want, (g64, u64), dy[r].double())
        assert_matches(y[r], want, want.to(y.dtype))
        assert_matches(dgate[r], dg_truth, dg_truth.to(y.dtype))
        assert_matches(dup[r], du_truth, du_truth.to(y.dtype))
