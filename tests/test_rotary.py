import pytest
import torch

import pintail
from helpers import DTYPES, assert_matches


# The Hugging Face formula, written here as the oracle.
def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def hf_rotary(x, cos, sin, interleaved=False):
    """x (B, S, H, D); cos, sin (B, S, rotary_dim), a column per feature."""
    rot = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    turn = rotate_every_two if interleaved else rotate_half
    return torch.cat((x_rot * cos + turn(x_rot) * sin, x_pass), dim=-1)


def tables(positions, rotary_dim, device, kind="rope"):
    """(cos, sin) with a column per pair, (positions, rotary_dim / 2): real rotary
    frequencies, or random entries (to catch any column mix-up). pintail takes such tables
    with rotary_dim given (without it, a table's width is rotary_dim: a column per feature)."""
    if kind == "random":
        return torch.randn(positions, rotary_dim // 2, device=device), torch.randn(positions, rotary_dim // 2, device=device)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, device=device).float() / rotary_dim)
    freqs = torch.outer(torch.arange(positions, device=device).float(), inv_freq)
    return freqs.cos(), freqs.sin()


def widen(t, interleaved):
    """A column per pair -> a column per feature, as each layout pairs features."""
    return t.repeat_interleave(2, -1) if interleaved else torch.cat([t, t], -1)


def check(x, out, cos_full, sin_full, interleaved, layout):
    """Forward and gradient of pintail's output `out` (from leaf x) against the formula on
    float64, with per-token full tables cos_full (B, S, rotary_dim)."""
    def to_bshd(t):
        return t if layout == "bshd" else t.transpose(1, 2)
    x64 = x.detach().double().requires_grad_()
    truth = to_bshd(hf_rotary(to_bshd(x64), cos_full.double(), sin_full.double(), interleaved))
    same = to_bshd(hf_rotary(to_bshd(x.detach()), cos_full.to(x.dtype), sin_full.to(x.dtype), interleaved))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_matches(out, truth, same)
    grad = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, grad, retain_graph=True)  # q and k share one node
    (dx_truth,) = torch.autograd.grad(truth, x64, grad.double())
    assert_matches(dx, dx_truth, dx_truth.to(x.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 16), (24, 8), (64, 64)])
@pytest.mark.parametrize("table", ["pair", "feature"])
def test_q_and_k(dtype, layout, interleaved, head_dim, rotary_dim, table, device):
    B, S, Hq, Hk = 2, 7, 4, 2  # GQA: fewer k heads
    shape = (lambda H: (B, S, H, head_dim)) if layout == "bshd" else (lambda H: (B, H, S, head_dim))
    q = torch.randn(shape(Hq), device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(shape(Hk), device=device, dtype=dtype, requires_grad=True)
    cos, sin = tables(S, rotary_dim, device, "random" if table == "feature" else "rope")
    if table == "feature":  # a column per feature, each its own value (not the duplicated pairs)
        cos, sin = torch.randn(S, rotary_dim, device=device), torch.randn(S, rotary_dim, device=device)
        cos_full, sin_full = cos, sin
    else:
        cos_full, sin_full = widen(cos, interleaved), widen(sin, interleaved)
    q_out, k_out = pintail.apply_rotary(q, k, cos, sin, layout=layout, rotary_dim=rotary_dim, interleaved=interleaved)
    for x, out in ((q, q_out), (k, k_out)):
        check(x, out, cos_full.expand(B, S, -1), sin_full.expand(B, S, -1), interleaved, layout)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_position_ids_and_offset(interleaved, device):
    B, S, H, D = 3, 6, 2, 32
    cos, sin = tables(50, D, device)
    x = torch.randn(B, S, H, D, device=device, requires_grad=True)
    position_ids = torch.randint(0, 50, (B, S), device=device)
    out = pintail.rotary(x, cos, sin, position_ids=position_ids, interleaved=interleaved, rotary_dim=D)
    check(x, out, widen(cos[position_ids], interleaved), widen(sin[position_ids], interleaved), interleaved, "bshd")
    out = pintail.rotary(x, cos, sin, seq_offset=40, interleaved=interleaved, rotary_dim=D)  # decoding
    rows = torch.arange(40, 46, device=device).expand(B, S)
    check(x, out, widen(cos[rows], interleaved), widen(sin[rows], interleaved), interleaved, "bshd")


def test_per_token_tables(device):
    """Hugging Face passes cos/sin already gathered: (batch, seq, head_dim)."""
    B, S, H, D = 2, 5, 3, 16
    x = torch.randn(B, H, S, D, device=device, requires_grad=True)
    cos, sin = torch.randn(B, S, D, device=device), torch.randn(B, S, D, device=device)
    check(x, pintail.rotary(x, cos, sin, layout="bhsd"), cos, sin, False, "bhsd")
    check(x, pintail.rotary(x, cos[:1], sin[:1], layout="bhsd"), cos[:1].expand(B, -1, -1),
          sin[:1].expand(B, -1, -1), False, "bhsd")


def test_packed_sequences(device):
    """cu_seqlens: positions restart at each packed sequence."""
    lengths = [3, 1, 5]
    cu_seqlens = torch.tensor([0, 3, 4, 9], device=device, dtype=torch.int32)
    H, D = 2, 16
    cos, sin = tables(10, D, device)
    batch_of_one = torch.randn(1, sum(lengths), H, D, device=device, requires_grad=True)
    out = pintail.rotary(batch_of_one[0], cos, sin, cu_seqlens=cu_seqlens, rotary_dim=D)
    rows = torch.cat([torch.arange(n, device=device) for n in lengths])[None, :]
    check(batch_of_one, out[None], widen(cos[rows], False), widen(sin[rows], False), False, "bshd")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim, offset", [(16, 0), (8, 3)], ids=["full", "partial_offset"])
def test_packed_sequences_every_option(dtype, interleaved, rotary_dim, offset, device):
    """Packed batches with cu_seqlens over dtypes, both pairings, partial rotary and an offset
    (every sequence's positions start at it)."""
    lengths = [2, 1, 4]
    cu_seqlens = torch.tensor([0, 2, 3, 7], device=device, dtype=torch.int32)
    H, D = 3, 16
    cos, sin = tables(12, rotary_dim, device)
    batch_of_one = torch.randn(1, sum(lengths), H, D, device=device).to(dtype).requires_grad_()
    out = pintail.rotary(batch_of_one[0], cos.to(dtype), sin.to(dtype), cu_seqlens=cu_seqlens, rotary_dim=rotary_dim,
                         interleaved=interleaved, seq_offset=offset)
    rows = torch.cat([torch.arange(n, device=device) + offset for n in lengths])[None, :]
    check(batch_of_one, out[None], widen(cos.to(dtype)[rows], interleaved), widen(sin.to(dtype)[rows], interleaved),
          interleaved, "bshd")


@pytest.mark.parametrize("cu_seqlens, message", [
    ([1, 3, 7], "start at 0"), ([0, 4, 3, 7], "never decrease"), ([0, 3, 6], "end at the token count 7"),
    ([[0, 7]], "1-d integer"), ([], "1-d integer")])
def test_bad_cu_seqlens_raise(cu_seqlens, message, device):
    x = torch.randn(7, 2, 16, device=device)
    cos, sin = tables(8, 16, device)
    with pytest.raises(ValueError, match=message):
        pintail.rotary(x, cos, sin, cu_seqlens=torch.tensor(cu_seqlens, device=device, dtype=torch.int32),
                       rotary_dim=16)


def test_empty_inputs(device):
    """No tokens: empty outputs and gradients, packed (cu_seqlens = [0]) or not."""
    cos, sin = tables(4, 16, device)
    for x, extra in ((torch.randn(0, 2, 16, device=device), dict(cu_seqlens=torch.zeros(1, dtype=torch.int32,
                                                                                          device=device))),
                     (torch.randn(2, 0, 2, 16, device=device), {})):
        x.requires_grad_()
        out = pintail.rotary(x, cos, sin, rotary_dim=16, **extra)
        assert out.shape == x.shape
        (dx,) = torch.autograd.grad(out, x, torch.ones_like(out))
        assert dx.shape == x.shape


def test_strided_views(device):
    """q, k, v sliced out of one fused projection: strided heads, no copy."""
    B, S, H, D = 2, 5, 4, 16
    qkv = torch.randn(B, S, 3 * H, D, device=device, requires_grad=True)
    q, k = qkv[:, :, :H], qkv[:, :, H:2 * H]
    cos, sin = tables(S, D, device)
    q_out, k_out = pintail.apply_rotary(q, k, cos, sin, rotary_dim=D)
    ref_q = hf_rotary(q.detach().double(), widen(cos, False).double()[None], widen(sin, False).double()[None])
    assert_matches(q_out, ref_q, ref_q.float())
    (grad,) = torch.autograd.grad((q_out.sum() + 2 * k_out.sum()), qkv)
    assert grad[:, :, 2 * H:].abs().max() == 0  # v got no gradient


def test_tables_of_any_strides(device):
    """cos / sin that are strided views (a feature stride of 2), or of different layouts
    from each other: the kernel reads both with cos's strides, so they are made alike."""
    B, S, H, D = 2, 5, 3, 16
    x = torch.randn(B, S, H, D, device=device, requires_grad=True)
    both = torch.randn(S, 2 * D, device=device)
    cos, sin = both[:, ::2], both[:, 1::2]
    expected = (cos[None].expand(B, -1, -1), sin[None].expand(B, -1, -1))
    check(x, pintail.rotary(x, cos, sin), *expected, False, "bshd")
    sin_transposed = sin.t().contiguous().t()  # same values, strides (1, S)
    check(x, pintail.rotary(x, cos.contiguous(), sin_transposed), *expected, False, "bshd")


def test_inplace(device):
    B, S, H, D = 2, 4, 3, 16
    cos, sin = tables(S, D, device)
    base = torch.randn(B, S, H, D, device=device, requires_grad=True)
    x = base * 1.0
    expected = pintail.rotary(x.detach().clone(), cos, sin, rotary_dim=D)
    out = pintail.rotary(x, cos, sin, inplace=True, rotary_dim=D)
    assert out.data_ptr() == x.data_ptr() and torch.equal(x.detach(), expected)
    (grad,) = torch.autograd.grad(out.square().sum(), base)
    base2 = base.detach().requires_grad_()
    (grad2,) = torch.autograd.grad(pintail.rotary(base2 * 1.0, cos, sin, rotary_dim=D).square().sum(), base2)
    assert torch.allclose(grad, grad2, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_inplace_on_views_with_autograd(packed, device):
    """q and k sliced out of a fused projection (views), rotated in place with autograd: the
    projection holds the rotated values and the gradient is the out-of-place one's."""
    S, H, D = 5, 2, 16
    cos, sin = tables(S, D, device)
    extra = dict(cu_seqlens=torch.tensor([0, 2, 5], device=device, dtype=torch.int32)) if packed else {}
    qkv_leaf = torch.randn(S, 3 * H, D, device=device, requires_grad=True)
    outputs = []
    for inplace in (True, False):
        qkv = qkv_leaf * 1.0 if packed else (qkv_leaf * 1.0)[None]
        q, k = qkv[..., :H, :], qkv[..., H:2 * H, :]
        q_out, k_out = pintail.apply_rotary(q, k, cos, sin, rotary_dim=D, inplace=inplace, **extra)
        if inplace:
            assert q_out.data_ptr() == q.data_ptr() and torch.equal(qkv[..., :H, :], q_out)
        loss = (q_out * 2).sum() + (k_out ** 2).sum() + qkv[..., 2 * H:, :].sum()
        (grad,) = torch.autograd.grad(loss, qkv_leaf)
        outputs.append((q_out.detach(), k_out.detach(), grad))
    for ours, theirs in zip(*outputs):
        torch.testing.assert_close(ours, theirs)


def test_compile_fullgraph(device):
    B, S, H, D = 2, 6, 2, 16
    cos, sin = tables(S, D, device)
    q = torch.randn(B, S, H, D, device=device, requires_grad=True)
    k = torch.randn(B, S, 1, D, device=device, requires_grad=True)

    def f(q, k):
        a, b = pintail.apply_rotary(q * 2.0, k, cos, sin, interleaved=True, rotary_dim=D)
        return a.square().sum() + b.sum()

    backend = "inductor" if device.type == "cuda" else "aot_eager"
    loss = torch.compile(f, fullgraph=True, backend=backend)(q, k)
    grads = torch.autograd.grad(loss, (q, k))
    loss_eager = f(q, k)
    grads_eager = torch.autograd.grad(loss_eager, (q, k))
    assert torch.allclose(loss, loss_eager, rtol=1e-5)
    for g, ge in zip(grads, grads_eager):
        assert torch.allclose(g, ge, rtol=1e-5, atol=1e-6)
    for second in (k.detach().requires_grad_(), None):  # q and k in one launch, or one tensor
        torch.library.opcheck(torch.ops.pintail.rotary.default,
                              (q.detach().requires_grad_(), second, cos, sin, None, 1, 0, D, False, False))


def test_positions_outside_the_table(device):
    x = torch.randn(1, 4, 2, 16, device=device)
    cos, sin = tables(10, 16, device)
    with pytest.raises(ValueError, match=r"positions reach 12 \(min 0\), but cos/sin have 10 positions"):
        pintail.rotary(x, cos, sin, position_ids=torch.tensor([[0, 1, 12, 3]], device=device))
    with pytest.raises(ValueError, match=r"cos/sin have 10 positions, too short for positions 8..11"):
        pintail.rotary(x, cos, sin, seq_offset=8)
    with pytest.raises(ValueError, match=r"seq_offset must be >= 0 \(the position of the first token\), got -1"):
        pintail.rotary(x, cos, sin, seq_offset=-1)


def test_bad_input(device):
    q = torch.randn(2, 5, 4, 16, device=device)
    k = torch.randn(2, 5, 2, 8, device=device)
    cos, sin = tables(5, 16, device)
    with pytest.raises(ValueError, match="k has head_dim 8, q has 16"):
        pintail.apply_rotary(q, k, cos, sin)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        pintail.rotary(q, cos[:, :3], sin[:, :3], rotary_dim=7)
    with pytest.raises(ValueError, match="rotary_dim must be even and in \\[2, head_dim=16\\], got 32"):
        pintail.rotary(q, cos, sin, rotary_dim=32)
    with pytest.raises(ValueError, match="width 8 fits neither rotary_dim 12"):
        pintail.rotary(q, cos, sin, rotary_dim=12)
    with pytest.raises(ValueError, match="layout must be 'bshd' or 'bhsd'"):
        pintail.rotary(q, cos, sin, layout="sbhd")
    with pytest.raises(ValueError, match="must be a floating point tensor of 4 dims"):
        pintail.rotary(q[0], cos, sin)
    with pytest.raises(ValueError, match="cos and sin must be floating point tensors of one shape"):
        pintail.rotary(q, cos, sin[:, :4])
    with pytest.raises(ValueError, match="cos and sin get no gradient"):
        pintail.rotary(q, cos.requires_grad_(), sin)
    with pytest.raises(ValueError, match=r"position_ids must be integers of shape \(2, 5\)"):
        pintail.rotary(q, cos.detach(), sin, position_ids=torch.zeros(2, 4, dtype=torch.int64, device=device))
    if device.type == "cuda":
        with pytest.raises(ValueError, match="expected one device"):
            pintail.rotary(q, cos.detach().cpu(), sin.cpu())


@pytest.mark.large
def test_past_2_to_the_31_elements(device):
    """Row offsets in int64: (1, 131200, 128, 128) bf16 holds 2^31 + 2^21 elements; output and
    gradient of the first and last tokens as the formula."""
    if device.type != "cuda":
        pytest.skip("needs 13 GB of GPU memory")
    S, H, D = 131200, 128, 128
    x = torch.randn(1, S, H, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = tables(S, D, device)
    out = pintail.rotary(x, cos, sin, rotary_dim=D)
    dy = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, dy)
    for s in (0, S // 2, S - 1):
        cos_row, sin_row = widen(cos[s:s + 1], False)[None].double(), widen(sin[s:s + 1], False)[None].double()
        row64 = x[:, s:s + 1].detach().double().requires_grad_()
        truth = hf_rotary(row64, cos_row, sin_row)
        (dx_truth,) = torch.autograd.grad(truth, row64, dy[:, s:s + 1].double())
        same = hf_rotary(x[:, s:s + 1].detach(), cos_row.to(x.dtype), sin_row.to(x.dtype))
        assert_matches(out[:, s:s + 1], truth, same)
        assert_matches(dx[:, s:s + 1], dx_truth, dx_truth.to(x.dtype))
