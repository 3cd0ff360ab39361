import importlib

import pytest
import torch
import torch.nn.functional as F

import pintail
from helpers import DTYPES, RTOL, assert_matches, boundary_shifts, line_aligned_rows

cross_entropy_api = importlib.import_module("pintail.cross_entropy.api")
cross_entropy_plans = importlib.import_module("pintail.cross_entropy.plans")
loss_checks = importlib.import_module("pintail._loss.checks")
loss_plans = importlib.import_module("pintail._loss.plans")
MULTI_CHUNK = cross_entropy_plans.FORWARD_BLOCKS[0] + 1000  # more than one chunk per row in both kernels


def torch_cross_entropy(x, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                        z_loss=0.0, softcap=None):
    """The extras composed from torch ops: (loss, z-loss term, lse)."""
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    loss = F.cross_entropy(x, target, weight, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    class_dim = 0 if x.dim() == 1 else 1
    lse = torch.logsumexp(x.float() if x.dtype != torch.float64 else x, dim=class_dim)
    # z-loss: a per-token penalty, averaged over the kept rows whatever the class weights
    kept = torch.ones_like(lse) if target.dtype.is_floating_point else (target != ignore_index).to(lse.dtype)
    z_rows = z_loss * lse**2 * kept
    z = {"none": z_rows, "sum": z_rows.sum(), "mean": z_rows.sum() / kept.sum()}[reduction]
    return loss + z.to(loss.dtype), z, lse


def check(x, target, upstream=None, **kw):
    """pintail against torch: loss, z-loss, lse and the logits' gradient; float64 truth and
    torch in the logits' dtype."""
    dtype = x.dtype
    cast = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    x_ours = x.detach().requires_grad_()
    loss, z, lse = pintail.cross_entropy(x_ours, target, return_z_loss=True, return_lse=True, **kw)
    x_truth = x.detach().double().requires_grad_()
    target_truth = target.double() if target.is_floating_point() else target
    loss_truth, z_truth, lse_truth = torch_cross_entropy(x_truth, target_truth, **cast)
    x_same = x.detach().requires_grad_()
    target_same = target.to(dtype) if target.is_floating_point() else target
    loss_same, _, lse_same = torch_cross_entropy(x_same, target_same,
                                                 **{k: (v.to(dtype) if isinstance(v, torch.Tensor) else v)
                                                    for k, v in kw.items()})
    # A loss and its gradient are sums of terms of the size of the class weights and the
    # upstream gradient (about 1 here), also where they cancel to 0 (V = 1).
    assert loss.dtype == dtype and loss.shape == loss_truth.shape
    assert_matches(loss, loss_truth, loss_same)
    assert_matches(z, z_truth, z_truth.to(dtype))
    assert lse.dtype == torch.float32
    assert_matches(lse, lse_truth, lse_same)
    if upstream is None:
        upstream = torch.randn(loss.shape, device=x.device)
    upstream = upstream.to(dtype)  # as the op gets it: its rounding is not the op's error
    (dx,) = torch.autograd.grad(loss, x_ours, upstream)
    (dx_truth,) = torch.autograd.grad(loss_truth, x_truth, upstream.double())
    (dx_same,) = torch.autograd.grad(loss_same, x_same, upstream)
    assert dx.dtype == dtype
    assert_matches(dx, dx_truth, dx_same, scale=gradient_scale(x_truth.detach(), target_truth, upstream.double(),
                                                                 **cast))
    return loss, dx


def gradient_scale(x, target, upstream, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                   z_loss=0.0, softcap=None):
    """The natural size of each entry of dloss/dx (float64 logits x, classes on dim 1): the
    magnitudes of the terms that make it, g (p_k A + e/V w_k + (1 - e) w_t [k = t]) with A =
    (1 - e) w_t + e/V W + 2 z |lse| (B + 2 z |lse| and w_k y'_k for probability targets),
    g the row's upstream gradient. They bound the error where the terms cancel (p_t near 1,
    p_k near e/V), and p_k = exp(x_k - lse) errs relatively by about eps |x_k - lse|, 1 + |x_k
    - lse| / 8 times what the tolerance allows alone. A softcap c adds to p_k an error of about 2 c eps (the capped logit's
    absolute error is c eps), 1 + c / 8 times what the tolerance allows for it alone."""
    one_row = x.dim() == 1
    x = x[None] if one_row else x.movedim(1, -1)  # classes last
    if target.is_floating_point():
        target = target[None] if one_row else target.movedim(1, -1)
    V = x.shape[-1]
    cap = 1.0
    if softcap is not None:
        tanh = torch.tanh(x / softcap)
        x, cap = softcap * tanh, (1 + tanh.square()) * (1 + softcap / 8)
    lse = torch.logsumexp(x, -1, keepdim=True)
    p = torch.exp(x - lse)
    p = torch.where(p > 0, p * (1 + (x - lse).abs() / 8), 0.0)  # exp(a) errs by about eps |a| relative
    w = weight if weight is not None else torch.ones(V, dtype=x.dtype, device=x.device)
    e = label_smoothing
    if target.is_floating_point():
        y = ((1 - e) * target + e / V) * w
        terms = p * (y.sum(-1, keepdim=True) + 2 * z_loss * lse.abs()) + y
        kept = torch.ones_like(lse)
    else:
        t = target.reshape(*x.shape[:-1], 1)
        kept = (t != ignore_index).to(x.dtype)
        safe = torch.where(t != ignore_index, t, 0).clamp(0, V - 1)
        w_t = (1 - e) * w[safe]
        z_ratio = 1.0  # the z term averages over kept rows: g's weighted denominator times W / kept
        if reduction == "mean" and weight is not None:
            z_ratio = (w[safe] * kept).sum() / kept.sum().clamp_min(1)
        terms = p * (w_t + e / V * w.sum() + 2 * z_loss * z_ratio * lse.abs()) + e / V * w
        terms = terms.scatter_add(-1, safe, w_t) * kept
    g = upstream.reshape(-1)[0] if reduction != "none" else upstream.reshape(*x.shape[:-1], 1)
    if reduction == "mean":
        g = g / (kept.sum() if weight is None or target.is_floating_point() else (w[safe] * kept).sum())
    out = g.abs() * terms * cap
    return out[0] if one_row else out.movedim(-1, 1)


def class_targets(M, V, device, ignored=(1,)):
    t = torch.randint(0, V, (M,), device=device)
    for i in ignored:
        if i < M:
            t[i] = -100
    return t


OPTIONS = [
    {},
    {"weight": "w"},
    {"label_smoothing": 0.1},
    {"weight": "w", "label_smoothing": 0.25},
    {"reduction": "sum", "weight": "w"},
    {"reduction": "none", "label_smoothing": 0.1},
    {"reduction": "none", "weight": "w", "label_smoothing": 1.0},
    {"ignore_index": 3, "weight": "w"},
]


def with_weight(options, V, device):
    return {k: (torch.rand(V, device=device) + 0.1 if v == "w" else v) for k, v in options.items()}


def record_launches(monkeypatch, kernels, record):
    """The list of record(grid, launch options) of each launch of the kernels named, which
    still run."""
    recorded = []
    real_launch = cross_entropy_api.launch

    def recording_launch(kernel, grid, *args, **kwargs):
        if kernel.__name__ in kernels:
            recorded.append(record(grid, kwargs))
        real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(cross_entropy_api, "launch", recording_launch)
    return recorded


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [1, 7, 1000, MULTI_CHUNK])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_class_targets(dtype, V, options, device):
    M = 5
    x = (torch.randn(M, V, device=device) * 3).to(dtype)
    kw = with_weight(options, V, device)
    target = class_targets(M, V, device, ignored=() if "ignore_index" in kw else (1,))
    if "ignore_index" in kw:
        target[0] = kw["ignore_index"]
    check(x, target, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V, x_pad", [(9, 16), (1001, 16), (MULTI_CHUNK + 1, 16), (1001, 1)])
@pytest.mark.parametrize("options", [{}, {"weight": "w", "label_smoothing": 0.25}, {"ignore_index": 3, "weight": "w"},
                                     {"reduction": "none", "label_smoothing": 0.1}, {"z_loss": 1e-3, "softcap": 15.0}],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("boundary", [16, 128])
@pytest.mark.kernels_only
def test_vocabularies_from_16_byte_boundaries(dtype, V, x_pad, options, boundary, monkeypatch, device):
    """ODD_VOCAB_SHIFT (on by default; set here whatever the default): class-index rows of a
    length no vector width divides go from their first 16-byte boundary, the classes outside
    their whole 16-byte pieces one at a time. The logits are a view x_pad classes wider a row
    than the gradient: the forward reads the logits alone (SHIFT taken); the backward's
    strides agree modulo 16 bytes with x_pad 16 (SHIFT taken), not with 1 (SHIFT 0). Targets
    and the largest logits sit in the ends. Boundaries of 16 and 128 bytes in both directions
    (VOCAB_BOUNDARY_BYTES)."""
    monkeypatch.setattr(cross_entropy_plans, "ODD_VOCAB_SHIFT", True)
    monkeypatch.setattr(cross_entropy_plans, "VOCAB_BOUNDARY_BYTES", {"forward": boundary, "backward": boundary})
    M = 6
    wide = torch.randn(M, V + x_pad, device=device) * 3
    wide[4, 0] = wide[5, V - 1] = 30.0
    x = wide.to(dtype)[:, :V]
    kw = with_weight(options, V, device)
    target = class_targets(M, V, device, ignored=() if "ignore_index" in kw else (1,))
    target[2], target[3] = 0, V - 1
    if "ignore_index" in kw:
        target[0] = kw["ignore_index"]
    shifts = record_launches(monkeypatch, ("_forward_kernel", "_backward_kernel"), lambda grid, kw: kw["SHIFT"])
    check(x, target, **kw)
    taken = boundary_shifts(dtype, boundary)
    assert shifts[0] in taken and (shifts[1] in taken if x_pad == 16 else shifts[1] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [9, 1001, MULTI_CHUNK + 1])
@pytest.mark.parametrize("target_dtype", ["same", "float32"])
@pytest.mark.parametrize("options", [{}, {"weight": "w", "label_smoothing": 0.25}, {"z_loss": 1e-3, "softcap": 15.0},
                                     {"reduction": "none"}],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.kernels_only
def test_probability_targets_from_16_byte_boundaries(dtype, V, target_dtype, options, monkeypatch, device):
    """Probability targets over odd vocabularies: the logits (a view 16 classes wider a
    row than the targets and the gradient) and the targets go from the same boundary in both
    directions (SHIFT), also where the targets' dtype is wider than the logits'; the largest
    logits and target mass sit in the ends."""
    monkeypatch.setattr(cross_entropy_plans, "ODD_VOCAB_SHIFT", True)
    M = 5
    wide = torch.randn(M, V + 16, device=device) * 3
    wide[3, 0] = wide[4, V - 1] = 30.0
    x = wide.to(dtype)[:, :V]
    target = torch.softmax(torch.randn(M, V, device=device) * 2, dim=1)
    target[1, 0] = target[2, V - 1] = 5.0
    target = target.to(dtype if target_dtype == "same" else torch.float32)
    shifts = record_launches(monkeypatch, ("_forward_probs_kernel", "_backward_probs_kernel"),
                             lambda grid, kw: kw["SHIFT"])
    check(x, target, **with_weight(options, V, device))
    assert len(shifts) == 2 and all(shift in boundary_shifts(dtype, 128) for shift in shifts)


def test_probability_targets_off_the_logits_boundaries():
    """Targets whose rows start elsewhere against a boundary than the logits' (strides that
    disagree modulo 16 bytes) keep the plain rows (SHIFT 0)."""
    x = torch.randn(4, 1001 + 16, dtype=torch.bfloat16)[:, :1001]
    target = torch.randn(4, 1001 + 1, dtype=torch.bfloat16)[:, :1001]
    assert cross_entropy_plans._vectors(1001, "forward", (x, target)) == (1, 0)
    assert cross_entropy_plans._vectors(1001, "forward", (x, target.contiguous()))[1] == 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_weight_rows_for_rows_from_boundaries(dtype):
    """With SHIFT, the forward kernels read every class's weight from a table whose row h is the
    weights from class h on (0 past V), each row on a 16-byte boundary (a 16-divisible
    stride); without SHIFT, or where only w[t] is read, the weights themselves."""
    V, shift = 1001, 8
    weight = torch.rand(V, dtype=dtype) + 0.5
    table, stride = cross_entropy_api._weight_rows(weight, V, shift, True, None)
    assert stride % 16 == 0 and stride >= V and table.shape == (shift, stride)
    assert table.data_ptr() % 16 == 0
    for h in range(shift):
        assert torch.equal(table[h, : V - h], weight[h:]) and not table[h, V - h:].any()
    assert cross_entropy_api._weight_rows(weight, V, 0, True, None) == (weight, 1)
    assert cross_entropy_api._weight_rows(weight, V, shift, False, None) == (weight, 1)
    placeholder = torch.empty(1)
    assert cross_entropy_api._weight_rows(None, V, shift, True, placeholder) == (placeholder, 1)


@pytest.mark.parametrize("V", [1001, 4099])
@pytest.mark.kernels_only
def test_weight_total_from_the_forward(V, device):
    """With weights and smoothing the forward sums the weights it reads (the table's rows and
    the row's ends, SHIFT) into mass, a row: W, which the loss and the backward take."""
    x = torch.randn(5, V, device=device, dtype=torch.bfloat16)
    target = torch.randint(0, V, (5,), device=device)
    weight = torch.rand(V, device=device, dtype=torch.bfloat16) + 0.5
    assert cross_entropy_plans._vectors(V, "forward", (x,))[1] == 8  # rows from their boundaries, ends apart
    mass = cross_entropy_api._launch_forward(x, target, weight, -100, 0.1, 0.0, 0.0, False, None, "none")[2]
    assert torch.allclose(mass, weight.float().sum().expand(5), rtol=1e-5)
    no_smoothing = cross_entropy_api._launch_forward(x, target, weight, -100, 0.0, 0.0, 0.0, False, None, "none")[2]
    assert no_smoothing.numel() == 0


@pytest.mark.parametrize("V, even", [(2 * cross_entropy_plans.FORWARD_BLOCKS[0], True), (cross_entropy_plans.FORWARD_BLOCKS[0] + 16, False)])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "weight": "w"}, {"softcap": 20.0}, {"prob": True}],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.kernels_only
def test_forward_rows_of_whole_chunks(V, even, options, monkeypatch, device):
    """Rows of whole chunks (from their start) take the forward's unmasked loads (EVEN), and
    only those; the loss matches torch's either way."""
    options = dict(options)
    prob = options.pop("prob", False)
    x = torch.randn(3, V, device=device) * 3
    x[1, -1] = 30.0  # the last chunk's last class holds the max
    target = torch.softmax(torch.randn(3, V, device=device), 1) if prob else torch.tensor([0, V - 1, 5], device=device)
    taken = record_launches(monkeypatch, ("_forward_kernel", "_forward_probs_kernel"), lambda grid, kw: kw["EVEN"])
    check(x, target, **with_weight(options, V, device))
    assert taken == [even]


def test_backward_chunks_fill_the_row():
    """The backward's chunk: the largest of 8192 / 4096 / 2048 whose chunks fill the row's
    sliced part (from its first boundary: SHIFT) to 0.99, else the smallest; no chunk
    program past the sliced part (chunk 0 takes the classes outside it)."""
    chunks = loss_plans.backward_chunks
    assert chunks(131072, 0) == (8192, 16) and chunks(32768, 0) == (8192, 4)
    assert chunks(50304, 0) == (2048, 25)        # 8192 would fill 0.88, 4096 0.95
    assert chunks(256001, 64) == (4096, 63)      # 256000 sliced: 4096 fills 0.992
    assert chunks(8193, 64) == (8192, 1)         # the one class past 8192 goes with chunk 0
    assert chunks(1000, 0) == (1024, 1) and chunks(7, 0) == (16, 1)
    assert chunks(131072, 0, heavy=True) == (2048, 64) and chunks(1000, 0, heavy=True) == (1024, 1)


@pytest.mark.parametrize("V, block, options", [(12288, 4096, {}), (10240, 2048, {}), (16384, 8192, {}),
                                              (16384, 2048, {"softcap": 20.0}),
                                              (16384, 2048, {"weight": "w", "label_smoothing": 0.1})])
@pytest.mark.kernels_only
def test_backward_runs_in_the_chunks_chosen(V, block, options, monkeypatch, device):
    """The backward kernel runs in the chunks `_backward_chunks` picks (12288: three of 4096,
    not two of 8192; 10240: five of 2048; a softcap, or weights with smoothing: 2048), and
    its gradient matches torch's there."""
    x = torch.randn(2, V, device=device) * 3
    target = torch.tensor([5, V - 1], device=device)
    launched = record_launches(monkeypatch, ("_backward_kernel",), lambda grid, kw: (grid[1], kw["BLOCK"]))
    check(x, target, **with_weight(options, V, device))
    assert launched == [(V // block, block)]


def test_odd_vocabularies_backward_from_whole_lines():
    """The library's boundaries: the forward starts odd rows' slices on 16-byte boundaries,
    the backward on 128-byte ones (whole L2 lines) where the logits and gradient allow."""
    x, dx = line_aligned_rows(1001, 1001 + 64), line_aligned_rows(1001, 1001 + 64)
    assert cross_entropy_plans._vectors(1001, "forward", (x,)) == (1, 8)
    assert cross_entropy_plans._vectors(1001, "backward", (x, dx)) == (1, 64)
    assert cross_entropy_plans._vectors(1001, "backward", (x, dx[:, 1:])) == (1, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [7, MULTI_CHUNK])
@pytest.mark.parametrize("options", [{}, {"weight": "w"}, {"label_smoothing": 0.2}, {"reduction": "none"},
                                     {"reduction": "sum", "weight": "w", "label_smoothing": 0.1}],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_probability_targets(dtype, V, options, device):
    M = 4
    x = (torch.randn(M, V, device=device) * 3).to(dtype)
    target = torch.softmax(torch.randn(M, V, device=device) * 2, dim=1)
    target[0, : V // 2] = 0.0  # some classes carry no mass
    check(x, target, **with_weight(options, V, device))


def test_probability_targets_gradient_to_targets(device):
    x = torch.randn(3, 50, device=device)
    target = torch.softmax(torch.randn(3, 50, device=device), 1).requires_grad_()
    target64 = target.detach().double().requires_grad_()
    w = torch.rand(50, device=device)
    loss = pintail.cross_entropy(x, target, weight=w, label_smoothing=0.1, softcap=5.0)
    loss_truth, _, _ = torch_cross_entropy(x.double(), target64, weight=w.double(), label_smoothing=0.1, softcap=5.0)
    (dt,) = torch.autograd.grad(loss, target)
    (dt_truth,) = torch.autograd.grad(loss_truth, target64)
    assert_matches(dt, dt_truth, dt_truth.float())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradient_to_class_weights(reduction, device):
    """As torch: probability targets give the class weights a gradient; class-index targets
    refuse a weight that requires one (torch's nll_loss is not differentiable in it)."""
    x = torch.randn(4, 30, device=device, requires_grad=True)
    target = torch.softmax(torch.randn(4, 30, device=device), 1).requires_grad_()
    w = (torch.rand(30, device=device) + 0.1).requires_grad_()
    loss = pintail.cross_entropy(x, target, weight=w, reduction=reduction, label_smoothing=0.2, z_loss=1e-3)
    x64, t64, w64 = (v.detach().double().requires_grad_() for v in (x, target, w))
    truth, _, _ = torch_cross_entropy(x64, t64, weight=w64, reduction=reduction, label_smoothing=0.2, z_loss=1e-3)
    upstream = torch.randn(loss.shape, device=device)
    got = torch.autograd.grad(loss, (x, target, w), upstream)
    want = torch.autograd.grad(truth, (x64, t64, w64), upstream.double())
    for g, t in zip(got, want):
        assert_matches(g, t, t.float())
    with pytest.raises(RuntimeError, match="not differentiable with respect to weight for class-index targets"):
        pintail.cross_entropy(x, class_targets(4, 30, device), weight=w)
    with torch.no_grad():
        pintail.cross_entropy(x, class_targets(4, 30, device), weight=w)  # no gradient asked: fine


@pytest.mark.parametrize("shape, dim_of_target", [((11,), ()), ((3, 9, 4, 2), (3, 4, 2)), ((2, 5, 7), (2, 7))])
@pytest.mark.parametrize("prob", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_shapes(shape, dim_of_target, prob, reduction, device):
    x = torch.randn(shape, device=device)
    C = shape[0] if len(shape) == 1 else shape[1]
    if prob:
        target = torch.softmax(torch.randn(shape, device=device), dim=0 if len(shape) == 1 else 1)
    else:
        target = torch.randint(0, C, dim_of_target, device=device)
    check(x, target, reduction=reduction, weight=torch.rand(C, device=device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", [{"z_loss": 1e-3}, {"softcap": 15.0}, {"z_loss": 1e-2, "softcap": 3.0},
                                     {"z_loss": 1e-4, "softcap": 30.0, "weight": "w", "label_smoothing": 0.1,
                                      "reduction": "none"}],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items() if k != "weight"))
@pytest.mark.parametrize("prob", [False, True])
def test_extras(dtype, options, prob, device):
    M, V = 6, MULTI_CHUNK
    x = (torch.randn(M, V, device=device) * 8).to(dtype)
    target = torch.softmax(torch.randn(M, V, device=device), 1) if prob else class_targets(M, V, device)
    check(x, target, **with_weight(options, V, device))


@pytest.mark.parametrize("softcap", [5.0, 15.0, 30.0, 50.0])
def test_softcap_float32_as_accurate_as_torch(softcap, device):
    """float32 logits from 1e-3 to 1e3 in magnitude, capped: the loss and its gradient err
    against float64 by at most 1.5x what torch's float32 composition errs (tanh's small
    arguments once lost their digits to cancellation)."""
    M, V = 128, 1000
    x = 10 ** (torch.rand(M, V, device=device) * 6 - 3) * torch.randn(M, V, device=device).sign()
    target = class_targets(M, V, device, ignored=())
    errors = []
    for logits in (x, x.double()):
        logits = logits.detach().requires_grad_()
        loss = torch_cross_entropy(logits, target, softcap=softcap, reduction="none")[0]
        errors.append((loss, *torch.autograd.grad(loss.sum(), logits)))
    x_ours = x.detach().requires_grad_()
    loss = pintail.cross_entropy(x_ours, target, softcap=softcap, reduction="none")
    (dx,) = torch.autograd.grad(loss.sum(), x_ours)
    (torch_loss, torch_dx), (loss64, dx64) = errors
    error = lambda value, truth: (value.double() - truth).abs().mean().item()
    assert error(loss, loss64) <= 1.5 * error(torch_loss, loss64)
    assert error(dx, dx64) <= 1.5 * error(torch_dx, dx64)


def test_lse_is_the_row_logsumexp(device):
    x = torch.randn(4, 300, device=device)
    target = class_targets(4, 300, device)
    loss, lse = pintail.cross_entropy(x, target, return_lse=True)
    assert torch.allclose(lse, torch.logsumexp(x, 1), rtol=1e-6, atol=1e-6)
    assert not lse.requires_grad


def test_inplace_backward(device):
    x = torch.randn(6, 777, device=device, dtype=torch.bfloat16)
    target = class_targets(6, 777, device)
    leaf = x.clone().requires_grad_()
    logits = leaf * 1.0  # a non-leaf, as logits coming out of a matmul
    pintail.cross_entropy(logits, target, label_smoothing=0.1, inplace_backward=True).backward()
    expected_logits = x.clone().requires_grad_()
    pintail.cross_entropy(expected_logits, target, label_smoothing=0.1).backward()
    assert torch.equal(leaf.grad, expected_logits.grad)
    assert torch.equal(logits.detach(), expected_logits.grad)  # the logits' storage now holds the gradient


def test_inplace_backward_leaves_what_others_hold(device):
    """inplace_backward never writes over leaf logits. The target's gradient (probability
    targets) comes from the logits before they are overwritten. Another node that saved
    the logits raises rather than reading the gradient's values."""
    x = torch.randn(5, 40, device=device)
    target = class_targets(5, 40, device)
    leaf = x.clone().requires_grad_()
    pintail.cross_entropy(leaf, target, inplace_backward=True).backward()
    assert torch.equal(leaf.detach(), x)
    reference = x.clone().requires_grad_()
    pintail.cross_entropy(reference, target).backward()
    assert torch.equal(leaf.grad, reference.grad)

    probs = torch.softmax(torch.randn(5, 40, device=device), 1)
    grads = []
    for inplace in (False, True):
        x_leaf, y = x.clone().requires_grad_(), probs.clone().requires_grad_()
        loss = pintail.cross_entropy(x_leaf * 1.0, y, inplace_backward=inplace)
        grads.append(torch.autograd.grad(loss, (x_leaf, y)))
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs)

    logits = x.clone().requires_grad_() * 1.0
    squares = (logits ** 2).sum()  # saves the logits; its backward runs after cross-entropy's
    loss = pintail.cross_entropy(logits, target, inplace_backward=True) + squares
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("reduction, expected", [("mean", float("nan")), ("sum", 0.0)])
def test_every_row_ignored(reduction, expected, device):
    x = torch.randn(3, 10, device=device, requires_grad=True)
    target = torch.full((3,), -100, device=device)
    loss = pintail.cross_entropy(x, target, reduction=reduction)
    truth = F.cross_entropy(x.detach().double(), target, reduction=reduction)
    assert torch.equal(torch.isnan(loss), torch.isnan(truth)) and (torch.isnan(truth) or loss.item() == expected)
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))  # as torch: ignored rows get no gradient, even of NaN


def test_zero_classes(device):
    """C = 0: every class index is out of range (torch raises too); with every row ignored
    the mean is NaN and the rows are 0, as torch gives."""
    x = torch.randn(3, 0, device=device, requires_grad=True)
    with pytest.raises(IndexError, match="out of bounds"):
        pintail.cross_entropy(x, torch.zeros(3, dtype=torch.int64, device=device))
    ignored = torch.zeros(3, dtype=torch.int64, device=device)
    assert torch.isnan(pintail.cross_entropy(x, ignored, ignore_index=0))
    rows = pintail.cross_entropy(x, ignored, ignore_index=0, reduction="none")
    assert torch.equal(rows, F.cross_entropy(x, ignored, ignore_index=0, reduction="none"))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduced_loss_is_deterministic(reduction, monkeypatch, device):
    """sum / mean are reduced by one program in a fixed order (here in several steps of its
    block of rows): the same bits on every run (a property only a GPU's scheduling can
    break), and the gradient un-reduced by the same denominator as torch's."""
    monkeypatch.setattr(cross_entropy_plans, "REDUCE_BLOCK", 32)
    M, V = 100, 96
    x = torch.randn(M, V, device=device, requires_grad=True)
    target = torch.randint(0, V, (M,), device=device)
    target[::7] = -100
    weight = torch.rand(V, device=device)
    losses = [pintail.cross_entropy(x, target, weight, reduction=reduction) for _ in range(3)]
    assert all(torch.equal(losses[0], other) for other in losses[1:])
    truth = F.cross_entropy(x.double(), target, weight.double(), reduction=reduction)
    assert_matches(losses[0], truth, F.cross_entropy(x, target, weight, reduction=reduction))
    (grad,) = torch.autograd.grad(losses[0], x)
    (grad_truth,) = torch.autograd.grad(truth, x)
    assert_matches(grad, grad_truth, grad_truth.float())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(reduction, device):
    x = torch.randn(0, 10, device=device, requires_grad=True)
    target = torch.zeros(0, dtype=torch.int64, device=device)
    loss = pintail.cross_entropy(x, target, reduction=reduction)
    truth = F.cross_entropy(x.detach(), target, reduction=reduction)
    assert loss.shape == truth.shape and torch.equal(torch.isnan(loss), torch.isnan(truth))
    loss.sum().backward()
    assert x.grad.shape == (0, 10)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extreme_logits(dtype, device):
    M, V = 5, MULTI_CHUNK
    x = torch.randn(M, V, device=device) * 2
    x[0, ::3] = 1e4
    x[1, :] = -1e4
    x[2, 5:] = -float("inf")      # only the first 5 classes possible; the target is among them
    x[3, : V // 2] = -float("inf")  # whole leading chunk impossible
    x[4, :] = 0.0
    target = torch.tensor([0, 7, 2, V - 1, 11], device=device)
    check(x.to(dtype), target, label_smoothing=0.0)
    check(x.to(dtype), target, weight=torch.rand(V, device=device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weight"])
def test_extreme_logits_probability_targets(dtype, weighted, device):
    """The probability-target forward's sums about the row's first finite max: huge logits,
    a leading chunk of -inf, a max that moves by 1e4 in the last chunk. Where a logit is -inf
    its class carries no target mass, and pintail takes 0 * log 0 as 0 (torch's loss is NaN
    there, its gradient finite): the truth is torch's with -inf as -1e300."""
    M, V = 5, MULTI_CHUNK
    x = torch.randn(M, V, device=device) * 2
    x[0, ::3] = 1e4
    x[1, :] = -1e4
    x[2, 5:] = -float("inf")
    x[3, : V // 2] = -float("inf")
    x[4, V - 3] = 1e4
    x = x.to(dtype)
    target = torch.softmax(torch.randn(M, V, device=device), dim=1)
    target[x == -float("inf")] = 0.0
    weight = torch.rand(V, device=device) if weighted else None
    x_ours = x.clone().requires_grad_()
    loss = pintail.cross_entropy(x_ours, target, weight, reduction="none")
    x_truth = x.double().clamp(min=-1e300).requires_grad_()
    truth = F.cross_entropy(x_truth, target.double(), None if weight is None else weight.double(), reduction="none")
    upstream = torch.randn(M, device=device)
    (dx,) = torch.autograd.grad(loss, x_ours, upstream.to(dtype))
    (dx_truth,) = torch.autograd.grad(truth, x_truth, upstream.double())
    assert torch.isfinite(loss).all()
    assert_matches(loss, truth, truth.to(dtype))
    assert_matches(dx, dx_truth, dx_truth.to(dtype))


def test_zero_weight_classes_at_minus_inf(device):
    """Label smoothing spreads mass over every class by its weight; a class of weight 0 whose
    logit is -inf adds 0 * log 0 = 0 (torch: NaN), in the kernels and the CPU path alike."""
    M, V = 4, MULTI_CHUNK
    x = torch.randn(M, V, device=device)
    x[:, 3::7] = -float("inf")
    weight = torch.rand(V, device=device) + 0.1
    weight[3::7] = 0.0
    target = torch.tensor([0, 1, 2, -100], device=device)
    x_ours = x.clone().requires_grad_()
    loss = pintail.cross_entropy(x_ours, target, weight, label_smoothing=0.1, reduction="none")
    x_truth = x.double().clamp(min=-1e300).requires_grad_()
    truth = F.cross_entropy(x_truth, target, weight.double(), label_smoothing=0.1, reduction="none")
    (dx,) = torch.autograd.grad(loss.sum(), x_ours)
    (dx_truth,) = torch.autograd.grad(truth.sum(), x_truth)
    assert torch.isfinite(loss).all()
    assert_matches(loss, truth, truth.float())
    assert_matches(dx, dx_truth, dx_truth.float())


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_non_finite_logits_in_ignored_rows(smoothing, device):
    """An ignored row adds nothing to the loss, but torch's gradient of it is
    upstream x (softmax - one-hot): NaN wherever the row's softmax is, as here."""
    M, V = 4, 300
    x = torch.randn(M, V, device=device)
    x[1, 17] = float("nan")
    x[2, 250] = float("inf")
    x[3, :100] = -float("inf")  # a finite softmax: the ignored row's gradient is 0
    target = torch.tensor([5, -100, -100, -100], device=device)
    ours_x = x.clone().requires_grad_()
    torch_x = x.clone().requires_grad_()
    loss = pintail.cross_entropy(ours_x, target, label_smoothing=smoothing)
    truth = F.cross_entropy(torch_x, target, label_smoothing=smoothing)
    assert torch.allclose(loss, truth, rtol=1e-5)
    loss.backward()
    truth.backward()
    assert torch.equal(torch.isnan(ours_x.grad), torch.isnan(torch_x.grad))
    assert torch.isnan(torch_x.grad[1:3]).all()  # the case this test is for
    finite = ~torch.isnan(torch_x.grad)
    assert torch.allclose(ours_x.grad[finite], torch_x.grad[finite], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("layout", ["row_slice", "wide_buffer", "transposed"])
def test_non_contiguous_logits(layout, device):
    base = torch.randn(12, 300, device=device)
    x = {"row_slice": base[::2, :200], "wide_buffer": base[:, 10:290], "transposed": base[:40, :12].t()}[layout]
    target = class_targets(x.shape[0], x.shape[1], device)
    check(x, target, label_smoothing=0.1)


@pytest.mark.parametrize("layout", ["every_other", "expanded"])
def test_targets_and_weights_of_any_strides(layout, device):
    """Class targets and weights that are strided views, or expanded from one element
    (stride 0): the kernels index them with unit stride, so they are made contiguous."""
    M, V = 6, 40
    x = torch.randn(M, V, device=device)
    if layout == "every_other":
        target = class_targets(2 * M, V, device)[::2]
        weight = (torch.rand(2 * V, device=device) + 0.1)[::2]
    else:
        target = torch.tensor([7], device=device).expand(M)
        weight = torch.tensor([0.5], device=device).expand(V)
    assert not target.is_contiguous() and not weight.is_contiguous()
    check(x, target, weight=weight, label_smoothing=0.1)


@pytest.mark.kernels_only
def test_long_rows_need_no_copy(device, monkeypatch):
    """Logits that are a slice of a wider buffer reach the kernels as they are."""
    seen = []
    original = cross_entropy_api._launch_forward
    monkeypatch.setattr(cross_entropy_api, "_launch_forward", lambda x, *a: (seen.append(x), original(x, *a))[1])
    base = torch.randn(8, 400, device=device)
    x = base[:, :300]
    pintail.cross_entropy(x, class_targets(8, 300, device))
    assert seen[0].data_ptr() == x.data_ptr() and seen[0].stride() == (400, 1)


@pytest.mark.parametrize("target_dtype", [torch.int32, torch.uint8])
def test_target_dtypes(target_dtype, device):
    x = torch.randn(5, 30, device=device)
    target = torch.randint(0, 30, (5,), device=device)
    ours = pintail.cross_entropy(x, target.to(target_dtype))
    assert torch.allclose(ours, F.cross_entropy(x, target), rtol=1e-5)


def test_unchecked_bad_target_gives_nan_not_a_wild_read(device):
    """check_target=False (as under CUDA-graph capture or torch.compile): a target past the
    vocabulary turns its row's loss and gradient into NaN; other rows are untouched."""
    x = torch.randn(4, 64, device=device, requires_grad=True)
    target = torch.tensor([3, 10**6, -7, 5], device=device)
    rows = pintail.cross_entropy(x, target, reduction="none", check_target=False)
    assert torch.isnan(rows[1]) and torch.isnan(rows[2])
    good = torch.tensor([0, 3], device=device)
    assert torch.allclose(rows[good], F.cross_entropy(x[good], target[good], reduction="none"), rtol=1e-5)
    rows.sum().backward()
    assert torch.isnan(x.grad[1]).all() and torch.isfinite(x.grad[good]).all()


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.kernels_only
def test_bad_target_is_flagged_by_the_check_kernel(reduction, monkeypatch, device):
    """The eager check: a kernel counts out-of-range targets, and only then is the target
    read on the host to name it (a good target costs no host-side scan)."""
    scans = []
    original = loss_checks.check_target_values
    monkeypatch.setattr(loss_checks, "check_target_values", lambda *a: (scans.append(1), original(*a)))
    x = torch.randn(5, 40, device=device, requires_grad=True)
    good = torch.tensor([1, -100, 39, 0, 7], device=device, dtype=torch.int32)
    pintail.cross_entropy(x, good, reduction=reduction, weight=torch.rand(40, device=device))
    assert not scans
    for bad, position in (([1, 2, 40, 3, 0], 2), ([-1, 2, 3, 4, -100], 0)):
        logits = x.detach().clone()
        with pytest.raises(IndexError, match=rf"target\[{position}\] = {bad[position]} is out of bounds"):
            pintail.cross_entropy(logits, torch.tensor(bad, device=device), reduction=reduction, inplace_backward=True)
        assert torch.equal(logits, x.detach())  # raised before anything was written in place
    assert len(scans) == 2


@pytest.mark.kernels_only
def test_check_kernel_counts_bad_targets_past_its_block(device):
    """The check kernel loops over blocks of targets: bad ones in the second and third count."""
    target = torch.randint(0, 50, (2 * loss_plans.TARGET_CHECK_BLOCK + 5,), device=device)
    target[::7] = -100
    assert loss_checks.TargetCheck(target, 50, -100, 'check').bad_targets() == 0
    target[loss_plans.TARGET_CHECK_BLOCK + 3] = 50
    target[-1] = -1
    assert loss_checks.TargetCheck(target, 50, -100, 'check').bad_targets() == 2
    check = loss_checks.TargetCheck(target.int(), 50, -100, 'check')
    with pytest.raises(IndexError, match=rf"target\[{loss_plans.TARGET_CHECK_BLOCK + 3}\] = 50 is out of bounds"):
        check.finish()


def test_check_sees_targets_written_just_before_the_call(device):
    """On a GPU the check runs on a side stream: it must wait for the caller's stream, or a
    target written there just before the call (behind a long kernel) is read stale."""
    if device.type != "cuda":
        pytest.skip("streams are a GPU matter")
    x = torch.randn(4, 40, device=device)
    target = torch.tensor([1, 2, 3, 4], device=device)
    torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time on the caller's stream before the write
    target[2] = 40
    with pytest.raises(IndexError, match=r"target\[2\] = 40 is out of bounds"):
        pintail.cross_entropy(x, target)


def test_bad_input(device):
    x = torch.randn(4, 10, device=device)
    t = torch.randint(0, 10, (4,), device=device)
    cases = [
        (dict(target=torch.tensor([1, 2, 10, 3], device=device)), IndexError, r"target\[2\] = 10 is out of bounds"),
        (dict(target=torch.tensor([1, -2, 0, 3], device=device)), IndexError, r"target\[1\] = -2 is out of bounds"),
        (dict(target=t.float()), ValueError, "probability targets must have the input's shape"),
        (dict(target=t.to(torch.int16)), TypeError, "must be int64, int32 or uint8, got torch.int16"),
        (dict(target=t[:3]), ValueError, r"target must have shape \(4,\)"),
        (dict(weight=torch.ones(9, device=device)), ValueError, r"weight must have shape \(10,\)"),
        (dict(weight=torch.ones(10, dtype=torch.int64, device=device)), TypeError, "weight must be floating"),
        (dict(label_smoothing=1.5), ValueError, "label_smoothing must be between 0.0 and 1.0, got 1.5"),
        (dict(label_smoothing=-0.1), ValueError, "label_smoothing must be between"),
        (dict(reduction="avg"), ValueError, "'avg' is not a valid value for reduction"),
        (dict(z_loss=-1.0), ValueError, "z_loss must be >= 0"),
        (dict(softcap=0.0), ValueError, "softcap must be None or > 0"),
        (dict(input=x.long()), TypeError, "input must be floating point logits"),
        (dict(target=torch.softmax(x, 1), ignore_index=2), ValueError, "ignore_index is not supported"),
    ]
    for change, error, message in cases:
        args = dict(input=x, target=t, **{k: v for k, v in change.items() if k not in ("input", "target")})
        args["input"] = change.get("input", x)
        args["target"] = change.get("target", t)
        with pytest.raises(error, match=message):
            pintail.cross_entropy(**args)
    if device.type == "cuda":
        with pytest.raises(ValueError, match="weight is on cpu"):
            pintail.cross_entropy(x, t, weight=torch.ones(10))
        with pytest.raises(ValueError, match="target is on cpu"):
            pintail.cross_entropy(x, t.cpu())


def test_module_drops_in(device):
    w = torch.rand(20, device=device)
    ours = pintail.nn.CrossEntropyLoss(weight=w, ignore_index=2, reduction="sum", label_smoothing=0.05)
    theirs = torch.nn.CrossEntropyLoss(weight=w, ignore_index=2, reduction="sum", label_smoothing=0.05)
    assert isinstance(ours, torch.nn.CrossEntropyLoss)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(7, 20, device=device)
    t = torch.randint(0, 20, (7,), device=device)
    t[0] = 2
    assert torch.allclose(ours(x, t), theirs(x, t), rtol=1e-5)


def test_compile_fullgraph_and_opcheck(device):
    x = torch.randn(6, 90, device=device, requires_grad=True)
    t = class_targets(6, 90, device)
    w = torch.rand(90, device=device)

    def step(x):
        return pintail.cross_entropy(x * 2.0, t, weight=w, label_smoothing=0.1, z_loss=1e-3, softcap=20.0)

    backend = "inductor" if device.type == "cuda" else "aot_eager"
    loss = torch.compile(step, fullgraph=True, backend=backend)(x)
    (grad,) = torch.autograd.grad(loss, x)
    loss_eager = step(x)
    (grad_eager,) = torch.autograd.grad(loss_eager, x)
    assert torch.allclose(loss, loss_eager, rtol=1e-5) and torch.allclose(grad, grad_eager, rtol=1e-4, atol=1e-7)
    args = (x.detach().requires_grad_(), t, w, -100, 0.1, 1e-3, 20.0, False, torch.tensor(1.3, device=device))
    torch.library.opcheck(torch.ops.pintail.cross_entropy_forward.default, args)
    probs = torch.softmax(torch.randn(6, 90, device=device), 1)
    torch.library.opcheck(torch.ops.pintail.cross_entropy_forward.default,
                          (x.detach().requires_grad_(), probs, None, -100, 0.0, 0.0, 0.0, True, None))


def test_cuda_graph_training_step(device):
    """No host synchronisation with check_target=False: a forward and backward capture into a
    CUDA graph and replay with new logits and targets."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    x = torch.randn(64, 40000, device=device, dtype=torch.bfloat16, requires_grad=True)
    t = class_targets(64, 40000, device, ignored=(3, 9))

    def step():
        loss = pintail.cross_entropy(x, t, label_smoothing=0.1, check_target=False)
        (dx,) = torch.autograd.grad(loss, x)
        return loss, dx

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, dx = step()
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        t.copy_(class_targets(64, 40000, device, ignored=(5,)))
    graph.replay()
    torch.cuda.synchronize()
    check(x.detach(), t, upstream=torch.tensor(1.0, device=device), label_smoothing=0.1)
    x64 = x.detach().double().requires_grad_()
    truth = F.cross_entropy(x64, t, label_smoothing=0.1)
    (dx_truth,) = torch.autograd.grad(truth, x64)
    assert_matches(loss, truth, F.cross_entropy(x.detach(), t, label_smoothing=0.1))
    assert_matches(dx, dx_truth, dx_truth.to(dx.dtype))


@pytest.mark.large
def test_past_2_to_the_31_elements_and_peak_memory(device):
    """(8200, 262144) bf16 logits: 2^31 + 2^21 elements. The forward and backward allocate
    nothing of the logits' size beyond the gradient (no float32 copy, no (M, V) temporaries)."""
    if device.type != "cuda":
        pytest.skip("needs 8.6 GB of GPU memory")
    M, V = 8200, 262144
    x = torch.randn(M, V, device=device, dtype=torch.bfloat16, requires_grad=True)
    t = class_targets(M, V, device, ignored=(5, 8199))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = pintail.cross_entropy(x, t, reduction="none")
    (dx,) = torch.autograd.grad(loss.sum(), x)
    peak_extra = torch.cuda.max_memory_allocated() - before - dx.numel() * dx.element_size()
    assert peak_extra <= 0.01 * x.numel() * x.element_size(), peak_extra
    for r in (0, 5, 4096, M - 2, M - 1):
        row64 = x[r].detach().double().requires_grad_()
        truth = F.cross_entropy(row64[None], t[r:r + 1], reduction="none")
        (dx_truth,) = torch.autograd.grad(truth.sum(), row64)
        assert_matches(loss[r:r + 1], truth, F.cross_entropy(x[r:r + 1].detach(), t[r:r + 1], reduction="none"))
        assert_matches(dx[r], dx_truth, dx_truth.to(dx.dtype))


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """(shape, dtype) of every tensor an op allocates while the mode is on."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.seen.append((tuple(t.shape), t.dtype))
        return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("options", [dict(reduction="mean"), dict(reduction="sum", z_loss=1e-3),
                                     dict(reduction="none", label_smoothing=0.1),
                                     dict(reduction="mean", weight=True, z_loss=1e-3)],
                         ids=["mean", "sum_z", "none_smoothing", "mean_weight_z"])
def test_float32_loss_from_16_bit_logits(dtype, options, device, on_reference):
    """out_dtype=torch.float32: the loss, the z-loss term and the rows of reduction="none" in
    float32, to float32's precision against float64 torch on the same 16-bit logits, with no
    (tokens x vocab) float32 tensor made by the kernels (the torch reference path computes
    in float32 by design); the gradient in the logits' dtype."""
    options = dict(options)
    M, V = 9, 600
    x = (torch.randn(M, V, device=device) * 3).to(dtype)
    target = class_targets(M, V, device)
    if options.pop("weight", False):
        options["weight"] = torch.rand(V, device=device).to(dtype)
    leaf = x.detach().requires_grad_()
    with _Allocations() as allocations:
        loss, z, _ = pintail.cross_entropy(leaf, target, out_dtype=torch.float32, return_z_loss=True,
                                           return_lse=True, **options)
    assert loss.dtype == torch.float32 and z.dtype == torch.float32
    assert on_reference or not any(shape == (M, V) and dt == torch.float32 for shape, dt in allocations.seen), \
        [s for s in allocations.seen if s[0] == (M, V)]
    cast = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in options.items()}
    loss_truth, z_truth, _ = torch_cross_entropy(x.double().requires_grad_(), target, **cast)
    size = torch.logsumexp(x.double(), 1).abs().max().item() + x.double().abs().max().item()
    assert_matches(loss, loss_truth, scale=size)
    assert_matches(z, z_truth, scale=size**2 * 1e-3)
    (dx,) = torch.autograd.grad(loss, leaf, torch.ones_like(loss))
    assert dx.dtype == dtype
    same = pintail.cross_entropy(x.detach().requires_grad_(), target, **options)
    assert same.dtype == dtype  # torch's rule without out_dtype


def test_out_dtype_is_checked(device):
    x = torch.randn(3, 5, device=device)
    with pytest.raises(ValueError, match="out_dtype must be None"):
        pintail.cross_entropy(x, torch.tensor([0, 1, 2], device=device), out_dtype=torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_z_loss_is_a_mean_over_kept_rows_whatever_the_weights(dtype, device):
    """With class weights and reduction="mean", the z-loss term is z * mean(lse^2) over the
    kept rows: scaling every class weight by 3 changes neither it nor the loss."""
    M, V, z = 64, 500, 1e-3
    x = (torch.randn(M, V, device=device) * 2).to(dtype)
    target = class_targets(M, V, device, ignored=(1, 5))
    weight = (torch.rand(V, device=device) * 2).to(dtype)
    results = []
    for scale in (1, 3):
        leaf = x.detach().requires_grad_()
        loss, z_term = pintail.cross_entropy(leaf, target, weight * scale, z_loss=z, return_z_loss=True)
        (dx,) = torch.autograd.grad(loss, leaf)
        results.append((loss, z_term, dx))
    kept = target != -100
    lse = torch.logsumexp(x.double(), 1)
    assert_matches(results[0][1], z * (lse[kept] ** 2).mean())
    for a, b in zip(results[0], results[1]):
        assert_matches(a, b.double(), rtol=2 * RTOL[dtype])
    check(x, target, weight=weight, z_loss=z)


def test_module_takes_out_dtype(device):
    x = torch.randn(4, 30, device=device).to(torch.bfloat16)
    target = torch.randint(0, 30, (4,), device=device)
    loss = pintail.nn.CrossEntropyLoss(out_dtype=torch.float32, label_smoothing=0.1)(x, target)
    assert loss.dtype == torch.float32
    assert_matches(loss, F.cross_entropy(x.double(), target, label_smoothing=0.1),
                   scale=torch.logsumexp(x.double(), 1).abs().max().item())


def test_out_of_range_target_in_a_cuda_graph(device):
    """Under capture the target check is off: a replay with a class past the vocabulary gives
    that row NaN (loss and gradient), the other rows their values, and the CUDA context
    stays usable (no device-side assert, no wild read)."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    M, V = 16, 5000
    x = torch.randn(M, V, device=device, requires_grad=True)
    t = class_targets(M, V, device, ignored=())
    W = torch.randn(V, 32, device=device, requires_grad=True)
    h = torch.randn(M, 32, device=device, requires_grad=True)

    def step():
        rows = pintail.cross_entropy(x, t, reduction="none")
        head_rows = pintail.linear_cross_entropy(h, W, t, reduction="none")
        return (rows, head_rows, *torch.autograd.grad((rows + head_rows).sum(), (x, h)))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows, head_rows, dx, dh = step()
    t[3], t[7] = V, -5
    graph.replay()
    torch.cuda.synchronize()
    bad = torch.zeros(M, dtype=torch.bool, device=device)
    bad[[3, 7]] = True
    for loss, grad in ((rows, dx), (head_rows, dh)):
        assert torch.isnan(loss[bad]).all() and torch.isnan(grad[bad]).all()
        assert torch.isfinite(loss[~bad]).all() and torch.isfinite(grad[~bad]).all()
    good = (~bad).nonzero()[:, 0]
    assert torch.allclose(rows[good], F.cross_entropy(x[good].detach(), t[good], reduction="none"), rtol=1e-5)
    assert torch.allclose(head_rows[good], F.cross_entropy(h[good].detach() @ W.detach().T, t[good], reduction="none"),
                          rtol=1e-4, atol=1e-5)
    assert torch.isfinite(torch.randn(4, device=device).sum()).item()  # the context still works
