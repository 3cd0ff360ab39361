"""Random cases of every op against float64 torch, forward and gradients: random dtypes,
shapes (empty ones too), strided / transposed / expanded layouts, and the options each op
takes. Each case function draws from `rng` (a random.Random), runs pintail and torch, and
raises AssertionError on a mismatch, by the suite's one comparison rule (helpers.py) with
each quantity's natural scale. Used by tests/test_fuzz.py (seeded cases, or fresh seeds
with --fuzz-seeds). They found that strided or expanded class targets and weights
(cross-entropy) and cos / sin of different strides (rotary) gave wrong answers."""

import contextlib
import math

import torch
import torch.nn.functional as F

import pintail
from helpers import assert_matches, rms
from test_cross_entropy import gradient_scale, torch_cross_entropy
from test_norm import gradient_scales
from test_rotary import hf_rotary, widen
from test_softmax import backward_scale, forward_scale

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def close(name, got, want, scale=None):
    """The suite's comparison (helpers.assert_matches), naming the quantity on failure."""
    try:
        assert_matches(got, want, scale=scale)
    except AssertionError as e:
        raise AssertionError(f"{name}: {e}") from None


def layout(t, kind):
    """t's values in another layout: 0 as is, 1 every other element of a wider buffer,
    2 transposed storage, 3 a slice of rows of a taller buffer."""
    if kind == 1 and t.dim() >= 1:
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        return wide[..., ::2]
    if kind == 2 and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if kind == 3 and t.dim() >= 1:
        tall = torch.zeros(t.shape[0] + 2, *t.shape[1:], dtype=t.dtype, device=t.device)
        tall[1:-1] = t
        return tall[1:-1]
    return t


@contextlib.contextmanager
def case_of(description):
    """A failed check inside names the case."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f"{description}: {e}") from None


def grads(out, inputs, upstream):
    return torch.autograd.grad(out, inputs, upstream, allow_unused=True)


def cross_entropy_case(rng, device):
    dtype = rng.choice(DTYPES)
    C = rng.choice([1, 2, 5, 17, 64, 300])
    ndim = rng.choice([1, 2, 2, 3, 4])
    shape = (C,) if ndim == 1 else (rng.choice([0, 1, 3, 6]), C) + tuple(rng.choice([1, 2, 3]) for _ in range(ndim - 2))
    x = layout(torch.randn(shape, device=device) * rng.choice([1, 5, 30, 1e4]), rng.randint(0, 3)).to(dtype)
    kw = {"reduction": rng.choice(["none", "mean", "sum"]), "label_smoothing": rng.choice([0.0, 0.0, 0.1, 1.0])}
    prob = rng.random() < 0.3
    if prob:
        target = torch.softmax(torch.randn(shape, device=device), dim=0 if ndim == 1 else 1).to(dtype)
        target_ref = target.double()
    else:
        target = torch.randint(0, C, () if ndim == 1 else (shape[0],) + shape[2:], device=device)
        if rng.random() < 0.5 and target.numel():
            kw["ignore_index"] = rng.choice([-100, 0, C - 1])
            target = torch.where(torch.rand(target.shape, device=device) < 0.3, kw["ignore_index"], target)
        target_ref = target
        target = layout(target, rng.choice([0, 1, 3])).to(rng.choice([torch.int64, torch.int32]))
    if rng.random() < 0.4:
        weight = layout(torch.rand(C, device=device) + 0.1, rng.choice([0, 1])).to(rng.choice([torch.float32, dtype]))
        kw["weight"] = weight
    kw.update(z_loss=rng.choice([0.0, 0.0, 1e-3]), softcap=rng.choice([None, None, 5.0, 30.0]))
    with case_of(f"cross_entropy {tuple(shape)} {dtype} prob={prob} {kw.get('reduction')}"):
        x_ours, x_ref = x.detach().requires_grad_(), x.detach().double().requires_grad_()
        ref_kw = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        out, z, lse = pintail.cross_entropy(x_ours, target, **kw, return_z_loss=True, return_lse=True)
        ref, z_ref, lse_ref = torch_cross_entropy(x_ref, target_ref, **ref_kw)
        assert out.shape == ref.shape and out.dtype == dtype, f"{out.shape} {out.dtype}, want {ref.shape} {dtype}"
        # a loss is lse - x_t (weighted): it errs by eps times their size where they cancel
        size = (lse_ref.abs().max().item() if lse_ref.numel() else 0.0) + x_ref.detach().abs().max().item() \
            if x_ref.numel() else 1.0
        size += kw["softcap"] or 0.0  # a capped logit c tanh(x / c) errs by about c eps
        size *= kw["weight"].max().item() if "weight" in kw else 1.0
        close("loss", out, ref, size)
        close("z-loss", z, z_ref, 2e-3 * size**2)
        close("lse", lse, lse_ref, size)
        if out.numel() and torch.isfinite(ref).all():
            upstream = torch.randn(out.shape, device=device).to(dtype)
            close("dx", grads(out, x_ours, upstream)[0], grads(ref, x_ref, upstream.double())[0],
                  gradient_scale(x_ref.detach(), target_ref, upstream.double(), **ref_kw))


def norm_case(rng, device):
    dtype = rng.choice(DTYPES)
    rms = rng.random() < 0.5
    norm_shape = rng.choice([(7,), (33,), (1,), (4, 5), (1000,), (4097,), (40000,)])  # the last: past the rows plans
    shape = rng.choice([(), (0,), (3,), (2, 3)]) + norm_shape
    x = torch.randn(shape, device=device) * rng.choice([1, 10]) + (0 if rms else rng.choice([0, 100]))
    if not rms and rng.random() < 0.25:  # a first value that stands out: LayerNorm's statistics shift by it
        x.view(-1, math.prod(norm_shape))[:, 0] = rng.choice([-1000.0, 1000.0])
    x = layout(x.to(dtype), rng.randint(0, 3))
    param_dtype = rng.choice([dtype, torch.float32])
    weight = layout(torch.randn(norm_shape, device=device), rng.choice([0, 0, 1])).to(param_dtype) \
        if rng.random() < 0.8 else None
    bias = torch.randn(norm_shape, device=device).to(param_dtype) if rng.random() < 0.6 else None
    residual = layout(torch.randn(shape, device=device), rng.randint(0, 3)).to(rng.choice([dtype, torch.float32])) \
        if rms and rng.random() < 0.3 else None
    eps = rng.choice([None, 1e-5, 1e-2]) if rms else rng.choice([1e-5, 1e-2])
    ours = [t.detach().requires_grad_() if t is not None else None for t in (x, weight, bias, residual)]
    refs = [t.detach().double().requires_grad_() if t is not None else None for t in (x, weight, bias, residual)]
    dims = tuple(range(-len(norm_shape), 0))
    if rms:
        offset = rng.choice([0.0, 0.0, 1.0])
        out_dtype = rng.choice([None, None, torch.float32])
        out = pintail.rms_norm(ours[0], norm_shape, ours[1], eps, residual=ours[3], bias=ours[2],
                               weight_offset=offset, out_dtype=out_dtype)
        h = refs[0] + refs[3] if residual is not None else refs[0]
        if residual is not None:  # the op normalises h as it stores it, rounded to its dtype
            h_dtype = torch.promote_types(dtype, residual.dtype)
            h = h + (h.to(h_dtype).double() - h).detach()
        ref = h * torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + (torch.finfo(torch.float32).eps if eps is None
                                                                   else eps))
        ref = ref * (offset + refs[1]) if refs[1] is not None else ref
        ref = ref + refs[2] if refs[2] is not None else ref
        h_dtype = torch.promote_types(dtype, residual.dtype) if residual is not None else None
        outs, wants = ((out[0], out[1]), (ref, h)) if residual is not None else ((out,), (ref,))
        out_dtypes = (out_dtype or h_dtype or dtype, h_dtype)
    else:
        outs = (pintail.layer_norm(ours[0], norm_shape, ours[1], ours[2], eps),)
        wants = (F.layer_norm(refs[0], norm_shape, refs[1], refs[2], eps),)
        out_dtypes = (dtype,)
    kind = "rms_norm" if rms else "layer_norm"
    with case_of(f"{kind} {tuple(shape)} {dtype} x.stride={x.stride()} params {param_dtype} "
                 f"residual {None if residual is None else residual.dtype}"):
        held = (refs[0] + refs[3] if residual is not None else refs[0]).detach()
        kind_name = "rms" if rms else "layer"
        eps_used = (torch.finfo(torch.float32).eps if eps is None else eps)
        offset_used = offset if rms else 0.0
        if wants[0].numel():
            upstream = [torch.randn(o.shape, device=device).to(o.dtype) for o in outs]
            scales = gradient_scales(kind_name, held, norm_shape, refs[1], offset_used, eps_used,
                                     [u.double() for u in upstream])
        for name, o, w, o_dtype in zip(("y", "h"), outs, wants, out_dtypes):
            assert o.shape == w.shape and o.dtype == o_dtype, f"{name}: {o.shape} {o.dtype}, want {w.shape} {o_dtype}"
            if w.numel():
                close(name, o, w, scales["y"] + (refs[2].detach().abs() if refs[2] is not None else 0)
                      if name == "y" else None)
        if wants[0].numel():
            pairs = [(name, o, r) for name, o, r in zip("xwbr", ours, refs) if o is not None]
            got = grads(outs, [o for _, o, _ in pairs], upstream)
            want = grads(wants, [r for _, _, r in pairs], [u.double() for u in upstream])
            for (name, o, _), g, w in zip(pairs, got, want):
                assert g.dtype == o.dtype, f"d{name} dtype {g.dtype}, want {o.dtype}"
                close(f"d{name}", g, w, scales[{"x": "x", "w": "weight", "b": "bias", "r": "residual"}[name]])


def softmax_case(rng, device):
    dtype = rng.choice(DTYPES)
    shape = tuple(rng.choice([0, 1, 2, 3, 7, 65]) for _ in range(rng.randint(0, 4)))
    if shape and rng.random() < 0.2:
        shape = shape[:-1] + (rng.choice([1000, 4097, 40000]),)  # 40000: the split and own-row plans
        shape = (1,) * (len(shape) - 1) + shape[-1:] if math.prod(shape) > 300_000 else shape  # interpreter time
    x = (torch.randn(shape, device=device) * rng.choice([1, 10, 100])).to(dtype)
    if x.numel() and rng.random() < 0.2:
        x.view(-1)[0] = -float("inf")
    if x.dim() >= 2 and rng.random() < 0.4:
        x = x.transpose(0, -1)
    if x.dim() >= 1 and x.shape[-1] > 1 and rng.random() < 0.3:
        x = x[..., ::2]
    dim = rng.randint(-max(x.dim(), 1), max(x.dim(), 1) - 1)
    log = rng.random() < 0.5
    out_dtype = rng.choice([None, None, torch.float32])
    ours, theirs = (pintail.log_softmax, torch.log_softmax) if log else (pintail.softmax, torch.softmax)
    x_ours, x_ref = x.detach().requires_grad_(), x.detach().double().requires_grad_()
    out, ref = ours(x_ours, dim, dtype=out_dtype), theirs(x_ref, dim)
    kind = "log_softmax" if log else "softmax"
    with case_of(f"{kind} {tuple(x.shape)} stride={x.stride()} {dtype} dim={dim} dtype={out_dtype}"):
        assert out.shape == ref.shape and out.dtype == (out_dtype or dtype)
        close("y", out, ref, forward_scale(kind, ref))
        if out.numel():
            upstream = torch.randn(out.shape, device=device).to(out.dtype)
            got, want = grads(out, x_ours, upstream)[0], grads(ref, x_ref, upstream.double())[0]
            finite = torch.isfinite(want)
            assert got.dtype == dtype
            scale = backward_scale(kind, ref.detach(), upstream, dim, end_to_end=True)
            # 16-bit outputs: the backward reads the rounded output, which errs by eps |log p| too
            close("dx", got[finite], want[finite], scale[finite] * (1 + (out.element_size() == 2)))


def rotary_case(rng, device):
    dtype = rng.choice(DTYPES)
    B, S = rng.choice([1, 2]), rng.choice([1, 3, 9])
    HQ, HK = rng.choice([(4, 2), (2, 2), (3, 1)])
    D = rng.choice([8, 16, 24])
    rotary_dim = rng.choice([d for d in (2, 4, 8, D) if d <= D])
    interleaved, per_pair, layout_name = rng.random() < 0.5, rng.random() < 0.5, rng.choice(["bshd", "bhsd"])
    mode = rng.choice(["offset", "position_ids", "plain", "packed", "per_token"])
    if mode == "packed":  # (total, heads, dim) with cu_seqlens: one row of sequences, positions restart
        B, layout_name = 1, "bshd"
    table_dtype = rng.choice([dtype, torch.float32])
    positions = S + rng.choice([0, 3])
    table_rows = (rng.choice([1, B]), S) if mode == "per_token" else (positions,)
    cos_pairs, sin_pairs = (torch.randn(*table_rows, rotary_dim // 2, device=device).to(table_dtype) for _ in range(2))
    cos, sin = (t if per_pair else widen(t, interleaved) for t in (cos_pairs, sin_pairs))
    cos, sin = layout(cos, rng.choice([0, 1])), layout(sin, rng.choice([0, 1, 2]))
    kw = dict(rotary_dim=rotary_dim, interleaved=interleaved, layout=layout_name)
    rows = torch.arange(S, device=device)[None].expand(B, S)
    if mode == "offset":
        kw["seq_offset"] = rng.randint(0, positions - S)
        rows = rows + kw["seq_offset"]
    elif mode == "position_ids":
        rows = kw["position_ids"] = torch.randint(0, positions, (B, S), device=device)
    elif mode == "packed":
        cuts = sorted(rng.sample(range(1, S), rng.randint(0, S - 1))) if S > 1 else []
        bounds = [0, *cuts, S]
        kw["cu_seqlens"] = torch.tensor(bounds, device=device, dtype=torch.int32)
        rows = torch.cat([torch.arange(b - a, device=device) for a, b in zip(bounds, bounds[1:])])[None]
    if mode == "per_token":
        cos_full, sin_full = (widen(t, interleaved).expand(B, S, -1).double() for t in (cos_pairs, sin_pairs))
    else:
        cos_full, sin_full = (widen(t[rows], interleaved).double() for t in (cos_pairs, sin_pairs))

    def make(heads):
        t = torch.randn(B, S, heads, D, device=device).to(dtype)
        return t if layout_name == "bshd" else layout(t.transpose(1, 2), rng.choice([0, 2]))
    q, k = make(HQ), make(HK)

    def reference(t):
        as_bshd = t if layout_name == "bshd" else t.transpose(1, 2)
        out = hf_rotary(as_bshd, cos_full, sin_full, interleaved)
        return out if layout_name == "bshd" else out.transpose(1, 2)
    leaves = [t.detach().requires_grad_() for t in (q, k)]
    inplace = rng.random() < 0.25  # rotates its (non-leaf) inputs in their storage
    ours = [t * 1.0 for t in leaves] if inplace else leaves
    refs = [t.detach().double().requires_grad_() for t in (q, k)]
    if mode == "packed":
        outs = [o[None] for o in pintail.apply_rotary(*(t[0] for t in ours), cos, sin, inplace=inplace, **kw)]
    else:
        outs = pintail.apply_rotary(*ours, cos, sin, inplace=inplace, **kw)
    wants = [reference(t) for t in refs]
    with case_of(f"rotary {dtype} B{B} S{S} H{HQ}/{HK} D{D} rotary_dim {rotary_dim} {layout_name} {mode} "
                 f"inplace={inplace}"):
        upstream = [torch.randn_like(o) for o in outs]
        # x cos + turn(x) sin: terms of size |x| (|cos| + |sin|), which may cancel
        size = (cos_full.abs() + sin_full.abs()).max().item() if cos_full.numel() else 1.0
        for name, o, w, t in zip("qk", outs, wants, ours):
            assert o.dtype == dtype
            assert not inplace or o.data_ptr() == t.data_ptr(), f"{name}: inplace returned another tensor"
            close(name, o, w, size * rms(t))
        for name, g, w, u in zip("qk", grads(outs, leaves, upstream), grads(wants, refs, [u.double() for u in upstream]),
                                 upstream):
            close(f"d{name}", g, w, size * rms(u))


CASES = {"cross_entropy": cross_entropy_case, "norm": norm_case, "softmax": softmax_case, "rotary": rotary_case}
