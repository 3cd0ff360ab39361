"""torch.library and torch.compile on every path: `torch.library.opcheck` of every pintail op
over a grid of its arguments, and torch.compile(fullgraph=True, dynamic=True) of every public
function, forward and backward, against float64 torch: with inductor on a GPU; on a CPU with
aot_eager (the same traced graphs; inductor's C++ build took most of the CPU suite's time
here), inductor once (test_inductor_on_a_cpu). The file runs on
each path of the suite: the interpreter, the reference path (--path reference) and CUDA."""

import importlib

import pytest
import torch
import torch.nn.functional as F

import pintail
from helpers import assert_matches
from test_rotary import hf_rotary, widen

# ------------------------------------------------------------------------------- opcheck


def dtypes_of(on_reference):
    """float64 runs on the reference path only (the kernels leave it to torch)."""
    return [torch.float32, torch.bfloat16] + ([torch.float64] if on_reference else [])


def strided_rows(M, N, dtype, device):
    """(M, N) rows with a row stride wider than N (a slice of a wider buffer)."""
    return torch.randn(M, N + 3, dtype=dtype, device=device)[:, :N]


def opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("case", ["last", "middle", "first", "empty", "transposed"])
@pytest.mark.parametrize("log", [False, True])
def test_opcheck_softmax(case, log, device, on_reference):
    for dtype in dtypes_of(on_reference):
        x, dim = {"last": (torch.randn(3, 37, dtype=dtype, device=device), -1),
                  "middle": (torch.randn(2, 5, 9, dtype=dtype, device=device), 1),
                  "first": (torch.randn(5, 7, dtype=dtype, device=device), 0),
                  "empty": (torch.randn(0, 9, dtype=dtype, device=device), 1),
                  "transposed": (torch.randn(11, 6, dtype=dtype, device=device).t(), 1)}[case]
        out_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
        opcheck(torch.ops.pintail.softmax_forward.default, (x.requires_grad_(), dim, log, out_dtype))
        y = torch.softmax(x.detach().to(out_dtype), dim)
        opcheck(torch.ops.pintail.softmax_backward.default, (y, torch.randn_like(y), dim, log, dtype))


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize("extras", ["plain", "residual", "weight_offset_bias", "strided", "empty"])
def test_opcheck_norm(rms, extras, device, on_reference):
    if extras == "residual" and not rms:
        pytest.skip("LayerNorm takes no residual (pintail.layer_norm has none)")
    for dtype in dtypes_of(on_reference):
        M, N = (0 if extras == "empty" else 6), 40
        x = strided_rows(M, N, dtype, device) if extras == "strided" else torch.randn(M, N, dtype=dtype, device=device)
        residual = torch.randn(M, N, dtype=dtype, device=device) if extras == "residual" else None
        weight = torch.randn(N, dtype=dtype, device=device)
        bias = torch.randn(N, dtype=dtype, device=device) if extras == "weight_offset_bias" else None
        offset = 1.0 if extras == "weight_offset_bias" else 0.0
        for stats in (True, False):  # without stats (no backward to come) nothing requires grad
            args = [t.clone().requires_grad_(stats) if t is not None else None for t in (x, residual, weight, bias)]
            opcheck(torch.ops.pintail.norm_forward.default, (*args, 1e-5, offset, rms, dtype, stats))
        y, h, mean, rstd = torch.ops.pintail.norm_forward.default(x, residual, weight, bias, 1e-5, offset, rms,
                                                                  dtype, True)
        held = h if residual is not None else x
        dh = torch.randn_like(h) if residual is not None else None
        opcheck(torch.ops.pintail.norm_backward.default,
                (torch.randn_like(y), dh, held.contiguous(), weight, bias is not None, mean, rstd, offset, rms))


@pytest.mark.parametrize("options", ["plain", "ignored_weight_smoothing", "z_softcap", "probabilities", "empty"])
def test_opcheck_cross_entropy(options, device, on_reference):
    for dtype in dtypes_of(on_reference):
        M, V = (0 if options == "empty" else 7), 33
        x = torch.randn(M, V, dtype=dtype, device=device) * 3
        prob = options == "probabilities"
        target = torch.softmax(torch.randn(M, V, device=device), 1).to(dtype) if prob else \
            torch.randint(0, V, (M,), device=device)
        if options == "ignored_weight_smoothing":
            target[1] = -100
        weight = torch.rand(V, dtype=dtype, device=device) if options in ("ignored_weight_smoothing",
                                                                         "probabilities") else None
        smoothing = 0.2 if options in ("ignored_weight_smoothing", "probabilities") else 0.0
        z, cap = (1e-3, 12.0) if options == "z_softcap" else (0.0, 0.0)
        z_ratio = None
        if options == "ignored_weight_smoothing":  # the weighted mean's z-loss factor, a 0-d tensor
            z, z_ratio = 1e-3, torch.tensor(1.7, device=device)
        options_args = (-100, smoothing, z, cap, prob, z_ratio)
        opcheck(torch.ops.pintail.cross_entropy_forward.default,
                (x.clone().requires_grad_(), target, weight, *options_args))
        rows, stats, mass = torch.ops.pintail.cross_entropy_forward.default(x, target, weight, *options_args)
        opcheck(torch.ops.pintail.cross_entropy_backward.default,
                (torch.randn_like(rows), x, target, weight, stats, mass, *options_args))


@pytest.mark.parametrize("options", ["plain", "bias_weight_smoothing", "z_softcap", "empty"])
def test_opcheck_linear_cross_entropy(options, device, on_reference, monkeypatch):
    monkeypatch.setattr(importlib.import_module("pintail.linear_cross_entropy.plans"), "MIN_CHUNK_COLUMNS", 64)
    for dtype in dtypes_of(on_reference):
        M, K, V = (0 if options == "empty" else 7), 16, 150  # chunks of 64: two whole, one of 22
        x = torch.randn(M, K, dtype=dtype, device=device)
        W = torch.randn(V, K, dtype=dtype, device=device) / 4
        b = torch.randn(V, dtype=dtype, device=device) if options == "bias_weight_smoothing" else None
        target = torch.randint(0, V, (M,), device=device)
        weight, smoothing, z, cap, z_ratio = None, 0.0, 0.0, 0.0, None
        if options == "bias_weight_smoothing":
            target[1] = -100
            weight, smoothing = torch.rand(V, dtype=dtype, device=device), 0.2
            z, z_ratio = 1e-3, torch.tensor(1.7, device=device)
        elif options == "z_softcap":
            z, cap = 1e-3, 12.0
        options_args = (-100, smoothing, z, cap, z_ratio, M * 64 * 4 if M else None)
        grads = [t.clone().requires_grad_() if t is not None else None for t in (x, W, b)]
        opcheck(torch.ops.pintail.linear_cross_entropy_forward.default, (*grads, target, weight, *options_args))
        rows, stats = torch.ops.pintail.linear_cross_entropy_forward.default(x, W, b, target, weight, *options_args)
        opcheck(torch.ops.pintail.linear_cross_entropy_backward.default,
                (torch.randn_like(rows), x, W, b, target, weight, stats, *options_args, True, True, b is not None))
        # the token-chunk plan: chunks of 3 rows (two whole, one of 1), W float32 beside 16-bit x too
        # (a function without autograd of its own: _TokenChunks differentiates it)
        for head in {W, W.float()}:
            opcheck(torch.ops.pintail.linear_cross_entropy_tokens.default,
                    (x, head, b, target, weight, *options_args[:5], 3, True, True, b is not None))
            sums = [torch.randn(M, K, device=device), torch.randn(*head.shape, device=device),
                    torch.randn(V if b is not None else 0, device=device)]
            opcheck(torch.ops.pintail.linear_cross_entropy_scale_.default, (*sums, torch.rand(M, device=device)))


@pytest.mark.parametrize("case", ["separate", "views", "fused", "empty"])
def test_opcheck_gated(case, device, on_reference):
    for dtype in dtypes_of(on_reference):
        for activation in (0, 1, 2):
            M, N = (0 if case == "empty" else 5), 24
            projection = torch.randn(M, 2 * N, dtype=dtype, device=device)
            x, up = {"separate": (projection[:, :N].contiguous(), projection[:, N:].contiguous()),
                     "views": (projection[:, :N], projection[:, N:]), "fused": (projection, None),
                     "empty": (projection[:, :N].contiguous(), projection[:, N:].contiguous())}[case]
            leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, up)]
            opcheck(torch.ops.pintail.gated_forward.default, (*leaves, activation))
            opcheck(torch.ops.pintail.gated_backward.default,
                    (torch.randn(M, N, dtype=dtype, device=device), x, up, activation))


@pytest.mark.parametrize("case", ["bshd", "bhsd", "transposed", "interleaved_partial", "positions", "k_absent"])
def test_opcheck_rotary(case, device, on_reference):
    for dtype in dtypes_of(on_reference):
        B, S, H, D = 2, 5, 3, 16
        q = torch.randn(B, S, H, D, dtype=dtype, device=device)
        k = torch.randn(B, S, 1, D, dtype=dtype, device=device)
        seq_dim, rotary_dim, interleaved, positions = 1, D, False, None
        if case == "bhsd":
            q, k, seq_dim = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), 2
        elif case == "transposed":  # (B, S, H, D) values held as a (B, H, S, D) buffer
            q, k = q.transpose(1, 2).contiguous().transpose(1, 2), k.transpose(1, 2).contiguous().transpose(1, 2)
        elif case == "interleaved_partial":
            rotary_dim, interleaved = 8, True
        elif case == "positions":
            positions = torch.randint(0, 9, (B, S), device=device)
        cos, sin = torch.randn(9, rotary_dim // 2, dtype=dtype, device=device), \
            torch.randn(9, rotary_dim // 2, dtype=dtype, device=device)
        second = None if case == "k_absent" else k.requires_grad_()
        for backward in (False, True):
            opcheck(torch.ops.pintail.rotary.default,
                    (q.clone().requires_grad_(), second, cos, sin, positions, seq_dim, 0, rotary_dim, interleaved,
                     backward))


# ------------------------------------------------------------------ compile, fullgraph


def significant_strides(t):
    """Strides of the dims longer than 1 (the others' strides mean nothing)."""
    return tuple(stride for size, stride in zip(t.shape, t.stride()) if size > 1)


def compiled_matches(ours, truth, inputs, upstream_seed=0, inductor_on_cpu=False):
    """ours(*inputs) compiled (inductor on a GPU; on a CPU aot_eager, the same traced graphs,
    unless inductor_on_cpu; fullgraph, dynamic shapes) against eager: outputs and
    the gradients of every floating input that requires grad, same dtypes and layouts; and
    both against `truth` on float64 copies. 16-bit gradients are compared with eager only:
    they come from 16-bit forward outputs, so their error against float64 is the op's
    conditioning, which the op's own tests bound entry by entry."""
    def run(fn, leaves):
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        generator = torch.Generator().manual_seed(upstream_seed)
        ups = [torch.randn(o.shape, generator=generator, dtype=torch.float64).to(o.device, o.dtype) for o in outs]
        wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = torch.autograd.grad(outs, wrt, ups)
        return outs, grads

    def leaves(dtype=None):
        return [t.detach().to(dtype or t.dtype).requires_grad_(t.requires_grad)
                if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]

    torch._dynamo.reset()
    on_gpu = any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs)
    backend = "inductor" if on_gpu or inductor_on_cpu else "aot_eager"  # on a CPU: the same graphs, minutes less
    compiled = torch.compile(ours, fullgraph=True, dynamic=True, backend=backend)
    eager_outs, eager_grads = run(ours, leaves())
    outs, grads = run(compiled, leaves())
    truth_outs, truth_grads = run(truth, leaves(torch.float64))
    for got, eager, want, is_grad in zip((*outs, *grads), (*eager_outs, *eager_grads), (*truth_outs, *truth_grads),
                                         [False] * len(outs) + [True] * len(grads)):
        assert (got.dtype, got.shape, significant_strides(got)) == \
            (eager.dtype, eager.shape, significant_strides(eager)), (got.dtype, got.stride(), eager.stride())
        assert_matches(got, eager.double())
        if not (is_grad and got.element_size() == 2):
            assert_matches(got, want)


def compile_dtypes(on_reference):
    """The reference path computes what torch computes: float32 and float64 there; the
    kernels in float32 and bf16."""
    return [torch.float32, torch.float64] if on_reference else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dim", [-1, 0])
def test_compile_softmax(log, dim, device, on_reference):
    for dtype in compile_dtypes(on_reference):
        ours_fn, torch_fn = (pintail.log_softmax, torch.log_softmax) if log else (pintail.softmax, torch.softmax)
        x = torch.randn(6, 37, dtype=dtype, device=device, requires_grad=True)
        compiled_matches(lambda x: ours_fn(x * 2, dim), lambda x: torch_fn(x * 2, dim), [x])


@pytest.mark.parametrize("kind", ["rms_residual_offset", "rms_plain", "layer"])
def test_compile_norms(kind, device, on_reference):
    for dtype in compile_dtypes(on_reference):
        N = 48
        x = torch.randn(3, 5, N, dtype=dtype, device=device, requires_grad=True)
        r = torch.randn(3, 5, N, dtype=dtype, device=device, requires_grad=True)
        w = torch.randn(N, dtype=dtype, device=device, requires_grad=True)
        b = torch.randn(N, dtype=dtype, device=device, requires_grad=True)
        eps = 1e-6
        if kind == "rms_residual_offset":
            compiled_matches(lambda x, r, w: pintail.rms_norm(x * 2, (N,), w, eps, residual=r, weight_offset=1.0),
                             lambda x, r, w: (F.rms_norm(x * 2 + r, (N,), w + 1.0, eps), x * 2 + r), [x, r, w])
        elif kind == "rms_plain":
            compiled_matches(lambda x, w: pintail.rms_norm(x * 2, (N,), w, eps),
                             lambda x, w: F.rms_norm(x * 2, (N,), w, eps), [x, w])
        else:
            compiled_matches(lambda x, w, b: pintail.layer_norm(x * 2, (N,), w, b, eps),
                             lambda x, w, b: F.layer_norm(x * 2, (N,), w, b, eps), [x, w, b])


def test_inductor_on_a_cpu(device, on_reference):
    """Inductor itself around pintail's ops on a CPU (the other tests take aot_eager there):
    a fused residual norm then a softmax, whose strides inductor chooses."""
    if device.type != "cpu":
        pytest.skip("on a GPU every compile test takes inductor")
    dtype = torch.float32
    x, r = (torch.randn(3, 5, 48, dtype=dtype, requires_grad=True) for _ in range(2))
    w = torch.randn(48, dtype=dtype, requires_grad=True)

    def ours(x, r, w):
        y, h = pintail.rms_norm(x * 2, (48,), w, 1e-6, residual=r)
        return pintail.softmax(y.transpose(0, 1), -1), h

    def truth(x, r, w):
        h = x * 2 + r
        return torch.softmax(F.rms_norm(h, (48,), w, 1e-6).transpose(0, 1), -1), h

    compiled_matches(ours, truth, [x, r, w], inductor_on_cpu=True)


@pytest.mark.parametrize("options", [dict(), dict(weight=True, label_smoothing=0.1, z_loss=1e-3),
                                     dict(reduction="none", z_loss=1e-3, softcap=8.0), dict(probabilities=True)],
                         ids=["plain", "weight_smoothing", "none_z_softcap", "probabilities"])
def test_compile_cross_entropy(options, device, on_reference):
    for dtype in compile_dtypes(on_reference):
        options = dict(options)
        M, V = 9, 50
        x = (torch.randn(M, V, device=device) * 3).to(dtype).requires_grad_()
        if options.pop("probabilities", False):
            target = torch.softmax(torch.randn(M, V, device=device), 1).to(dtype)
        else:
            target = torch.randint(0, V, (M,), device=device)
            target[2] = -100
        weight = torch.rand(V, device=device).to(dtype) if options.pop("weight", False) else None
        z, cap = options.pop("z_loss", 0.0), options.pop("softcap", None)

        def ours(x, weight):
            return pintail.cross_entropy(x * 2, target, weight, z_loss=z, softcap=cap, **options)

        def theirs(x, weight):
            logits = x * 2 if cap is None else cap * torch.tanh(x * 2 / cap)
            loss = F.cross_entropy(logits, target.to(x.dtype) if target.is_floating_point() else target, weight,
                                   **options)
            if not z:
                return loss
            kept = (target != -100).to(logits.dtype) if not target.is_floating_point() else torch.ones_like(logits[:, 0])
            z_rows = z * torch.logsumexp(logits, 1) ** 2 * kept  # a mean over kept rows, whatever the weights
            reduction = options.get("reduction", "mean")
            return loss + {"none": z_rows, "sum": z_rows.sum(), "mean": z_rows.sum() / kept.sum()}[reduction]

        compiled_matches(ours, theirs, [x, weight])


@pytest.mark.parametrize("options", [dict(), dict(weight=True, label_smoothing=0.1, z_loss=1e-3, bias=True),
                                     dict(reduction="none", softcap=8.0)], ids=["plain", "weight_smoothing_z_bias",
                                                                               "none_softcap"])
def test_compile_linear_cross_entropy(options, device, on_reference, monkeypatch):
    """(batch, seq, hidden) through the head, several chunks (of 64 classes), no graph break."""
    monkeypatch.setattr(importlib.import_module("pintail.linear_cross_entropy.plans"), "MIN_CHUNK_COLUMNS", 64)
    monkeypatch.setattr(importlib.import_module("pintail.linear_cross_entropy.plans"), "CHUNK_MULTIPLE", 64)
    for dtype in compile_dtypes(on_reference):
        options = dict(options)
        B, S, K, V = 2, 5, 16, 150
        x = torch.randn(B, S, K, device=device).to(dtype).requires_grad_()
        W = (torch.randn(V, K, device=device) / 4).to(dtype).requires_grad_()
        b = torch.randn(V, device=device).to(dtype).requires_grad_() if options.pop("bias", False) else None
        target = torch.randint(0, V, (B, S), device=device)
        target[0, 2] = -100
        weight = torch.rand(V, device=device).to(dtype) if options.pop("weight", False) else None
        z, cap = options.pop("z_loss", 0.0), options.pop("softcap", None)

        def ours(x, W, b):
            return pintail.linear_cross_entropy(x * 2, W, target, linear_bias=b, weight=weight, z_loss=z, softcap=cap,
                                                **options)

        def theirs(x, W, b):
            logits = F.linear(x * 2, W, b)
            logits = logits if cap is None else cap * torch.tanh(logits / cap)
            logits, t = logits.reshape(-1, V), target.reshape(-1)
            loss = F.cross_entropy(logits, t, weight.to(x.dtype) if weight is not None else None, **options)
            if not z:
                return loss.reshape(B, S) if options.get("reduction") == "none" else loss
            kept = (t != -100).to(logits.dtype)
            return loss + (z * torch.logsumexp(logits, 1) ** 2 * kept).sum() / kept.sum()

        compiled_matches(ours, theirs, [x, W, b] if b is not None else [x, W, None])


@pytest.mark.parametrize("kind", ["swiglu_views", "geglu_tanh", "swiglu_fused"])
def test_compile_gated(kind, device, on_reference):
    for dtype in compile_dtypes(on_reference):
        projection = torch.randn(2, 5, 48, device=device).to(dtype).requires_grad_()
        if kind == "swiglu_views":
            compiled_matches(lambda p: pintail.swiglu(p[..., :24] * 2, p[..., 24:]),
                             lambda p: F.silu(p[..., :24] * 2) * p[..., 24:], [projection])
        elif kind == "geglu_tanh":
            compiled_matches(lambda p: pintail.geglu(p[..., :24], p[..., 24:] * 2),
                             lambda p: F.gelu(p[..., :24], approximate="tanh") * p[..., 24:] * 2, [projection])
        else:
            compiled_matches(lambda p: pintail.swiglu(p * 2), lambda p: F.silu(p[..., :24] * 2) * p[..., 24:] * 2,
                             [projection])


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "transposed_view", "interleaved_partial", "positions"])
def test_compile_rotary(layout, device, on_reference):
    for dtype in compile_dtypes(on_reference):
        B, S, H, D = 2, 6, 3, 16
        rotary_dim = 8 if layout == "interleaved_partial" else D
        interleaved = layout == "interleaved_partial"
        positions = torch.randint(0, 10, (B, S), device=device) if layout == "positions" else None
        rows = positions if positions is not None else torch.arange(S, device=device).expand(B, S)
        cos = torch.randn(10, rotary_dim // 2, dtype=dtype, device=device)
        sin = torch.randn(10, rotary_dim // 2, dtype=dtype, device=device)
        q = torch.randn(B, S, H, D, dtype=dtype, device=device)
        k = torch.randn(B, S, 1, D, dtype=dtype, device=device)
        pintail_layout = "bhsd" if layout == "bhsd" else "bshd"
        if layout == "bhsd":
            q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        elif layout == "transposed_view":
            q, k = q.transpose(1, 2).contiguous().transpose(1, 2), k.transpose(1, 2).contiguous().transpose(1, 2)
        q.requires_grad_(), k.requires_grad_()

        def ours(q, k):
            return pintail.apply_rotary(q * 2, k * 2, cos, sin, position_ids=positions,
                                        layout=pintail_layout, rotary_dim=rotary_dim, interleaved=interleaved)

        def theirs(q, k):
            c, s = widen(cos[rows], interleaved).to(q.dtype), widen(sin[rows], interleaved).to(q.dtype)
            move = (lambda t: t.transpose(1, 2)) if layout == "bhsd" else (lambda t: t)
            return tuple(move(hf_rotary(move(t * 2), c, s, interleaved)) for t in (q, k))

        compiled_matches(ours, theirs, [q, k])
