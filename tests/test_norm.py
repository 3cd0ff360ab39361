import importlib
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import pintail
from helpers import DTYPES, assert_matches

norm_api = importlib.import_module("pintail.norm.api")
norm_plans = importlib.import_module("pintail.norm.plans")
LONG_BLOCK = 1024  # the long and split plans' chunk in these tests: rows of 4097 span five chunks


@pytest.fixture(params=["rows", "long", "split"])
def plan(request, monkeypatch):
    """Every plan at test sizes: 'rows' keeps the library's tables (the rows plan, except for
    RMSNorm's forward of rows of 513-16384: the long plan, the row one chunk, or two tiles at
    9217-10240, and LayerNorm's of 1024 / 2048 / 4096 / 8192: one chunk); 'long' sends every
    forward to the long plan with short chunks and empties the rows, one-chunk, two-tile and
    cluster tables (both norms' backward take the long plan); 'split' does too and sends the
    forward to the split plan and RMSNorm's backward to the blocks plan (blocks of 3 rows; on
    a GPU, slices of LONG_BLOCK; the interpreter cuts no row into slices)."""
    if request.param != "rows":
        monkeypatch.setattr(norm_plans, "FORWARD_PLANS", {kind: [(32768, "long", LONG_BLOCK, 4)]
                                                           for kind in norm_plans.FORWARD_PLANS})
        monkeypatch.setattr(norm_plans, "ROWS_TAIL", {})
        monkeypatch.setattr(norm_plans, "LAYER_ONE_CHUNK", {})
        monkeypatch.setattr(norm_plans, "BACKWARD_ROWS", {"rms": [], "layer": []})
        monkeypatch.setattr(norm_plans, "BACKWARD_TAIL", {kind: (values, []) for kind, (values, _)
                                                          in norm_plans.BACKWARD_TAIL.items()})
        monkeypatch.setattr(norm_plans, "BACKWARD_CLUSTER", {"rms": (0, []), "layer": (0, [])})
        monkeypatch.setattr(norm_plans, "FORWARD_CLUSTER", {})
        monkeypatch.setattr(norm_plans, "FORWARD_CLUSTER_BF16", {})
        monkeypatch.setattr(norm_plans, "BACKWARD_LONG", {**norm_plans.BACKWARD_LONG, "BLOCK": LONG_BLOCK})
        monkeypatch.setattr(norm_plans, "FORWARD_SPLIT",
                            {kind: {**cfg, "BLOCK": LONG_BLOCK} for kind, cfg in norm_plans.FORWARD_SPLIT.items()})
    if request.param == "long":
        monkeypatch.setattr(norm_plans, "BACKWARD_BLOCKS", {})
    if request.param == "split":
        monkeypatch.setattr(norm_plans, "FORWARD_PLANS", {kind: [] for kind in norm_plans.FORWARD_PLANS})
        monkeypatch.setattr(norm_plans, "BACKWARD_BLOCKS", {"rms": {**norm_plans.BACKWARD_BLOCKS["rms"], "ROWS": 3,
                                                                     "BLOCK": LONG_BLOCK}})
        monkeypatch.setattr(norm_plans, "BACKWARD_BLOCKS_WITH_DH", [(math.inf, LONG_BLOCK, 4, 4)])
    return request.param


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_plan_fixture_routes_every_test_size(kind, plan):
    """The fixture's 'long' and 'split' reach the plans they name at the sizes the tests take,
    whatever the GPU (clusters or not), dtype, row alignment or residual: a table it leaves in
    place sends a size elsewhere (the bf16 cluster table once took the split tests' bf16 rows
    on CUDA, a two-tile table RMSNorm's backward of 4097)."""
    if plan == "rows":
        pytest.skip("the library's own tables")
    rms = kind == "rms"
    forward = {"long": "long", "split": "split"}[plan]
    backward = {"long": "long", "split": "blocks" if rms else "long"}[plan]
    sizes, flags = (1, 2, 7, 33, 100, 1000, 3000, 4096, 4097), (False, True)
    with_residual = flags if rms else (False,)
    for N, clusters, bf16, narrow, residual in itertools.product(sizes, flags, flags, flags, with_residual):
        cfg = norm_plans.forward_config(N, rms, residual, narrow, narrow, clusters, bf16)  # packable as narrow
        assert cfg["plan"] == forward, (N, clusters, bf16, narrow, residual, cfg)
    for N, clusters, dh in itertools.product(sizes, flags, with_residual):
        cfg = norm_plans.backward_config(N, rms, dh, clusters)
        assert cfg["plan"] == backward, (N, clusters, dh, cfg)


def torch_norm(kind, x, shape, weight=None, bias=None, eps=None, residual=None, weight_offset=0.0, h_dtype=None):
    """The reference composed from torch: (y, h) with h = x + residual (or None), rounded to
    h_dtype as the op stores it (and normalises what it stored), the gradient passing
    straight through the rounding."""
    h = x + residual if residual is not None else None
    if h is not None and h_dtype is not None:
        h = h + (h.to(h_dtype).to(h.dtype) - h).detach()
    v = h if h is not None else x
    if kind == "rms":
        w = weight + weight_offset if weight is not None else None
        y = F.rms_norm(v, shape, w, eps)
        y = y + bias if bias is not None else y
    else:
        y = F.layer_norm(v, shape, weight, bias, 1e-5 if eps is None else eps)
    return y, h


def check(kind, x, shape, weight=None, bias=None, residual=None, weight_offset=0.0, out_dtype=None, eps=None,
          factor=2):
    """Output(s) and every gradient against float64 torch and torch in the input dtype (our
    error at most `factor` times torch's, or within the dtype's tolerance)."""
    leaves = [t for t in (x, weight, bias, residual) if t is not None]
    leaves = [t.detach().requires_grad_() for t in leaves]
    it = iter(leaves)
    ours_in = [next(it) if t is not None else None for t in (x, weight, bias, residual)]
    if kind == "rms":
        out = pintail.rms_norm(ours_in[0], shape, ours_in[1], eps, residual=ours_in[3], bias=ours_in[2],
                               weight_offset=weight_offset, out_dtype=out_dtype)
    else:
        out = pintail.layer_norm(ours_in[0], shape, ours_in[1], ours_in[2], 1e-5 if eps is None else eps)
    y, h = out if residual is not None else (out, None)
    normalised_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    assert y.dtype == (out_dtype or normalised_dtype) and y.shape == x.shape

    if eps is None:  # the op's default: torch's for the input dtype (float32's for 16-bit inputs), not float64's
        eps = torch.finfo(torch.promote_types(normalised_dtype, torch.float32)).eps if kind == "rms" else 1e-5

    def run(cast):
        ins = [cast(t).detach().requires_grad_() if t is not None else None for t in (x, weight, bias, residual)]
        ty, th = torch_norm(kind, ins[0], shape, ins[1], ins[2], eps, ins[3], weight_offset, normalised_dtype)
        return ins, ty, th

    ins64, y64, h64 = run(lambda t: t.double())
    try:
        ins_same, y_same, h_same = run(lambda t: t)
    except RuntimeError:  # torch's CUDA layer_norm refuses a float32 weight with a half input; its CPU one takes it
        ins_same, y_same, h_same = run(lambda t: t.cpu() if t is not None else None)
    scales = gradient_scales(kind, (h64 if h64 is not None else ins64[0]).detach(), shape, ins64[1], weight_offset,
                             eps, [torch.ones_like(y64)])
    assert_matches(y, y64, y_same.to(y.dtype), scale=scales["y"])
    outs = [(y, y64, y_same)] + ([(h, h64, h_same)] if h is not None else [])
    grads_out = [torch.randn_like(o[0], dtype=torch.float32) for o in outs]
    ours = torch.autograd.grad([o[0] for o in outs], [t for t in ours_in if t is not None],
                               [g.to(o[0].dtype) for g, o in zip(grads_out, outs)])
    # the truth gets the gradient as handed to our op (rounded to the output's dtype): the
    # rounding of the incoming gradient is not the op's error (it failed fp16 dweight ~1 run in 50)
    truth = torch.autograd.grad([o[1] for o in outs], [t for t in ins64 if t is not None],
                                [g.to(o[0].dtype).double() for g, o in zip(grads_out, outs)])
    same = torch.autograd.grad([o[2] for o in outs], [t for t in ins_same if t is not None],
                               [g.to(o[2].device, o[2].dtype) for g, o in zip(grads_out, outs)])
    scales = gradient_scales(kind, (h64 if h64 is not None else ins64[0]).detach(), shape, ins64[1], weight_offset,
                             eps, [g.to(o[0].dtype).double() for g, o in zip(grads_out, outs)])
    named = [scales[name] for name, t in zip(("x", "weight", "bias", "residual"), (x, weight, bias, residual))
             if t is not None]
    for g, g64, g_same, leaf, scale in zip(ours, truth, same, [t for t in ours_in if t is not None], named):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape
        assert_matches(g, g64, g_same, scale=scale)


def gradient_scales(kind, v, shape, weight, weight_offset, eps, upstream):
    """The natural size of each gradient's entries, which bounds the absolute error where
    terms cancel: dx = rstd (g - x^ mean(g x^) [- mean(g)]) errs by about eps * rstd * |g| a
    row (rows of one value cancel to 0 exactly); dweight and dbias are sums over rows of
    dy x^ and dy, which err by eps times the sum of the terms' magnitudes."""
    N = math.prod(shape)
    rows = v.reshape(-1, N)
    centred = rows if kind == "rms" else rows - rows.mean(1, keepdim=True)
    rstd = torch.rsqrt(centred.square().mean(1, keepdim=True) + (eps if eps is not None else 1e-5))
    dy = upstream[0].reshape(-1, N)
    w = (weight.detach().reshape(N) + weight_offset) if weight is not None else torch.ones_like(dy[0])
    g = dy * w
    # LayerNorm's x - mean cancels: x^ errs by eps |x| rstd, not eps |x^|; and rstd, from a
    # float32 sum of N squares, by about sqrt(N) eps relative
    lift = 1 + (rows.square().mean(1, keepdim=True).sqrt() * rstd if kind == "layer" else 0)
    lift = lift * (1 + N**0.5 / 16)
    dx = (lift * rstd * g.square().mean(1, keepdim=True).sqrt()).expand_as(rows)
    if len(upstream) > 1:  # the residual's own gradient adds to dx
        dx = dx + upstream[1].reshape(-1, N).abs()
    dx = dx.reshape(v.shape)
    # x^ = (x - mean) rstd errs by eps (|x| + mean |x|) rstd where x - mean cancels: the mean,
    # a float32 sum, errs by eps times its terms' mean size even where x is near 0
    spread = rows.abs() + (rows.abs().mean(1, keepdim=True) if kind == "layer" else 0)
    return {"x": dx, "residual": dx, "weight": (lift * (dy * spread * rstd).abs()).sum(0).reshape(shape),
            "bias": dy.abs().sum(0).reshape(shape), "y": (lift * w.abs()).expand_as(rows).reshape(v.shape)}


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 1000, 4097])
@pytest.mark.parametrize("affine", ["none", "weight", "weight+bias", "fp32 weight"])
def test_rows(kind, dtype, N, affine, plan, device):
    if kind == "rms" and affine == "weight+bias":
        affine = "weight"  # bias is an rms_norm extra, tested below
    x = torch.randn(3, 2, N, device=device).to(dtype) * 2 + 0.5
    w_dtype = torch.float32 if affine == "fp32 weight" else dtype
    weight = torch.randn(N, device=device).to(w_dtype) if affine != "none" else None
    bias = torch.randn(N, device=device).to(dtype) if affine == "weight+bias" else None
    check(kind, x, (N,), weight, bias)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("N", [16385, 24577, 32768, 40000])
def test_wide_rows(kind, N, device):
    """The default plans at the widths where they change: the widest rows in registers, and past them."""
    x = torch.randn(3, N, device=device, dtype=torch.bfloat16)
    weight = torch.randn(N, device=device, dtype=torch.bfloat16)
    check(kind, x, (N,), weight)
    if kind == "rms":  # with a residual: its own split launch configuration
        check(kind, x, (N,), weight, residual=torch.randn_like(x))


@pytest.mark.parametrize("dtype, N, bias, capped", [(torch.bfloat16, 32768, False, True),
                                                      (torch.float16, 24584, False, True),
                                                      (torch.bfloat16, 32768, True, False),
                                                      (torch.float32, 32768, False, False),
                                                      (torch.bfloat16, 24577, False, False)])
@pytest.mark.kernels_only
def test_rms_forward_register_cap_only_for_narrow_rows(dtype, N, bias, capped, monkeypatch, device):
    """RMSNorm's one-chunk forward past 24576 holds ptxas to 32 registers; it is taken only
    for 2-byte rows of 8-divisible length without a bias (wider or odd rows, or a bias,
    spilled under the cap on the H200 and keep the chunked plan), and both give torch's
    result."""
    launched = recorded_launches(monkeypatch)
    x = torch.randn(2, N, device=device, dtype=dtype)
    weight = torch.randn(N, device=device, dtype=dtype)
    check("rms", x, (N,), weight, torch.randn(N, device=device, dtype=dtype) if bias else None)
    forward = [kwargs for name, kwargs in launched if name == "_forward_long_kernel"]
    assert forward, "the long forward kernel did not run"
    assert all(("maxnreg" in kwargs) == capped for kwargs in forward)
    assert all(kwargs["BLOCK"] == (32768 if capped else 16384) for kwargs in forward)


@pytest.fixture
def layer_packed(monkeypatch):
    """LayerNorm's packed plan (16-bit rows of 28672-32768 by default) for every row it
    takes at test sizes, at 4 warps; returns the names of the kernels launched from then on."""
    monkeypatch.setattr(norm_plans, "LAYER_PACKED",
                        (1, 32768, {"plan": "packed", "BLOCK": 32768, "num_warps": 4, "PARTS": 4}))
    return launched_kernels(monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("N", [2, 100, 1000, 4096])
@pytest.mark.parametrize("affine", ["none", "weight", "weight+bias"])
@pytest.mark.kernels_only
def test_layer_norm_packed_plan(dtype, N, affine, layer_packed, device):
    """The row held as words of two 16-bit values, the output in parts (masked where the row
    is not a power of 2): output and gradients (the backward from its mean / rstd) as torch."""
    x = torch.randn(3, 2, N, device=device).to(dtype) * 2 + 0.5
    weight = torch.randn(N, device=device).to(dtype) if affine != "none" else None
    bias = torch.randn(N, device=device).to(dtype) if affine == "weight+bias" else None
    check("layer", x, (N,), weight, bias)
    assert "_forward_packed_kernel" in layer_packed


@pytest.mark.parametrize("case", ["odd length", "float32 weight", "odd row stride", "float32"])
@pytest.mark.kernels_only
def test_layer_norm_packed_plan_only_where_words_fit(case, layer_packed, device):
    """Rows that are not whole words, or parameters of another dtype, take the other plans."""
    N = 101 if case == "odd length" else 100
    x = torch.randn(3, N + (case == "odd row stride"), device=device,
                    dtype=torch.float32 if case == "float32" else torch.bfloat16)[:, :N]
    weight = torch.randn(N, device=device, dtype=torch.float32 if case in ("float32 weight", "float32")
                         else torch.bfloat16)
    check("layer", x, (N,), weight, torch.randn(N, device=device, dtype=weight.dtype))
    assert layer_packed and "_forward_packed_kernel" not in layer_packed


@pytest.mark.kernels_only
def test_layer_norm_packed_plan_past_float32_squares(layer_packed, device):
    """bf16 holds values whose float32 squares overflow: as torch (variance inf: y = bias; inf
    and NaN rows NaN; a first value of 1e19 an ordinary row)."""
    N = 1000
    x = torch.randn(5, N, device=device, dtype=torch.bfloat16)
    x[0, 9], x[1, N // 2], x[2, 5], x[3, 7] = 3e38, -2e19, float("inf"), float("nan")
    x[4, 0] = 1e19
    w, b = torch.randn(N, device=device, dtype=torch.bfloat16), torch.randn(N, device=device, dtype=torch.bfloat16)
    torch.testing.assert_close(pintail.layer_norm(x, (N,), w, b), F.layer_norm(x, (N,), w, b), equal_nan=True)
    assert "_forward_packed_kernel" in layer_packed


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("N", [7, 1000, 4097])
@pytest.mark.parametrize("grad", ["no_grad", "no leaf requires grad", "training"])
@pytest.mark.kernels_only
def test_statistics_stored_only_for_a_backward(kind, N, grad, plan, monkeypatch, device):
    """A forward that no backward will follow (grad mode off, or no input, weight or bias
    requiring grad) skips the mean / rstd stores (the rows and long plans; the split plan
    stores them always) and gives torch's result."""
    launched = recorded_launches(monkeypatch)
    x = torch.randn(5, N, device=device, dtype=torch.bfloat16) + 0.5
    weight = torch.randn(N, device=device, dtype=torch.bfloat16)
    bias = torch.randn(N, device=device, dtype=torch.bfloat16)
    if grad == "training":
        weight.requires_grad_()
    with torch.set_grad_enabled(grad != "no_grad"):
        ours = pintail.rms_norm(x, (N,), weight, bias=bias) if kind == "rms" else \
            pintail.layer_norm(x, (N,), weight, bias)
    y64, _ = torch_norm(kind, x.double(), (N,), weight.detach().double(), bias.double())
    y_same, _ = torch_norm(kind, x, (N,), weight.detach(), bias)
    assert_matches(ours, y64, y_same)
    assert ours.requires_grad == (grad == "training")
    stored = [kwargs["STATS"] for _, kwargs in launched if "STATS" in kwargs]
    assert stored == ([] if plan == "split" else [grad == "training"])


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_several_normalized_dims_and_layouts(kind, device):
    base = torch.randn(6, 5, 4, 9, device=device)
    weight = torch.randn(4, 9, device=device)
    check(kind, base, (4, 9), weight)
    check(kind, base.transpose(0, 1), (4, 9), weight)  # copied to rows
    check(kind, base[::2], (9,), weight[0])            # strided rows, no copy


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [33, 4097])
def test_rms_norm_extras(dtype, N, plan, device):
    x = torch.randn(4, N, device=device).to(dtype)
    residual = torch.randn(4, N, device=device).to(dtype)
    weight = torch.randn(N, device=device).to(dtype)
    bias = torch.randn(N, device=device).to(dtype)
    check("rms", x, (N,), weight, residual=residual)
    check("rms", x, (N,), weight, bias=bias, weight_offset=1.0)
    check("rms", x, (N,), weight, bias=bias, residual=residual, weight_offset=1.0, eps=1e-6)
    check("rms", x, (N,), weight, out_dtype=torch.float32)


def test_residual_in_float32(device):
    """A bf16 block output added to a float32 residual stream: h in float32, as torch promotes,
    and y in h's dtype, as torch's rms_norm(x + residual) gives."""
    x = torch.randn(5, 64, device=device, dtype=torch.bfloat16)
    residual = torch.randn(5, 64, device=device)
    y, h = pintail.rms_norm(x, (64,), residual=residual)
    assert h.dtype == torch.float32 and y.dtype == torch.float32
    check("rms", x, (64,), torch.randn(64, device=device), residual=residual)


def blocks_config(rows, block, programs_per_sm=4):
    return {"plan": "blocks", "ROWS": rows, "BLOCK": block, "num_warps": 4, "PROGRAMS_PER_SM": programs_per_sm}


def _record_launches(monkeypatch, entry):
    """entry(kernel name, launch keyword arguments) of each kernel norm launches from now on."""
    entries = []

    def recording_launch(kernel, grid, *args, **kwargs):
        entries.append(entry(kernel.fn.__name__, kwargs))
        launch(kernel, grid, *args, **kwargs)
    launch = norm_api.launch
    monkeypatch.setattr(norm_api, "launch", recording_launch)
    return entries


def recorded_launches(monkeypatch):
    """(kernel name, launch keyword arguments) of each kernel norm launches from now on."""
    return _record_launches(monkeypatch, lambda name, kwargs: (name, kwargs))


def launched_kernels(monkeypatch):
    """The names of the kernels norm launches from now on."""
    return _record_launches(monkeypatch, lambda name, kwargs: name)


@pytest.mark.parametrize("M, N, rows, block", [(13, 300, 4, 64), (5, 1000, 8, 256), (3, 4097, 2, 1024), (9, 33, 3, 64),
                                               (2, 1, 4, 64), (40, 200, 32, 64)])
@pytest.mark.parametrize("extras", ["weight", "none", "bias+offset+dh"])
@pytest.mark.kernels_only
def test_rms_backward_blocks_plan(M, N, rows, block, extras, monkeypatch, device):
    """The blocks plan (RMSNorm past the rows plan) against float64 torch: blocks that end
    past the last row, rows of several slices on a GPU, with and without the extras."""
    x = torch.randn(M, N, device=device)
    w = torch.randn(N, device=device) if extras != "none" else None
    b = torch.randn(N, device=device) if extras.startswith("bias") else None
    offset = 1.0 if "offset" in extras else 0.0
    dy = torch.randn(M, N, device=device)
    dh = torch.randn(M, N, device=device) if "dh" in extras else None
    _, _, mean, rstd = norm_api._forward(x, None, w, b, 1e-5, offset, True, torch.float32)
    kernels = launched_kernels(monkeypatch)
    grads = norm_api._backward(dy, dh, x, w, b is not None, mean, rstd, offset, True, torch.float32,
                                  blocks_config(rows, block))
    assert kernels[0] == "_backward_blocks_kernel"
    leaves = [t.double().requires_grad_() for t in (x, w, b) if t is not None]
    x64, w64, b64 = leaves[0], (leaves[1] if w is not None else None), (leaves[-1] if b is not None else None)
    y64, _ = torch_norm("rms", x64, (N,), w64, b64, eps=1e-5, weight_offset=offset)
    want = torch.autograd.grad(y64, leaves, dy.double())
    want = (want[0] + (dh.double() if dh is not None else 0), *want[1:])
    got = [g for g in grads if g is not None]
    assert len(got) == len(want)
    scales = gradient_scales("rms", x64.detach(), (N,), w64, offset, 1e-5,
                             [dy.double()] + ([dh.double()] if dh is not None else []))
    for g, g64, name in zip(got, want, ("x", "weight" if w is not None else "bias", "bias")):
        assert_matches(g, g64, g64.float(), scale=scales[name])
    again = norm_api._backward(dy, dh, x, w, b is not None, mean, rstd, offset, True, torch.float32,
                                  blocks_config(rows, block))
    for g, g2 in zip(grads, again):  # dweight / dbias: the same bits whichever program takes which block
        assert g is None or torch.equal(g, g2)


@pytest.mark.kernels_only
def test_rms_backward_blocks_plan_falls_back_when_slices_cannot_all_run(monkeypatch, device):
    """A row's slices wait for each other: past one slice per SM they might not all run at
    once and the blocks plan could hang, so the long plan runs (the interpreter, which cuts
    no row, is given a GPU of no SM)."""
    # on a GPU: more slices of 64 than it has SMs
    N = 64 * (torch.cuda.get_device_properties(device).multi_processor_count + 5) if device.type == "cuda" else 300
    x, w, dy = (torch.randn(6, N, device=device), torch.randn(N, device=device),
                torch.randn(6, N, device=device))
    _, _, mean, rstd = norm_api._forward(x, None, w, None, 1e-5, 0.0, True, torch.float32)
    if device.type != "cuda":
        monkeypatch.setattr(norm_api, "program_slots", lambda device, per_sm: 0)
    kernels = launched_kernels(monkeypatch)
    dx, dw, _ = norm_api._backward(dy, None, x, w, False, mean, rstd, 0.0, True, torch.float32,
                                      blocks_config(4, 64))
    assert "_backward_blocks_kernel" not in kernels and "_backward_chunks_kernel" in kernels
    want_dx, want_dw, _ = norm_api._backward(dy, None, x, w, False, mean, rstd, 0.0, True, torch.float32,
                                                norm_plans.BACKWARD_LONG)
    torch.testing.assert_close(dx, want_dx)
    torch.testing.assert_close(dw, want_dw)


def test_parameter_gradients_in_their_dtypes(device):
    """dweight / dbias are summed in float32 and rounded once, to the parameters' dtypes."""
    x = torch.randn(70, 48, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, device=device, dtype=torch.float16, requires_grad=True)
    b = torch.randn(48, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(70, 48, device=device, dtype=torch.bfloat16)
    dw, db = torch.autograd.grad(pintail.layer_norm(x, (48,), w, b), (w, b), dy)
    assert dw.dtype == torch.float16 and db.dtype == torch.bfloat16
    torch.testing.assert_close(db.float(), dy.double().sum(0).float(), rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_many_chunks_per_row(kind, device):
    """Small chunks, so that tiny rows span many: the row-sum kernel and the chunked grid."""
    M, N = 13, 300
    x, w, b = torch.randn(M, N, device=device), torch.randn(N, device=device), torch.randn(N, device=device)
    rms = kind == "rms"
    y, _, mean, rstd = norm_api._forward(x, None, w, b, 1e-5, 0.0, rms, torch.float32,
                                            {"plan": "long", "BLOCK": 64, "num_warps": 4})
    dy = torch.randn(M, N, device=device)
    grads = norm_api._backward(dy, None, x, w, True, mean, rstd, 0.0, rms, torch.float32,
                                  {**norm_plans.BACKWARD_LONG, "BLOCK": 64})
    leaves = [t.double().requires_grad_() for t in (x, w, b)]
    y64, _ = torch_norm(kind, leaves[0], (N,), leaves[1], leaves[2], eps=1e-5)
    assert_matches(y, y64, y64.float())
    for g, g64 in zip(grads, torch.autograd.grad(y64, leaves, dy.double())):
        assert_matches(g, g64, g64.float())


@pytest.mark.gpu_only
def test_weight_gradient_is_deterministic(plan, device):
    """GPU only: the same bits however the programs are scheduled (the interpreter runs them in
    one fixed order, so there it could not fail)."""
    x = torch.randn(300, 96, device=device, requires_grad=True)
    w = torch.randn(96, device=device, requires_grad=True)
    dy = torch.randn(300, 96, device=device)
    first = torch.autograd.grad(pintail.rms_norm(x, (96,), w), w, dy)[0]
    second = torch.autograd.grad(pintail.rms_norm(x, (96,), w), w, dy)[0]
    assert torch.equal(first, second)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_empty(kind, device):
    x = torch.randn(0, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    y = pintail.rms_norm(x, (16,), w) if kind == "rms" else pintail.layer_norm(x, (16,), w)
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    assert y.shape == (0, 16) and gx.shape == (0, 16) and torch.equal(gw, torch.zeros_like(gw))


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_zero_width_rows(kind, device):
    """normalized_shape with a 0 in it: an empty output and gradient, as torch."""
    x = torch.randn(4, 0, device=device, requires_grad=True)
    y = pintail.rms_norm(x, (0,)) if kind == "rms" else pintail.layer_norm(x, (0,))
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert y.shape == (4, 0) and gx.shape == (4, 0)


def test_eps_default_is_torchs(device):
    x = torch.randn(4, 32, device=device, dtype=torch.bfloat16) * 1e-3
    """eps=None: float32's epsilon for 16-bit inputs, as torch (what it computes in)."""
    assert_matches(pintail.rms_norm(x, (32,)), F.rms_norm(x.double(), (32,), eps=torch.finfo(torch.float32).eps),
                   F.rms_norm(x, (32,)))


def test_modules_drop_in(device):
    for ours_cls, theirs_cls, kwargs in ((pintail.nn.RMSNorm, torch.nn.RMSNorm, {"eps": 1e-6}),
                                         (pintail.nn.LayerNorm, torch.nn.LayerNorm, {"bias": True})):
        theirs = theirs_cls((3, 20), device=device, **kwargs)
        with torch.no_grad():
            for p in theirs.parameters():
                p.normal_()
        ours = ours_cls((3, 20), device=device, **kwargs)
        ours.load_state_dict(theirs.state_dict())
        assert isinstance(ours, theirs_cls)
        x = torch.randn(5, 3, 20, device=device)
        assert torch.allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_rms_norm_module_model_options(device):
    """pintail.nn.RMSNorm's weight_offset (Gemma's 1 + weight) and out_dtype."""
    norm = pintail.nn.RMSNorm(16, eps=1e-6, device=device, weight_offset=1.0, out_dtype=torch.float32)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 16, device=device).bfloat16()
    y = norm(x)
    assert y.dtype == torch.float32
    assert torch.allclose(y, F.rms_norm(x.float(), (16,), norm.weight + 1.0, 1e-6), rtol=1e-5, atol=1e-5)


def test_bad_input(device):
    x = torch.randn(4, 8, device=device)
    cases = [
        (lambda: pintail.rms_norm(x, (7,)), ValueError, r"normalized_shape=\[7\] must be the trailing dims"),
        (lambda: pintail.layer_norm(x, (2, 8, 1)), ValueError, "must be the trailing dims"),
        (lambda: pintail.rms_norm(x, (8,), torch.ones(7, device=device)), ValueError, r"weight must have shape"),
        (lambda: pintail.layer_norm(x, (8,), None, torch.ones(9, device=device)), ValueError, "bias must have shape"),
        (lambda: pintail.rms_norm(x, (8,), residual=torch.ones(4, 7, device=device)), ValueError,
         "residual must be a floating point tensor of input's shape"),
        (lambda: pintail.rms_norm(x, (8,), eps=-1.0), ValueError, "eps must be >= 0, got -1.0"),
        (lambda: pintail.layer_norm(x.long(), (8,)), TypeError, "input must be a floating point tensor"),
    ]
    if device.type == "cuda":
        cases.append((lambda: pintail.rms_norm(x, (8,), torch.ones(8)), ValueError, "weight must be a floating"))
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def test_compile_fullgraph_and_opcheck(device):
    x = torch.randn(6, 40, device=device, requires_grad=True)
    r = torch.randn(6, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=True)
    b = torch.randn(40, device=device, requires_grad=True)

    def f(x, r, w, b):
        y, h = pintail.rms_norm(x * 2.0, (40,), w, residual=r, weight_offset=1.0)
        return (y * h).sum() + pintail.layer_norm(y, (40,), w, b).square().sum()

    backend = "inductor" if device.type == "cuda" else "aot_eager"
    loss = torch.compile(f, fullgraph=True, backend=backend)(x, r, w, b)
    grads = torch.autograd.grad(loss, (x, r, w, b))
    grads_eager = torch.autograd.grad(f(x, r, w, b), (x, r, w, b))
    for g, ge in zip(grads, grads_eager):
        assert torch.allclose(g, ge, rtol=1e-4, atol=1e-4)
    args = (x.detach().requires_grad_(), r.detach().requires_grad_(), w.detach().requires_grad_(),
            b.detach().requires_grad_(), 1e-5, 0.5, True, torch.float32, True)
    torch.library.opcheck(torch.ops.pintail.norm_forward.default, args)
    # stats=False (no backward to come): inputs that want no gradient
    torch.library.opcheck(torch.ops.pintail.norm_forward.default,
                          (*[t.detach() for t in args[:4]], *args[4:-1], False))
    with pytest.raises(RuntimeError, match="stats=False"):
        torch.ops.pintail.norm_forward.default(*args[:-1], False)[0].sum().backward()


@pytest.mark.large
@pytest.mark.parametrize("kind, N", [("rms", 262144), ("layer", 262144), ("layer", 32768)])
def test_past_2_to_the_31_elements(kind, N, device):
    """Row offsets in int64: 2^31 + 2^21 bf16 elements, through the split plans (262144;
    RMSNorm's cluster plan where the GPU has clusters) and LayerNorm's packed plan (32768); output, dx of a few rows and dweight as torch."""
    if device.type != "cuda":
        pytest.skip("needs 8.6 GB of GPU memory")
    M = 2**31 // N + 2**21 // N
    x = torch.randn(M, N, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, device=device, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(N, device=device, dtype=torch.bfloat16) if kind == "layer" else None

    def norm(x, w):
        return F.rms_norm(x, (N,), w) if kind == "rms" else F.layer_norm(x, (N,), w, b.to(x.dtype))

    y = pintail.rms_norm(x, (N,), w) if kind == "rms" else pintail.layer_norm(x, (N,), w, b)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    for r in (0, M // 2, M - 1):
        row, row64 = x[r:r + 1].detach(), x[r:r + 1].detach().double().requires_grad_()
        truth = norm(row64, w.detach().double())
        (dx_truth,) = torch.autograd.grad(truth, row64, dy[r:r + 1].double())
        row = row.requires_grad_()
        same = norm(row, w.detach())
        (dx_same,) = torch.autograd.grad(same, row, dy[r:r + 1])
        assert_matches(y[r:r + 1], truth, same)
        assert_matches(dx[r:r + 1], dx_truth, dx_same)
    x_hat = F.rms_norm(x.detach().float(), (N,)) if kind == "rms" else F.layer_norm(x.detach().float(), (N,))
    dw_ref = (dy.float() * x_hat).sum(0)
    assert_matches(dw, dw_ref.double(), dw_ref.to(dw.dtype))


@pytest.mark.parametrize("N", [3000, 4097])
def test_layer_norm_of_rows_with_a_large_mean(N, plan, device):
    """Mean 1000, spread 0.1: E[x^2] - E[x]^2 in float32 would lose every digit of the variance
    (an error of ~200). Even done right, float32 x - mean keeps only ~3 digits here, and torch's
    error and ours vary from draw to draw: the bar is 4x torch's error, not 2x."""
    x = torch.randn(4, N, device=device) * 0.1 + 1000.0
    check("layer", x, (N,), torch.randn(N, device=device), torch.randn(N, device=device), factor=4)


@pytest.mark.parametrize("plan", ["rows", "long"], indirect=True)  # split: float32 slice sums (design.md)
@pytest.mark.parametrize("N", [3000, 4097])
@pytest.mark.kernels_only  # torch's float32 mean keeps its rounding
def test_layer_norm_output_keeps_a_large_mean_exact(N, plan, device):
    """The mean of 1000 + 0.1 randn rounds to float32 by up to 3e-5, which x^ = (x - mean) * 10
    would carry as 3e-4: the kernels keep it as a float32 pair, so x^ is float32-accurate."""
    x = torch.randn(16, N, device=device) * 0.1 + 1000.0
    y, stats = pintail.layer_norm(x, (N,)), F.layer_norm(x.double(), (N,))
    assert (y.double() - stats).abs().max().item() < 2e-5


@pytest.mark.parametrize("N", [2048, 3000, 4097])  # 2048: the library's row as one chunk of the long plan
def test_layer_norm_of_rows_whose_first_value_stands_out(N, plan, device):
    """The sums run on x - x[0]: a first value 1000 from the rest (spread 1) makes them large,
    and E[s^2] - E[s]^2 cancels. The outlier is in the variance too (1000^2 / N of it), which
    bounds what the cancellation costs: about N float32 ulps of the variance."""
    x = torch.randn(4, N, device=device)
    x[:, 0] = 1000.0
    check("layer", x, (N,), torch.randn(N, device=device), torch.randn(N, device=device), factor=4)


def test_rms_forward_one_chunk_by_its_fill():
    """RMSNorm's forward of 1025-8192: the row one chunk of next_power_of_2(N), the table's
    warps scaled to that chunk and halved where the row fills at most 3/4 of it; a table
    whose chunk is shorter than the row (the tests' long plan) keeps its chunk."""
    def plan(N):
        cfg = norm_plans.forward_config(N, True)
        return cfg["plan"], cfg["BLOCK"], cfg["num_warps"]
    assert plan(1000) == ("long", 1024, 2)
    assert plan(1536) == ("long", 2048, 2) and plan(2048) == ("long", 2048, 4)
    assert plan(2560) == ("long", 4096, 4) and plan(3072) == ("long", 4096, 4) and plan(3584) == ("long", 4096, 8)
    assert plan(4096) == ("long", 4096, 8)
    assert plan(5120) == ("long", 8192, 8) and plan(6144) == ("long", 8192, 8) and plan(7168) == ("long", 8192, 16)
    assert plan(8192) == ("long", 8192, 16) and plan(10241) == ("long", 16384, 8)
    assert norm_plans.forward_config(2560, False)["plan"] == "rows"
    assert norm_plans.forward_config(2560, True, residual=True)["plan"] == "rows"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1536, 2560, 5120])
@pytest.mark.kernels_only
def test_rms_forward_one_chunk_part_filled(dtype, N, monkeypatch, device):
    """The library's plan at hidden sizes that are no power of two, forward and backward."""
    launches = recorded_launches(monkeypatch)
    x = torch.randn(4, N, device=device).to(dtype) * 2 + 0.5
    check("rms", x, (N,), torch.randn(N, device=device).to(dtype))
    cfg = norm_plans.forward_config(N, True)
    assert [(kwargs["BLOCK"], kwargs["num_warps"], kwargs["ONE_CHUNK"]) for name, kwargs in launches
            if name == "_forward_long_kernel"] == [(cfg["BLOCK"], cfg["num_warps"], True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [2048, 4096, 16384])
@pytest.mark.kernels_only
def test_layer_forward_one_chunk(dtype, N, monkeypatch, device):
    """LayerNorm's library plan at rows of a power of two, 1024-16384: the row as one whole
    chunk of the long plan, forward and backward."""
    launches = recorded_launches(monkeypatch)
    x = torch.randn(4, N, device=device).to(dtype) * 2 + 0.5
    check("layer", x, (N,), torch.randn(N, device=device).to(dtype), torch.randn(N, device=device).to(dtype))
    cfg = norm_plans.forward_config(N, False)
    assert [(kwargs["BLOCK"], kwargs["num_warps"], kwargs["ONE_CHUNK"]) for name, kwargs in launches
            if name == "_forward_long_kernel"] == [(cfg["BLOCK"], cfg["num_warps"], True)]


def tiles_launched(launches, kernel):
    """(BLOCK_N, TAIL, EVEN) of each launch of a norm rows kernel."""
    return [(kwargs["BLOCK_N"], kwargs["TAIL"], kwargs["EVEN"]) for name, kwargs in launches if name == kernel]


def two_tiles(N, warps=0, values=8):
    """(BLOCK_N, TAIL, EVEN) for a row of N as rows_tail cuts it, the tail at least `values` a
    thread of `warps` (8: 16 bytes of 16-bit values, the forward's)."""
    head, tail = norm_plans.rows_tail(N)
    tail = max(tail, values * 32 * warps)
    return head, tail, N == head + tail


def test_layer_forward_rows_as_two_tiles_plan():
    """LayerNorm's forward of 1025-16384: one row a program as two tiles where rows_tail cuts
    the row so (next_power_of_2(N) / 2 columns and a power of two more), else the table's tile."""
    assert norm_plans.rows_tail(5120) == (4096, 1024) and norm_plans.rows_tail(6000) == (4096, 2048)
    assert norm_plans.rows_tail(4097) == (4096, 1) and norm_plans.rows_tail(7168) == (8192, 0)
    assert norm_plans.rows_tail(1) == (1, 0) and norm_plans.rows_tail(3) == (2, 1)
    tail = lambda N: norm_plans.forward_config(N, False)
    assert tail(1536) == {"plan": "rows", "BLOCK_M": 1, "BLOCK_N": 1024, "TAIL": 512, "num_warps": 2}
    assert tail(5120) == {"plan": "rows", "BLOCK_M": 1, "BLOCK_N": 4096, "TAIL": 1024, "num_warps": 4}
    assert tail(12288) == {"plan": "rows", "BLOCK_M": 1, "BLOCK_N": 8192, "TAIL": 4096, "num_warps": 8}
    # tails of under 16 bytes a thread widened (masked): 256 values a warp
    assert tail(1100) == {"plan": "rows", "BLOCK_M": 1, "BLOCK_N": 1024, "TAIL": 512, "num_warps": 2}
    assert tail(4608)["TAIL"] == tail(4097)["TAIL"] == 1024 and tail(9216)["TAIL"] == tail(8704)["TAIL"] == 2048
    for N in (1000, 4096, 7168, 14336, 16385):  # no tail, or past the range
        assert "TAIL" not in tail(N)
    for N in (1536, 5120, 8192, 10241):  # RMSNorm keeps its plans, but at 8193-10240
        assert "TAIL" not in norm_plans.forward_config(N, True)
        assert "TAIL" not in norm_plans.forward_config(N, True, residual=True)
    for N in (8193, 8704, 9216, 10240):
        assert norm_plans.forward_config(N, True) == {"plan": "rows", "BLOCK_M": 1, "BLOCK_N": 8192, "TAIL": 2048,
                                                      "num_warps": 8}
    assert "TAIL" not in norm_plans.forward_config(10240, True, residual=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1100, 1500, 1536, 2560, 4097, 4608])
@pytest.mark.kernels_only
def test_layer_forward_rows_as_two_tiles(dtype, N, monkeypatch, device):
    """LayerNorm's forward with the row as two tiles (whole: 1536, 2560; a masked tail: 1500,
    4097, and widened: 1100, 4608), a first value that stands out in one row (the deviations'
    pass over both tiles), forward and backward against torch."""
    launches = recorded_launches(monkeypatch)
    x = torch.randn(5, N, device=device) * 2 + 0.5
    x[2, 0] = 1000.0
    check("layer", x.to(dtype), (N,), torch.randn(N, device=device).to(dtype), torch.randn(N, device=device).to(dtype),
          factor=4)
    warps = max(2, norm_plans.rows_tail(N)[0] // 1024)
    assert tiles_launched(launches, "_forward_rows_kernel") == [two_tiles(N, warps)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [8200, 9300, 10240])
@pytest.mark.kernels_only
def test_rms_forward_rows_as_two_tiles(dtype, N, monkeypatch, device):
    """RMSNorm's forward of 8193-10240 as two tiles (8192 + 2048, masked at 8200 and 9300, whole
    at 10240), forward and backward against torch."""
    launches = recorded_launches(monkeypatch)
    x = torch.randn(3, N, device=device) * 2 + 0.5
    check("rms", x.to(dtype), (N,), torch.randn(N, device=device).to(dtype), None)
    assert tiles_launched(launches, "_forward_rows_kernel") == [two_tiles(N, 8)]


def test_backward_rows_as_two_tiles_plan():
    """The backward without a residual's gradient, RMSNorm's of 4097-6144 and 8193-12288,
    LayerNorm's of 2049-3072 and 8193-10240: one row a tile as two tiles where rows_tail cuts
    the row so, the tail widened to 4 values a thread (RMSNorm) or 8 (LayerNorm); with dh, or
    elsewhere, the tables'."""
    for clusters in (False, True):
        config = lambda N, rms=True, dh=False: norm_plans.backward_config(N, rms, dh, clusters)
        assert config(5120) == {"plan": "rows", "BLOCK_M": 1, "BLOCK_N": 4096, "TAIL": 1024, "num_warps": 4,
                                "PROGRAMS_PER_SM": 2}
        assert config(12288) == {"plan": "rows", "BLOCK_M": 1, "BLOCK_N": 8192, "TAIL": 4096, "num_warps": 8,
                                 "PROGRAMS_PER_SM": 1}
        for N in (3072, 4096, 7168, 14336, 16385):
            assert "TAIL" not in config(N)
        assert config(4608)["TAIL"] == 512 and config(4097)["TAIL"] == 512 and config(8704)["TAIL"] == 1024
        assert "TAIL" not in config(5120, dh=True) and "TAIL" not in config(5120, rms=False)
        for N, head, tail, warps, per_sm in ((2049, 2048, 1024, 4, 2), (2560, 2048, 1024, 4, 2),
                                             (3072, 2048, 1024, 4, 2), (8193, 8192, 2048, 8, 1),
                                             (9000, 8192, 2048, 8, 1), (10240, 8192, 2048, 8, 1)):
            assert config(N, rms=False) == {"plan": "rows", "BLOCK_M": 1, "BLOCK_N": head, "TAIL": tail,
                                            "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
        for N in (2048, 3073, 8192, 10241):
            assert "TAIL" not in config(N, rms=False)


@pytest.mark.parametrize("N, extras", [(4097, "weight"), (5120, "none"), (6000, "bias+offset")])
@pytest.mark.kernels_only
def test_rms_backward_rows_as_two_tiles(N, extras, monkeypatch, device):
    """RMSNorm's backward with the row as two tiles (whole: 5120; a masked tail: 4097, 6000)
    against float64 torch (in the interpreter, 1-2 programs: each sums several rows)."""
    launches = recorded_launches(monkeypatch)
    x = torch.randn(9, N, device=device, dtype=torch.bfloat16) * 2 + 0.5
    weight = torch.randn(N, device=device, dtype=torch.bfloat16) if extras != "none" else None
    bias = torch.randn(N, device=device, dtype=torch.bfloat16) if extras == "bias+offset" else None
    check("rms", x, (N,), weight, bias, weight_offset=1.0 if extras == "bias+offset" else 0.0)
    assert tiles_launched(launches, "_backward_rows_kernel") == [two_tiles(N, 4, values=4)]


@pytest.mark.parametrize("N", [2600, 3072, 9000, 10240])
@pytest.mark.kernels_only
def test_layer_backward_rows_as_two_tiles(N, monkeypatch, device):
    """LayerNorm's backward with the row as two tiles (whole: 3072, 10240; the tail masked:
    2600, 9000), a weight and a bias, against float64 torch."""
    launches = recorded_launches(monkeypatch)
    x = torch.randn(9, N, device=device, dtype=torch.bfloat16) * 2 + 0.5
    weight, bias = (torch.randn(N, device=device, dtype=torch.bfloat16) for _ in range(2))
    check("layer", x, (N,), weight, bias, factor=4)
    assert tiles_launched(launches, "_backward_rows_kernel") == [two_tiles(N, 4 if N <= 3072 else 8)]


def test_long_rows_plans():
    """The launch tables at the widths where they change (measured on the H200): both norms'
    short rows as one chunk of the long plan (LayerNorm's at 1024-16384 if a power of two), the
    long forward's chunk (and RMSNorm's register cap), RMSNorm with a residual in registers
    to 32768, and the longer slices of the backward with the residual's gradient past 65536."""
    def plan(cfg):
        return cfg["plan"], cfg.get("BLOCK", cfg.get("BLOCK_N"))
    assert plan(norm_plans.forward_config(512, True)) == ("rows", 512)
    assert plan(norm_plans.forward_config(513, True)) == ("long", 1024)
    assert plan(norm_plans.forward_config(8192, True)) == ("long", 8192)
    assert plan(norm_plans.forward_config(10241, True)) == ("long", 16384)
    assert plan(norm_plans.forward_config(4096, True, residual=True)) == ("rows", 4096)
    assert plan(norm_plans.forward_config(1000, False)) == ("rows", 1024)
    assert norm_plans.forward_config(1024, False) == {"plan": "long", "BLOCK": 1024, "num_warps": 2}
    assert norm_plans.forward_config(2048, False) == {"plan": "long", "BLOCK": 2048, "num_warps": 4}
    assert plan(norm_plans.forward_config(3584, False)) == ("rows", 4096)
    assert norm_plans.forward_config(4096, False) == {"plan": "long", "BLOCK": 4096, "num_warps": 4}
    assert plan(norm_plans.forward_config(8000, False)) == ("rows", 8192)
    assert norm_plans.forward_config(8192, False) == {"plan": "long", "BLOCK": 8192, "num_warps": 8}
    assert plan(norm_plans.forward_config(12289, False)) == ("rows", 16384)
    assert norm_plans.forward_config(16384, False) == {"plan": "long", "BLOCK": 16384, "num_warps": 8}
    for rms in (True, False):
        assert plan(norm_plans.forward_config(16385, rms)) == ("long", 8192)
        assert plan(norm_plans.forward_config(32769, rms))[0] == "split"
        assert plan(norm_plans.forward_config(24577, rms, narrow=False)) == ("long", 16384)
    # RMSNorm's narrow rows past 24576: the row as one chunk at 32 warps, held to 32 registers
    assert norm_plans.forward_config(24577, True) == {"plan": "long", "BLOCK": 32768, "num_warps": 32, "maxnreg": 32}
    assert plan(norm_plans.forward_config(24577, False)) == ("long", 16384)
    assert plan(norm_plans.forward_config(32768, True, residual=True)) == ("rows", 32768)
    assert plan(norm_plans.forward_config(32769, True, residual=True))[0] == "split"
    assert plan(norm_plans.backward_config(65536, True, dh=True)) == ("blocks", 2048)
    assert plan(norm_plans.backward_config(131072, True, dh=True)) == ("blocks", 4096)
    assert plan(norm_plans.backward_config(262144, True, dh=True)) == ("blocks", 8192)
    assert plan(norm_plans.backward_config(262144, True)) == ("blocks", 2048)


def test_backward_plans_with_clusters():
    """Where the GPU has thread-block clusters, the backward of rows without a residual's
    gradient goes across a cluster from 8193 (RMSNorm; but its rows as two tiles, 8193-12288)
    or 4097 (LayerNorm; but its rows as two tiles, 8193-10240, and its long plan at
    65537-98304) to 131072; the other plans stay as they were."""
    for rms in (True, False):
        config = lambda N, dh=False: norm_plans.backward_config(N, rms, dh, clusters=True)
        assert config(4096)["plan"] == "rows"
        assert config(4097)["plan"] == config(8192)["plan"] == ("rows" if rms else "cluster")
        assert config(12289)["plan"] == config(98305)["plan"] == config(131072)["plan"] == "cluster"
        assert config(65537)["plan"] == config(98304)["plan"] == ("cluster" if rms else "long")
        assert config(8193)["plan"] == config(10240)["plan"] == "rows"
        assert config(10241)["plan"] == ("rows" if rms else "cluster")
        assert config(6144, dh=True) == norm_plans.backward_config(6144, rms, dh=True)
        assert config(131073) == norm_plans.backward_config(131073, rms)
        assert config(16384, dh=True) == norm_plans.backward_config(16384, rms, dh=True)
    # (N, rms): the cluster's (slice, warps), the next row loaded ahead in every entry
    for (N, rms), (block, warps) in {(131072, True): (8192, 16), (131072, False): (8192, 16),
                                     (65536, False): (4096, 8), (16384, True): (2048, 4), (32768, True): (8192, 16),
                                     (32768, False): (4096, 8), (16384, False): (8192, 16), (5120, False): (1024, 4),
                                     (8192, False): (1024, 4)}.items():
        assert norm_plans.backward_config(N, rms, clusters=True) == \
            {"plan": "cluster", "BLOCK": block, "num_warps": warps, "AHEAD": True}, (N, rms)


def test_forward_plans_with_clusters():
    """Where the GPU has thread-block clusters, the forward of rows without a residual goes
    across persistent clusters: RMSNorm's of 32769-262144 (slices of 4096 to 65536, 8192 to
    131072, then 16384; with a residual 8192 then 16384), LayerNorm's of 32769-131072 (slices
    of 8192 at 128 registers); past those lengths the plans stay as they were. bf16 rows have
    their own table (x held in 16 bits, the next row ahead; slices of 32768 for RMSNorm at
    131073-245760, LayerNorm at 49153-65536 and 131073-245760)."""
    config = lambda N, rms=True, residual=False: norm_plans.forward_config(N, rms, residual, clusters=True)
    assert config(32768) == norm_plans.forward_config(32768, True)
    assert config(32769) == config(65536) == {"plan": "cluster", "BLOCK": 4096, "num_warps": 4}
    assert config(65537) == config(131072) == {"plan": "cluster", "BLOCK": 8192, "num_warps": 4}
    assert config(131073) == config(262144) == {"plan": "cluster", "BLOCK": 16384, "num_warps": 8, "maxnreg": 128}
    assert config(262145)["plan"] == "split"
    assert config(32768, False) == norm_plans.forward_config(32768, False)
    assert (config(32769, False) == config(131072, False)
            == {"plan": "cluster", "BLOCK": 8192, "num_warps": 4, "maxnreg": 128})
    assert config(131073, False) == norm_plans.forward_config(131073, False) == norm_plans.FORWARD_SPLIT["layer"]
    for N in (1000, 32768, 262145):
        assert config(N, residual=True) == norm_plans.forward_config(N, True, residual=True)
    # with a residual: across clusters, any dtype; bf16 h held
    assert config(32769, residual=True) == config(65536, residual=True) == {"plan": "cluster", "BLOCK": 8192,
                                                                              "num_warps": 4, "AHEAD": True}
    assert config(65537, residual=True) == config(262144, residual=True) == {"plan": "cluster", "BLOCK": 16384,
                                                                               "num_warps": 8, "AHEAD": True,
                                                                               "HELD": True}
    # bf16 rows: x held in 16 bits and the next row loaded ahead where that won
    bf16 = lambda N, rms=True: norm_plans.forward_config(N, rms, clusters=True, bf16=True)
    assert bf16(32769) == bf16(65536) == config(65536)
    assert bf16(65537) == bf16(131072) == {"plan": "cluster", "BLOCK": 8192, "num_warps": 4, "AHEAD": True}
    slices_of_32768 = {"plan": "cluster", "BLOCK": 32768, "num_warps": 16, "AHEAD": True}
    assert bf16(131073) == bf16(245760) == {**slices_of_32768, "HELD": True}
    assert bf16(245761) == bf16(262144) == {"plan": "cluster", "BLOCK": 16384, "num_warps": 8, "maxnreg": 128,
                                            "AHEAD": True, "HELD": True}
    assert bf16(32769, False) == bf16(49152, False) == {**config(32769, False), "AHEAD": True}
    assert bf16(49153, False) == bf16(65536, False) == slices_of_32768
    assert bf16(65537, False) == bf16(131072, False) == {"plan": "cluster", "BLOCK": 8192, "num_warps": 4,
                                                         "maxnreg": 128, "AHEAD": True}
    assert bf16(131073, False) == bf16(245760, False) == slices_of_32768
    assert bf16(245761, False) == bf16(262144, False) == {"plan": "cluster", "BLOCK": 16384, "num_warps": 8,
                                                          "maxnreg": 128, "AHEAD": True}
    assert bf16(262145)["plan"] == bf16(262145, False)["plan"] == "split"
    assert bf16(32768, False) == config(32768, False)
    for N in (32768, 32769, 65537, 262144, 262145):
        assert norm_plans.forward_config(N, True, residual=True, clusters=True, bf16=True) == config(N, residual=True)
    assert config(262145, residual=True) == norm_plans.FORWARD_SPLIT["rms+residual"]


@pytest.fixture
def cluster_device(device):
    if not norm_api.cluster.available(torch.device(device)):
        pytest.skip("thread-block clusters need a GPU of compute capability 9.0+ and compiled kernels")
    return device


def cluster_launches(monkeypatch):
    """The names of the kernels norm launches across clusters from now on."""
    launched = []
    real_launch = norm_api.cluster.launch

    def recording_launch(kernel, *args, **kwargs):
        launched.append(kernel.__name__)
        return real_launch(kernel, *args, **kwargs)

    monkeypatch.setattr(norm_api.cluster, "launch", recording_launch)
    return launched


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [4097, 5120, 6008, 7000, 8193, 12289, 16384, 20001, 20008, 32768])
@pytest.mark.parametrize("affine", ["none", "weight", "weight+bias"])
def test_backward_across_a_cluster(kind, dtype, N, affine, monkeypatch, cluster_device):
    """The cluster plan (rows of 8193-32768, LayerNorm's from 4097; 2 to 8 CTAs, the last
    slice masked where N is not a multiple of the slice; 6008 and 20008 are 16-byte vectors
    but not 16-divisible: ALIGN) against float64 torch, through
    autograd: more rows than clusters fit, so each cluster's partial row of dweight / dbias
    adds up many rows. RMSNorm's rows of 4097-12288 and LayerNorm's of 8193-10240 take the
    rows plan (as two tiles but at 7000) instead: checked the same way, with many rows a
    program."""
    x = torch.randn(600, N, device=cluster_device, dtype=dtype) * 2 + 0.5
    w = torch.randn(N, device=cluster_device, dtype=dtype) if affine != "none" else None
    b = torch.randn(N, device=cluster_device, dtype=dtype) if affine == "weight+bias" else None
    launched = cluster_launches(monkeypatch)
    check(kind, x, (N,), w, b)
    across = norm_plans.backward_config(N, kind == "rms", clusters=True)["plan"] == "cluster"
    assert launched == (["_backward_cluster_kernel"] if across else [])
    assert across == (N > 12288 or kind == "layer" and not 8192 < N <= 10240)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [32769, 65536, 80000, 98305, 100003, 131072])
@pytest.mark.parametrize("affine", ["none", "weight+bias"])
def test_backward_across_a_cluster_past_32768(kind, dtype, N, affine, monkeypatch, cluster_device):
    """The backward of rows of 32769-131072 across a cluster (5 to 16 CTAs of 4096 or 8192,
    the last slice masked where N is not a multiple of it; 98305's last slice one wide)
    against float64 torch through autograd, with more rows than clusters fit; LayerNorm's
    rows of 65537-98304 (80000) take the plan without clusters."""
    x = torch.randn(300, N, device=cluster_device, dtype=dtype) * 2 + 0.5
    w = torch.randn(N, device=cluster_device, dtype=dtype) if affine != "none" else None
    b = torch.randn(N, device=cluster_device, dtype=dtype) if affine == "weight+bias" else None
    launched = cluster_launches(monkeypatch)
    check(kind, x, (N,), w, b)
    assert ("_backward_cluster_kernel" in launched) == (kind == "rms" or not 65536 < N <= 98304)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [32769, 40008, 65536, 100003, 131072, 200003, 262144])
@pytest.mark.parametrize("affine", ["none", "weight", "weight+bias+offset"])
def test_rms_forward_across_a_cluster(dtype, N, affine, monkeypatch, cluster_device):
    """RMSNorm's forward across persistent clusters (7 to 16 CTAs, the last slice masked
    where N is not a multiple of the slice), against float64 torch through autograd (the
    backward takes its own plan from the stored rstd): more rows than clusters fit, so each
    cluster takes several rows and the last round's rows past M join with zeros."""
    x = torch.randn(97, N, device=cluster_device, dtype=dtype) * 2 + 0.5
    w = torch.randn(N, device=cluster_device, dtype=dtype) if affine != "none" else None
    b = torch.randn(N, device=cluster_device, dtype=dtype) if affine == "weight+bias+offset" else None
    launched, cluster_launched = launched_kernels(monkeypatch), cluster_launches(monkeypatch)
    check("rms", x, (N,), w, b, weight_offset=1.0 if b is not None else 0.0)
    # the backward (its own plan) runs across a cluster too up to 131072
    assert cluster_launched[:1] == ["_forward_cluster_kernel"] and "_forward_cluster_kernel" not in cluster_launched[1:]
    assert not any("forward" in name for name in launched)


@pytest.mark.parametrize("residual_dtype", [None, torch.float32], ids=["same", "float32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [32769, 65536, 200003])
@pytest.mark.parametrize("cfg", [{"BLOCK": 4096, "num_warps": 4}, {"BLOCK": 8192, "num_warps": 4, "AHEAD": True},
                                 {"BLOCK": 16384, "num_warps": 8, "AHEAD": True, "HELD": True}], ids=str)
def test_rms_residual_forward_across_a_cluster(cfg, N, dtype, residual_dtype, cluster_device):
    """RMSNorm's forward with a residual across persistent clusters, the config given (with
    and without the next row ahead): h = x + residual rounded once to h's dtype, as torch's,
    and y from h, against float64 torch; a float32 residual makes h float32 (not held)."""
    if N // cfg["BLOCK"] > 16:
        pytest.skip("more than 16 slices a row")
    x = torch.randn(97, N, device=cluster_device, dtype=dtype) * 2 + 0.5
    residual = torch.randn(97, N, device=cluster_device, dtype=residual_dtype or dtype)
    w = torch.randn(N, device=cluster_device, dtype=dtype)
    y, h, _, rstd = norm_api._forward(x, residual, w, None, 1e-6, 0.0, True, torch.promote_types(
        x.dtype, residual.dtype), {"plan": "cluster", **cfg})
    h_want = x + residual
    torch.testing.assert_close(h, h_want, rtol=0, atol=0)
    h64 = h_want.double()
    rstd64 = 1 / torch.sqrt(h64.pow(2).mean(-1) + 1e-6)
    assert_matches(y, h64 * rstd64[:, None] * w.double(), F.rms_norm(h_want, (N,), w.to(h_want.dtype), 1e-6),
                   scale=1.0)
    torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-5, atol=0)


@pytest.mark.parametrize("residual_dtype", [None, torch.float32], ids=["same", "float32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [40008, 131072, 262144])
def test_rms_residual_forward_plan(N, dtype, residual_dtype, monkeypatch, cluster_device):
    """rms_norm with a residual past 32768 goes across persistent clusters, h held in 16 bits
    where it is bf16 (x bf16 with a float32 residual makes h float32), against float64 torch
    through autograd."""
    x = torch.randn(37, N, device=cluster_device, dtype=dtype)
    residual = torch.randn(37, N, device=cluster_device, dtype=residual_dtype or dtype)
    w = torch.randn(N, device=cluster_device, dtype=dtype)
    launched, cluster_launched = launched_kernels(monkeypatch), cluster_launches(monkeypatch)
    check("rms", x, (N,), w, residual=residual)
    assert cluster_launched[:1] == ["_forward_cluster_kernel"] and not any("forward" in k for k in launched)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [32769, 40008, 50001, 65536, 100003, 131072, 200003, 262144])
@pytest.mark.parametrize("affine", ["none", "weight", "weight+bias"])
def test_layer_forward_across_a_cluster(dtype, N, affine, monkeypatch, cluster_device):
    """LayerNorm's forward across persistent clusters, as RMSNorm's above: against float64
    torch through autograd, more rows than clusters fit, the last slice masked where N is not
    a multiple of the slice. Past 131072 only bf16 rows go across clusters (the next row
    loaded ahead); the others take the split plan."""
    x = torch.randn(97, N, device=cluster_device, dtype=dtype) * 2 + 0.5
    w = torch.randn(N, device=cluster_device, dtype=dtype) if affine != "none" else None
    b = torch.randn(N, device=cluster_device, dtype=dtype) if affine == "weight+bias" else None
    launched, cluster_launched = launched_kernels(monkeypatch), cluster_launches(monkeypatch)
    check("layer", x, (N,), w, b)
    if N <= 131072 or dtype == torch.bfloat16:
        assert cluster_launched[:1] == ["_forward_cluster_kernel"]
        assert "_forward_cluster_kernel" not in cluster_launched[1:]
        assert not any("forward" in name for name in launched)
    else:
        assert "_forward_cluster_kernel" not in cluster_launched and "_forward_split_kernel" in launched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("stats", [True, False])
def test_layer_forward_across_a_cluster_statistics(stats, dtype, cluster_device):
    """mean and rstd against float64 for rows whose float32 sums would cancel (a mean of 1000
    with a spread of 0.1; a first value of 1000 or -500 among unit normals: flagged, a second
    exchange), a constant row, a row whose squares overflow float32 (variance inf, rstd 0: y
    is the bias, as torch's) and random rows; stored for training only; y the same either way.
    bf16: x held in its 16 bits across the exchanges and widened again (BF16_HELD)."""
    M, N = 40, 131072
    x = torch.randn(M, N, device=cluster_device)
    x[2] = x[2] * 0.1 + 1000.0
    x[3, 0] = 1000.0
    x[5] = 7.0
    x[9] = x[9] * 1e20
    x[20:30, 0] = -500.0  # flagged rows in successive rounds of a cluster: the exchanges' count
    x = x.to(dtype)
    w, b = torch.randn(N, device=cluster_device, dtype=dtype), torch.randn(N, device=cluster_device, dtype=dtype)
    assert norm_plans.forward_config(N, False, clusters=True)["plan"] == "cluster"
    y, _, mean, rstd = norm_api._forward(x, None, w, b, 1e-5, 0.0, False, x.dtype, stats=stats)
    x64 = x.double()
    mean64, var64 = x64.mean(-1), x64.var(-1, unbiased=False)
    rstd64 = 1 / torch.sqrt(var64 + 1e-5)
    want = (x64 - mean64[:, None]) * rstd64[:, None] * w.double() + b.double()
    kept = torch.arange(M, device=cluster_device) != 9
    assert_matches(y[kept], want[kept], F.layer_norm(x, (N,), w, b, 1e-5)[kept])
    torch.testing.assert_close(y[9], b)
    if stats:
        torch.testing.assert_close(mean.double()[kept], mean64[kept], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rstd.double()[kept], rstd64[kept], rtol=1e-4, atol=0)
        assert rstd[9] == 0
    else:
        assert mean.numel() == rstd.numel() == 0


@pytest.mark.parametrize("stats", [True, False])
def test_rms_forward_across_a_cluster_statistics(stats, cluster_device):
    """rstd as torch computes it for a row of zeros (1 / sqrt(eps)), a row of large values and
    random rows, stored for training only; y the same either way."""
    M, N = 40, 131072
    x = torch.randn(M, N, device=cluster_device, dtype=torch.bfloat16)
    x[3] = 0
    x[7] = 3e4
    w = torch.randn(N, device=cluster_device, dtype=torch.bfloat16)
    assert norm_plans.forward_config(N, True, clusters=True)["plan"] == "cluster"
    y, _, _, rstd = norm_api._forward(x, None, w, None, 1e-6, 0.0, True, x.dtype, stats=stats)
    x64 = x.double()
    rstd64 = 1 / torch.sqrt(x64.pow(2).mean(-1) + 1e-6)
    assert_matches(y, x64 * rstd64[:, None] * w.double(), F.rms_norm(x, (N,), w, 1e-6))
    if stats:
        torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-5, atol=0)
    else:
        assert rstd.numel() == 0


@pytest.mark.parametrize("ahead", [False, True])
def test_backward_across_a_cluster_is_deterministic(ahead, cluster_device):
    """dweight / dbias: the same bits on every run (a fixed partial row a cluster, summed in
    a fixed order), with and without the next row loaded ahead; dx against float64 torch."""
    M, N = 1000, 12289
    x = torch.randn(M, N, device=cluster_device, dtype=torch.bfloat16)
    w, b = torch.randn(N, device=cluster_device), torch.randn(N, device=cluster_device)
    dy = torch.randn(M, N, device=cluster_device, dtype=torch.bfloat16)
    _, _, mean, rstd = norm_api._forward(x, None, w, b, 1e-5, 0.0, False, x.dtype)
    cfg = {**norm_plans.backward_config(N, False, clusters=True), "AHEAD": ahead}
    first = norm_api._backward(dy, None, x, w, True, mean, rstd, 0.0, False, x.dtype, cfg)
    again = norm_api._backward(dy, None, x, w, True, mean, rstd, 0.0, False, x.dtype, cfg)
    assert all(torch.equal(g, g2) for g, g2 in zip(first, again))
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    want = torch.autograd.grad(F.layer_norm(x64, (N,), w64, b64, 1e-5), (x64, w64, b64), dy.double())
    for g, g64 in zip(first, want):
        assert_matches(g, g64, g64.to(g.dtype))


def test_row_alignment():
    """The kernels' ALIGN: the largest power of 2 up to 8 dividing the row length and every
    row stride (a stride of 0, an expanded row, divides by anything); 1 where 16 divides them
    all (Triton's own specialisation covers those)."""
    from pintail._core.launch import row_alignment
    assert row_alignment(1000, 1000, 0, 0, 1000) == 8
    assert row_alignment(3000, 6000) == 8
    assert row_alignment(700) == 4
    assert row_alignment(1024, 2048, 0) == 1
    assert row_alignment(1024, 1000) == 8
    assert row_alignment(4097) == 1


@pytest.mark.parametrize("N", [300, 2048, 3000])
def test_layer_norm_of_rows_with_values_past_float32_squares(N, plan, device):
    """A value above ~1.8e19 overflows a float32 square: the row is flagged (its sums are
    inf or NaN) and comes out as torch's float32 one (variance inf: rstd 0, y = bias), not
    NaN. A first value of 1e19 overflows the shifted squares alone: the row's deviations do
    not, and its output is torch's normal one. inf and NaN rows stay NaN."""
    x = torch.randn(5, N, device=device)
    x[0, 9], x[1, N // 2], x[2, 5], x[3, 7] = 3e38, -2e19, float("inf"), float("nan")
    x[4, 0] = 1e19
    w, b = torch.randn(N, device=device), torch.randn(N, device=device)
    ours = pintail.layer_norm(x, (N,), w, b)
    torch.testing.assert_close(ours, F.layer_norm(x, (N,), w, b), equal_nan=True)


@pytest.mark.parametrize("parts, N", [(5, 33), (32, 100), (70, 100), (600, 40), (1100, 24), (3, 5000)])
@pytest.mark.kernels_only
def test_sum_partials(parts, N, monkeypatch, device):
    """dweight / dbias from their float32 partial rows, in the parameters' dtypes: one step
    of all of them (3, 5, 70, 600: masked past the count), two steps of 1024 (1100); the
    same sum on every call (a fixed order)."""
    launches = recorded_launches(monkeypatch)
    dw_parts = torch.randn(parts, N, device=device)
    db_parts = torch.randn(parts, N, device=device)
    for dtype in (torch.float32, torch.bfloat16):
        dw, db = norm_api._sum_partials(dw_parts, db_parts, dtype, dtype)
        for got, want in ((dw, dw_parts), (db, db_parts)):
            assert got.dtype == dtype
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(got.double(), want.double().sum(0), rtol=tol, atol=tol)
    again, _ = norm_api._sum_partials(dw_parts, db_parts, torch.float32, torch.float32)
    assert torch.equal(norm_api._sum_partials(dw_parts, None, torch.float32, None)[0], again)
    step = {3: 4, 5: 8, 32: 32, 70: 128, 600: 1024, 1100: 1024}[parts]
    assert {kwargs["PARTS_BLOCK"] for name, kwargs in launches if name == "_sum_partials_kernel"} == {step}
