import importlib

import pytest
import torch
import triton
import triton.language as tl

import pintail
from pintail._core import cluster
from helpers import DTYPES, assert_matches, boundary_shifts, line_aligned_rows

softmax_api = importlib.import_module("pintail.softmax.api")
softmax_plans = importlib.import_module("pintail.softmax.plans")
OPS = {"softmax": (pintail.softmax, torch.softmax), "log_softmax": (pintail.log_softmax, torch.log_softmax)}
FORWARD_PAST_ON_CHIP = softmax_plans.FORWARD_ROWS[-1][0] + 1
PAST_ON_CHIP = max(FORWARD_PAST_ON_CHIP, softmax_plans.BACKWARD_ROWS[-1][0] + 1)


def exact_backward(op, y, dy, dim=-1):
    """The input gradient from the output y and dy in float64: y (dy - sum(y dy)) for softmax,
    dy - exp(y) sum(dy) for log_softmax."""
    y64, dy64 = y.detach().double(), dy.double()
    if op == "softmax":
        return y64 * (dy64 - (y64 * dy64).sum(dim, keepdim=True))
    return dy64 - y64.exp() * dy64.sum(dim, keepdim=True)


def backward_scale(op, y, dy, dim=-1, end_to_end=False):
    """The magnitudes of the terms of exact_backward's dx, which bound its error where they
    cancel: p (|dy| + sum |p dy|) for softmax, |dy| + p sum |dy| for log_softmax, p the
    probabilities. End to end (from the input, not from the output the backward was given)
    p itself errs relatively by about eps |log p|: p (1 + |log p| / 8) then."""
    y64, dy64 = y.detach().double(), dy.double().abs()
    p = y64 if op == "softmax" else y64.exp()
    if end_to_end:
        p = torch.where(p > 0, p * (1 + p.log().abs() / 8), 0.0)
    if op == "softmax":
        return p * (dy64 + (p * dy64).sum(dim, keepdim=True))
    return dy64 + p * dy64.sum(dim, keepdim=True)


def forward_scale(op, y):
    """softmax's p = exp(x - lse) errs relatively by about eps |x - lse| (an exp of a large
    argument): p (1 + |log p| / 8); log_softmax's error is relative to its value."""
    y64 = y.detach().double()
    if op == "softmax":
        return torch.where(y64 > 0, y64 * y64.log().abs() / 8, 0.0)
    return None


def check_op(op, x, dim=-1, dtype=None, dy=None):
    """Forward and input gradient of pintail's op against torch: float64 truth, and torch in
    the same dtype as the second bar."""
    ours_fn, torch_fn = OPS[op]
    x_ours = x.detach().requires_grad_(x.dtype.is_floating_point)
    y = ours_fn(x_ours, dim, dtype=dtype)
    x_torch = x.detach().requires_grad_(x.dtype.is_floating_point)
    y_torch = torch_fn(x_torch, dim, dtype=dtype)
    x_truth = x.detach().double().requires_grad_(x.dtype.is_floating_point)
    y_truth = torch_fn(x_truth, dim)
    assert_matches(y, y_truth, y_torch, scale=forward_scale(op, y_truth))
    if not x.dtype.is_floating_point:
        return y
    if dy is None:
        dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x_ours, dy)
    assert dx.dtype == x.dtype
    # The backward kernel against its exact formula on the output it was given: in fp16 and
    # bf16 the rounding of that output (the forward's, checked above) dominates the error.
    dx_exact = exact_backward(op, y, dy, dim)
    assert_matches(dx, dx_exact, dx_exact.to(x.dtype), scale=backward_scale(op, y, dy, dim))
    if x.dtype == torch.float32 and (dtype or x.dtype) == torch.float32:
        # and end to end, where the output's rounding is small
        (dx_torch,) = torch.autograd.grad(y_torch, x_torch, dy)
        (dx_truth,) = torch.autograd.grad(y_truth, x_truth, dy.double())
        assert_matches(dx, dx_truth, dx_torch, scale=backward_scale(op, y_truth, dy, dim, end_to_end=True))
    return y


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 1000, 4097, FORWARD_PAST_ON_CHIP, PAST_ON_CHIP])
def test_rows_of_every_length(op, dtype, N, device):
    x = torch.randn(3, N, device=device, dtype=dtype) * 3
    check_op(op, x)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N, x_pad", [(9, 16), (1001, 16), (4097, 16), (1001, 1), (1001, 64)])
@pytest.mark.parametrize("boundary", [16, 128])
@pytest.mark.kernels_only
def test_rows_from_16_byte_boundaries(op, dtype, N, x_pad, boundary, monkeypatch, device):
    """Rows of the rows plan's lengths that no vector width divides: one row a program from
    its first 16-byte boundary (the row-shift plan: SHIFT, as across a cluster), its whole
    16-byte pieces as vectors and its ends element by element; x a view x_pad elements wider
    a row than y, dy 16 wider. With x_pad 16 the forward's strides agree modulo 16 bytes
    (SHIFT taken), with 1 they do not (the rows plan, element by element); the backward's
    (y, dy, dx) always agree. The extremes sit in the ends: the max in a row's first element,
    in another's last, -inf heading a third, a fourth near 1e4 throughout (log_softmax's
    total counts from the max rounded in log2 units, and must be moved back to the max
    itself: float32 otherwise errs by 3e-4). The library takes SHIFT past ROWS_SHIFT_PAST
    only; here from 9 elements, to test it small. Boundaries of 16 and 128 bytes in both
    directions (ROW_SHIFT_BOUNDARY_BYTES: with 128 the rows start at the largest boundary that
    every tensor's alignment and strides allow)."""
    monkeypatch.setattr(softmax_plans, "ROWS_SHIFT_PAST", 0)
    monkeypatch.setattr(softmax_plans, "ROW_SHIFT_BOUNDARY_BYTES", {"forward": boundary, "backward": boundary})
    wide = torch.randn(23, N + x_pad, device=device) * 3
    wide[1, 0] = wide[2, N - 1] = 1e4 if dtype != torch.float16 else 6e4
    wide[3, :3] = -float("inf")
    wide[4] += 1e4
    x = wide.to(dtype)[:, :N]
    dy = torch.randn(23, N + 16, device=device).to(dtype)[:, :N]
    shifts = []

    def recording_launch(kernel, grid, *args, **kwargs):
        shifts.append((kernel.__name__, kwargs.get("SHIFT", 0)))
        real_launch(kernel, grid, *args, **kwargs)

    real_launch = softmax_api.launch
    monkeypatch.setattr(softmax_api, "launch", recording_launch)
    check_op(op, x, dy=dy)
    names = [name for name, _ in shifts]
    assert names == ["_forward_row_shift_kernel" if x_pad % 16 == 0 else "_forward_rows_kernel",
                     "_backward_row_shift_kernel"]
    taken = boundary_shifts(dtype, boundary)
    assert shifts[0][1] in (taken if x_pad % 16 == 0 else {0}) and shifts[1][1] in taken


@pytest.mark.parametrize("lag_rounds", [1, 4, 10**6])
@pytest.mark.parametrize("M, N", [(1, 1), (5, 63), (4, 64), (3, 65), (2, 1000), (9, 130)])
@pytest.mark.kernels_only
def test_split_plan_with_small_slices(M, N, lag_rounds, device):
    """The split plan (slices, partials, writes `lag` rows behind the reads) at a slice size
    small enough that tiny rows cut into many slices; lags from one row to all rows; some
    slices and one row all -inf."""
    x = torch.randn(M, N, device=device) * 4
    x[0, : N // 2] = -float("inf")  # leading slices of row 0 hold nothing but -inf
    if M > 3:
        x[3] = -float("inf")
    config = {"plan": "split", "BLOCK": 64, "num_warps": 4, "LAG_ROUNDS": lag_rounds, "PROGRAMS_PER_SM": 3}
    for log in (False, True):
        y = torch.empty_like(x)
        softmax_api.launch_forward(x, y, log, config)
        truth = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
        op = "log_softmax" if log else "softmax"
        assert_matches(y, truth, (torch.log_softmax if log else torch.softmax)(x, -1), scale=forward_scale(op, truth))
        dy = torch.randn_like(x)
        dx = torch.empty_like(x)
        softmax_api.launch_backward(y, dy, dx, log, config)
        dx_truth = torch.ops.aten._softmax_backward_data(dy.double(), truth, 1, torch.float64) if not log \
            else torch.ops.aten._log_softmax_backward_data(dy.double(), truth, 1, torch.float64)
        assert_matches(dx, dx_truth, dx_truth.float(), scale=backward_scale(op, truth, dy, end_to_end=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M, N, head, tail, block_m", [(5, 80, 64, 16, 1), (3, 70, 64, 16, 1), (4, 65, 64, 1, 1),
                                                       (7, 96, 64, 32, 2), (2, 1280, 1024, 256, 1)])
@pytest.mark.kernels_only
def test_rows_forward_as_two_tiles(dtype, M, N, head, tail, block_m, device):
    """The rows forward with the row as two tiles (BLOCK_N columns and TAIL more, as
    _launch.rows_tail cuts 10240 = 8192 + 2048): whole (80, 96, 1280), masked (70, 65; M not a
    multiple of BLOCK_M at 7), with large values in either tile, a -inf head and a row of -inf."""
    x = torch.randn(M, N, device=device) * 4
    x[0, :head] = -float("inf")     # the whole head tile -inf: the row's max from the tail
    x[1, head:] = 1e4 if dtype != torch.float16 else 6e4
    x[-1, ::3] = -1e4
    if M > 3:
        x[2] = -float("inf")         # a whole row: NaN, as torch gives
    x = x.to(dtype)
    config = {"plan": "rows", "BLOCK_M": block_m, "BLOCK_N": head, "TAIL": tail, "num_warps": 4}
    for log in (False, True):
        y = torch.empty_like(x)
        softmax_api.launch_forward(x, y, log, config)
        torch_fn = torch.log_softmax if log else torch.softmax
        assert_matches(y, torch_fn(x.double(), -1), torch_fn(x, -1))


@pytest.mark.parametrize("M, N", [(1, 1), (5, 63), (4, 64), (3, 65), (6, 1000)])
@pytest.mark.kernels_only
def test_two_pass_forward_with_small_chunks(M, N, device):
    """The two-pass forward at a chunk size small enough that rows cut into many chunks;
    chunks and rows of -inf, a +inf, large values."""
    x = torch.randn(M, N, device=device) * 4
    x[0, : N // 2] = -float("inf")  # leading chunks of row 0 hold nothing but -inf
    if M > 3:
        x[3] = -float("inf")        # a whole row: NaN, as torch gives
    if M > 4:
        x[4, N // 3] = float("inf")
        x[2, ::3] = 1e4
    config = {"plan": "two_pass", "BLOCK": 64, "num_warps": 4}
    for log in (False, True):
        y = torch.empty_like(x)
        softmax_api.launch_forward(x, y, log, config)
        torch_fn = torch.log_softmax if log else torch.softmax
        assert_matches(y, torch_fn(x.double(), -1), torch_fn(x, -1))


def test_long_rows_forward_plans():
    """Past the rows plan the forward holds 16-bit rows of even length from 28672 to 32768 in
    registers as packed words, reads other rows twice while a row is at most 64 KB (bf16 / fp16 up
    to 32768), then splits rows; float32 rows past the rows plan split."""
    for log in (False, True):
        assert softmax_plans.forward_config(FORWARD_PAST_ON_CHIP, log, 2, packable=True)["plan"] == "two_pass"
        assert softmax_plans.forward_config(28672, log, 2, packable=True)["plan"] == "packed"
        assert softmax_plans.forward_config(32768, log, 2, packable=True)["plan"] == "packed"
        assert softmax_plans.forward_config(FORWARD_PAST_ON_CHIP, log, 2)["plan"] == "two_pass"
        assert softmax_plans.forward_config(32768, log, 2)["plan"] == "two_pass"
        assert softmax_plans.forward_config(32769, log, 2, packable=True)["plan"] == "split"
        assert softmax_plans.forward_config(FORWARD_PAST_ON_CHIP, log, 4)["plan"] == "split"


def test_long_rows_forward_plans_with_clusters():
    """Where the GPU has thread-block clusters, rows past 16384 elements go across a cluster
    up to 262144: one row a cluster of 8192-element slices up to 131072 (past 65536 waiting
    for the peers late), persistent clusters of 32768-element slices past it, or of 16384 for
    softmax where the row fills its slices of 32768 less than 0.9; float32 rows one a cluster
    of 8192 up to 131072, then persistent clusters of 16384. Shorter and longer rows keep
    their plans."""
    one_row = {"plan": "cluster", "BLOCK": 8192, "num_warps": 4, "PERSISTENT": False, "maxnreg": 80}
    for log in (False, True):
        config = lambda N, item_size=2, packable=True: softmax_plans.forward_config(
            N, log, item_size, packable, clusters=True)
        assert config(1000)["plan"] == "rows" and config(16384)["plan"] == "rows"
        assert config(16385) == config(32768) == config(65536) == one_row
        assert config(65537) == config(131072) == {**one_row, "LATE_WAIT": True}
        slices_32768 = {"plan": "cluster", "BLOCK": 32768, "num_warps": 16, "PERSISTENT": True, "SIDE_ROWS": True}
        slices_16384 = {"plan": "cluster", "BLOCK": 16384, "num_warps": 8, "PERSISTENT": True}
        # fills 1 (the 16-byte pieces fill 4 slices; the last element rides with the last), 0.93, 0.92, 1
        assert config(131073) == config(151936) == config(180000) == config(262144) == slices_32768
        for N in (135000, 140000, 200003):  # fills 0.82, 0.85, 0.87
            assert config(N) == (slices_32768 if log else slices_16384)
        assert config(262145)["plan"] == "split"
        assert config(16385, 4) == config(131072, 4) == {"plan": "cluster", "BLOCK": 8192, "num_warps": 8,
                                                         "PERSISTENT": False}
        assert config(262144, 4) == {"plan": "cluster", "BLOCK": 16384, "num_warps": 32, "PERSISTENT": True}
        assert config(262145, 4)["plan"] == "split"


def test_rows_that_leave_their_tile_part_empty_plans():
    """Rows of 1025-8191 that leave their power-of-two tile part empty (hidden sizes such as
    1536, 2560, 5120) go one a program at 4 warps both ways; full tiles keep the tables (2048:
    4 warps forward); 16-bit rows of 8193-16383 go forward one a cluster of 8192-element slices
    where the GPU has clusters, 16384 itself and float32 keep the rows plan."""
    part_filled = lambda block_n: {"plan": "rows", "BLOCK_N": block_n, "BLOCK_M": 1, "num_warps": 4}
    for log in (False, True):
        for N, block_n in ((1025, 2048), (1536, 2048), (2560, 4096), (4095, 4096), (5120, 8192), (8191, 8192)):
            assert softmax_plans.forward_config(N, log) == part_filled(block_n)
            assert softmax_plans.backward_config(N, log) == part_filled(block_n)
        assert softmax_plans.forward_config(2048, log) == {"plan": "rows", "BLOCK_M": 1, "BLOCK_N": 2048, "num_warps": 4}
        assert softmax_plans.forward_config(4096, log) == {"plan": "rows", "BLOCK_M": 2, "BLOCK_N": 4096, "num_warps": 16}
        assert softmax_plans.backward_config(4096, log) == {"plan": "rows", "BLOCK_M": 2, "BLOCK_N": 4096, "num_warps": 16}
        assert softmax_plans.forward_config(8192, log)["num_warps"] == 16
        assert softmax_plans.forward_config(1000, log)["BLOCK_M"] == 2
        one_row = {"plan": "cluster", "BLOCK": 8192, "num_warps": 4, "PERSISTENT": False, "maxnreg": 80}
        for N in (8193, 16383):
            assert softmax_plans.forward_config(N, log, clusters=True) == one_row
            assert softmax_plans.backward_config(N, log, clusters=True) == {"plan": "cluster", "BLOCK": 4096,
                                                                             "num_warps": 4, "PERSISTENT": False}
            for config in (softmax_plans.forward_config, softmax_plans.backward_config):
                assert config(N, log)["plan"] == config(N, log, 4, clusters=True)["plan"] == "rows"
        assert softmax_plans.forward_config(16384, log, clusters=True)["plan"] == "rows"
        assert softmax_plans.backward_config(16384, log, clusters=True)["plan"] == "rows"
        # whole 16-byte vectors of 8193-10240: two tiles (8192 and a power of two more, at least
        # 1024) at 4 warps, clusters or not; float32 and 10241+ as before
        for N, tail in ((8200, 1024), (8704, 1024), (9216, 1024), (9224, 2048), (10240, 2048)):
            for clusters in (False, True):
                assert softmax_plans.forward_config(N, log, 2, clusters=clusters, vectors=True) == {
                    "plan": "rows", "BLOCK_M": 1, "BLOCK_N": 8192, "TAIL": tail, "num_warps": 4}
            assert softmax_plans.forward_config(N, log, 4, clusters=True, vectors=True)["plan"] == "rows"
            assert "TAIL" not in softmax_plans.forward_config(N, log, 4, clusters=True, vectors=True)
        # past 10240 across a cluster, log_softmax's 10241-12288 in slices of 4096
        slices_4096 = {"plan": "cluster", "BLOCK": 4096, "num_warps": 4, "PERSISTENT": False}
        for N in (10248, 12288, 12289):
            assert softmax_plans.forward_config(N, log, clusters=True, vectors=N % 8 == 0) == (
                slices_4096 if log and N <= 12288 else one_row)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1536, 2560, 6144, 8200, 8704, 9216, 9224, 10001, 10240, 12288])
@pytest.mark.kernels_only
def test_rows_that_leave_their_tile_part_empty(op, dtype, N, monkeypatch, device):
    """The default plans at hidden sizes that are no power of two (one row a program at 4
    warps; 16-bit 8200-10240 as two tiles, a masked tail at 8200, 8704 and 9224; 10001 and 12288
    across a cluster where the GPU has clusters), with extremes and a row of -inf."""
    x = torch.randn(5, N, device=device) * 3
    x[1, ::7] = 1e4 if dtype != torch.float16 else 6e4
    x[2, 1::3] = -1e4
    x[3, : N // 2] = -float("inf")
    x[0, 8192:] = 50.0  # the row's max and most of its sum in the second tile
    x = x.to(dtype)
    log = op == "log_softmax"
    planned = softmax_api.planned_forward(x, torch.empty_like(x), log)
    forward, backward = planned["plan"], softmax_api.planned_backward(x, x, x, log)["plan"]
    if dtype != torch.float32 and 8192 < N <= 10240:
        assert forward == ("rows" if N % 8 == 0 else "cluster" if cluster.available(x.device) else "row_shift")
        assert planned.get("TAIL", 0) == (max(1024, triton.next_power_of_2(N - 8192)) if N % 8 == 0 else 0)
    assert plans_run(monkeypatch, lambda: check_op(op, x)) == [f"_forward_{forward}_kernel",
                                                                f"_backward_{backward}_kernel"]
    x[4] = -float("inf")
    ours_fn, torch_fn = OPS[op]
    assert torch.isnan(ours_fn(x, -1)[4]).all() and torch.isnan(torch_fn(x, -1)[4]).all()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.kernels_only
def test_odd_rows_that_leave_their_tile_part_empty(op, monkeypatch, device):
    """16-bit rows of 8193-16383 whose starts no vector width divides: across a cluster where
    the GPU has clusters, but log_softmax's backward (its row-shift plan measured faster);
    the row-shift plan elsewhere."""
    x = torch.randn(3, 12289, device=device, dtype=torch.bfloat16) * 3
    across = cluster.available(x.device)
    forward = "cluster" if across else "row_shift"
    backward = "cluster" if across and op == "softmax" else "row_shift"
    assert plans_run(monkeypatch, lambda: check_op(op, x)) == [f"_forward_{forward}_kernel",
                                                                f"_backward_{backward}_kernel"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.kernels_only
def test_rows_of_whole_vectors_at_strides_that_are_not(op, monkeypatch, device):
    """16-bit rows of 10240 (whole 16-byte vectors) a row stride of 10244 apart: not the two
    tiles, planned for 16-byte loads; the plan before them (across a cluster, else one tile of
    16384)."""
    x = (torch.randn(4, 10244, device=device) * 3).to(torch.bfloat16)[:, :10240]
    x[1, 9000:] = 40.0
    planned = softmax_api.planned_forward(x, torch.empty(4, 10240, device=device, dtype=x.dtype), op == "log_softmax")
    assert "TAIL" not in planned and planned["plan"] == ("cluster" if cluster.available(x.device) else "rows")
    assert forward_plans_run(monkeypatch, lambda: check_op(op, x))[0] == f"_forward_{planned['plan']}_kernel"


def forward_plans_run(monkeypatch, fn):
    """The forward kernels fn() launched, by name (plain and cluster launches)."""
    return [name for name in plans_run(monkeypatch, fn) if name.startswith("_forward")]


def plans_run(monkeypatch, fn):
    """The kernels fn() launched, by name (plain and cluster launches)."""
    launched = []

    def recorder(real_launch):
        def recording_launch(kernel, *args, **kwargs):
            launched.append(kernel.__name__)
            real_launch(kernel, *args, **kwargs)
        return recording_launch

    with monkeypatch.context() as patch:
        patch.setattr(softmax_api, "launch", recorder(softmax_api.launch))
        patch.setattr(cluster, "launch", recorder(cluster.launch))
        fn()
    return launched


@pytest.fixture
def cluster_device(device):
    if not cluster.available(torch.device(device)):
        pytest.skip("thread-block clusters need a GPU of compute capability 9.0+ and compiled kernels")
    return device


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [FORWARD_PAST_ON_CHIP + 16384, 65539, 131072, 200003, 262144])
def test_cluster_forward_and_backward(op, dtype, N, monkeypatch, cluster_device):
    """Rows across a thread-block cluster as the tables pick (one row a cluster or persistent,
    2 to 16 CTAs, slices of 4096 to 32768), forward and backward (float32's past 131072 takes
    the own-row or lagged plan): against torch, with a
    slice of -inf entries, extreme values, a row of -inf (NaN, as torch); the last slice
    masked where N is not a multiple of the slice. Row 3's slices have maxes near 1e4 that
    differ: each slice's shift is rounded (in log2 units), and the combine must take the
    very shifts its exps were taken from, or float32 errs by up to 7e-4."""
    x = torch.randn(5, N, device=cluster_device) * 3
    x[0, : N // 2] = -float("inf")   # the leading slices of row 0 hold nothing but -inf
    x[1, ::7] = 1e4 if dtype != torch.float16 else 6e4
    x[2, 1::3] = -1e4
    x[3] += 1e4
    x = x.to(dtype)
    log = op == "log_softmax"
    forward = softmax_plans.forward_config(N, log, x.element_size(), clusters=True)["plan"]
    backward = softmax_plans.backward_config(N, log, x.element_size(), clusters=True)["plan"]
    assert forward == "cluster" and (backward == "cluster" or dtype == torch.float32 and N > 131072)
    assert plans_run(monkeypatch, lambda: check_op(op, x)) == [f"_forward_{forward}_kernel", f"_backward_{backward}_kernel"]
    x[4] = -float("inf")
    ours_fn, torch_fn = OPS[op]
    assert torch.isnan(ours_fn(x, -1)[4]).all() and torch.isnan(torch_fn(x, -1)[4]).all()


@pytest.mark.parametrize("form", [{"PERSISTENT": True}, {"PERSISTENT": False},
                                  {"PERSISTENT": False, "LATE_WAIT": True}], ids=["persistent", "one_row", "late_wait"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("N, block", [(20000, 4096), (65539, 8192), (200003, 16384)])
def test_cluster_forms(form, op, dtype, N, block, cluster_device):
    """Every form of the cluster kernels, whatever the tables pick: persistent clusters taking
    rows in turn (loading ahead), or one cluster a row, waiting for the peers to start at
    once or after the slice's sum (the forward's LATE_WAIT); 5 to 13 CTAs a cluster, the
    last slice masked, a slice of -inf in a row of very negative values; forward and backward
    against torch in float64."""
    log = op == "log_softmax"
    x = torch.randn(37, N, device=cluster_device) * 3
    x[0, 1::5] = -float("inf")
    x[1] -= 200                       # a row's max below -88 (exp(-max) overflows float32) and
    x[1, block:2 * block] = -float("inf")  # a whole slice of -inf: zeros there, not 0 x inf
    x = x.to(dtype)
    dy = torch.randn_like(x)
    cfg = {"plan": "cluster", "BLOCK": block, "num_warps": 8, **form}
    y = torch.empty_like(x)
    softmax_api.launch_forward(x, y, log, cfg)
    torch_fn = OPS[op][1]
    assert_matches(y, torch_fn(x.double(), -1), torch_fn(x, -1))
    dx = torch.empty_like(x)
    softmax_api.launch_backward(y, dy, dx, log, cfg)
    dx_exact = exact_backward(op, y, dy)
    assert_matches(dx, dx_exact, dx_exact.to(dtype), scale=backward_scale(op, y, dy))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("N", [32769, 50257, 65543, 131065, 262139])
def test_cluster_rows_from_16_byte_boundaries(op, dtype, N, monkeypatch, cluster_device):
    """Rows whose length is not a multiple of 16: each row starts at another distance before a
    16-byte boundary, the slices start at that boundary (cluster.window: SHIFT), the row's
    whole 16-byte pieces go as vectors and its ends element by element. x is a view 16
    elements wider a row than y (strides equal modulo 16 bytes); the extremes sit in the
    ends: the max in a row's first element, in another's last, -inf heading a third."""
    log = op == "log_softmax"
    wide = torch.randn(23, N + 16, device=cluster_device) * 3
    wide[1, 0] = wide[2, N - 1] = 1e4
    wide[3, :3] = -float("inf")
    wide[4] += 1e4
    x = wide.to(dtype)[:, :N].requires_grad_()
    dy = (torch.randn(23, N + 16, device=cluster_device)).to(dtype)[:, :N]
    shifts = []

    def recording_launch(real_launch):
        def launch(kernel, rows, ctas, *args, **kwargs):
            shifts.append(kwargs["SHIFT"])
            return real_launch(kernel, rows, ctas, *args, **kwargs)
        return launch

    monkeypatch.setattr(cluster, "launch", recording_launch(cluster.launch))
    ours_fn, torch_fn = OPS[op]
    y = ours_fn(x, -1)
    assert_matches(y, torch_fn(x.double(), -1), torch_fn(x, -1))
    (dx,) = torch.autograd.grad(y, x, dy)
    dx_exact = exact_backward(op, y, dy)
    assert_matches(dx, dx_exact, dx_exact.to(dtype), scale=backward_scale(op, y, dy))
    backward_plan = softmax_plans.backward_config(N, log, x.element_size(), clusters=True)["plan"]
    assert shifts == [16 // x.element_size()] * (2 if backward_plan == "cluster" else 1)


def test_row_shift_plan_where_it_won():
    """The rows plan's rows go one a program from their 16-byte boundaries only past
    ROWS_SHIFT_PAST elements, and only where no ALIGN gives 16-byte vectors already."""
    def plan(N, dtype=torch.bfloat16, pad=16):
        rows = torch.empty(2, N + pad, dtype=dtype)[:, :N], torch.empty(2, N, dtype=dtype)
        return softmax_plans._row_shift_config(N, "forward", False, *rows)
    past = softmax_plans.ROWS_SHIFT_PAST
    assert plan(past - 1) is None
    assert plan(past + 1) == {"plan": "row_shift", "BLOCK": 512, "SHIFT": 8, "num_warps": 1}
    assert plan(past + 1, torch.float32) is not None
    assert plan(4097)["num_warps"] == 2          # warps by the slice: 4096 elements
    assert plan(16383) == {"plan": "row_shift", "BLOCK": 16384, "SHIFT": 8, "num_warps": 8}
    assert plan(past + 8) is None                # 8-divisible: ALIGN's 16-byte vectors
    assert plan(past + 1, pad=1) is None         # strides that disagree modulo 16 bytes
    rows = [torch.empty(2, 12289, dtype=torch.bfloat16) for _ in range(3)]
    assert [softmax_plans._row_shift_config(12289, "backward", log, *rows)["num_warps"] for log in (False, True)] \
        == [4, 8]                                # log_softmax's backward at 8 warps


def test_cluster_window():
    """Where the slices start at the first 16-byte boundary in each row (SHIFT: elements in 16
    bytes): only where every tensor starts 16-byte aligned and their strides agree modulo
    SHIFT; the CTAs then cover the row's whole 16-byte pieces (the last CTA takes the ends
    past them)."""
    window = cluster.window
    rows = torch.empty(4, 65539 + 16, dtype=torch.bfloat16)
    assert window(65539, 8192, rows[:, :65539], torch.empty(4, 65539, dtype=torch.bfloat16)) == (8, 8)
    assert window(65536, 8192, torch.empty(4, 65536, dtype=torch.bfloat16)) == (8, 0)  # all 16-divisible
    assert window(65544, 8192, torch.empty(4, 65544, dtype=torch.bfloat16)) == (9, 8)  # 8 elements past 65536
    assert window(65539, 8192, rows[:, 1:65540]) == (9, 0)             # a start 2 bytes past a boundary
    assert window(65539, 8192, rows[:, :65539], torch.empty(4, 65540, dtype=torch.bfloat16)[:, :65539]) == (9, 0)
    assert window(262139, 16384, torch.empty(2, 262139, dtype=torch.bfloat16)) == (16, 8)
    assert window(131065, 8192, torch.empty(2, 131065)) == (16, 4)     # float32: 4 elements in 16 bytes
    assert window(32771, 8192, torch.empty(2, 32771)) == (4, 4)        # 4 slices, the last takes 3 past them


def test_cluster_window_at_128_byte_boundaries():
    """With boundary 128 the slices start at the largest boundary, from 16 to 128 bytes,
    that every tensor starts on, that their row strides agree modulo, and that is no longer
    than the row."""
    def window(*args):
        return cluster.window(*args, boundary=128)
    rows = line_aligned_rows
    assert window(262139, 16384, rows(262139, 262139)) == (16, 64)       # 262080 elements in whole lines
    assert window(131065, 8192, rows(131065, 131065, dtype=torch.float32)) == (16, 32)
    assert window(65539, 8192, rows(65539, 65555), rows(65539, 65539)) == (8, 16)  # strides agree modulo 16 only
    assert window(65539, 8192, rows(65539, 65539, offset=8)) == (8, 8)   # a start 16 bytes past a line
    assert window(65539, 8192, rows(65539, 65539, offset=1)) == (9, 0)   # 2 bytes past: nothing qualifies
    assert window(40, 16, rows(40, 40)) == (2, 32)                       # no boundary longer than the row
    assert window(65536, 8192, rows(65536, 65536)) == (8, 0)             # 16-divisible: Triton's vectors


@triton.jit
def _count_cover_kernel(slice_counts_ptr, end_counts_ptr, N, row_stride, BLOCK: tl.constexpr, SHIFT: tl.constexpr,
                        CLUSTER: tl.constexpr):
    # what CTA `rank` of row `row` loads: its slice's elements and its share of the row's ends
    row, rank = tl.program_id(0), tl.program_id(1)
    start = cluster.slice_start(row, row_stride, SHIFT)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(slice_counts_ptr + start + cols, 1,
                  mask=cluster.slice_mask(row, row_stride, N, rank, BLOCK, SHIFT))
    if SHIFT:
        at, mine = cluster.row_ends(row, row_stride, N, rank, BLOCK, SHIFT, CLUSTER)
        tl.atomic_add(end_counts_ptr + start + at, 1, mask=mine)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("N, extra", [(64, 0), (67, 0), (67, 16), (93, 5), (129, 16), (135, 16), (7, 16)])
@pytest.mark.parametrize("boundary", [16, 128])
@pytest.mark.kernels_only
def test_cluster_slices_and_ends_cover_each_row_once(dtype, N, extra, boundary, device):
    """The pieces the cluster kernels load (cluster.window, slice_start, slice_mask, row_ends),
    run as a kernel on their own (in the interpreter on CPU): across the CTAs of a row, every
    element of the row exactly once and nothing past it, the slices' part in whole 16-byte
    pieces only (what makes their loads vectors), at row starts that fall at every distance
    from a boundary (row strides N + extra); boundaries of 16 and 128 bytes."""
    M, block = 9, 16
    rows = torch.empty(M, N + extra, dtype=dtype, device=device)[:, :N]
    ctas, shift = cluster.window(N, block, rows, boundary=boundary)
    if N % 16 == 0 and extra % 16 == 0 or N < 16 // rows.element_size():
        assert shift == 0
    else:
        assert shift in boundary_shifts(dtype, boundary) and shift <= N
    slice_counts = torch.zeros(M * rows.stride(0) // 128 * 128 + 256, dtype=torch.int32, device=device)
    end_counts = torch.zeros_like(slice_counts)
    _count_cover_kernel[(M, ctas)](slice_counts, end_counts, N, rows.stride(0), BLOCK=block, SHIFT=shift,
                                   CLUSTER=ctas)
    in_row = torch.zeros_like(slice_counts, dtype=torch.bool)
    for r in range(M):
        in_row[r * rows.stride(0):r * rows.stride(0) + N] = True
    counts = slice_counts + end_counts
    assert bool((counts[in_row] == 1).all()) and bool((counts[~in_row] == 0).all())
    if shift:
        pieces = slice_counts.view(-1, shift)  # the tensor starts on a boundary (window)
        assert bool(((pieces == 0).all(1) | (pieces == 1).all(1)).all())
        assert int(end_counts.sum()) <= M * 2 * (shift - 1)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("M, N", [(3000, 39993), (1500, 150001), (300, 200003)])
def test_cluster_plans_over_many_rounds(op, M, N, monkeypatch, cluster_device):
    """More rows than clusters fit: at 39993 a grid of 3000 clusters, one a row; past 131072
    (forward) or 65536 (backward) each persistent cluster takes many rows in turn (its
    exchange buffers alternate, its mbarriers' phases wrap, the next row's slice is loaded
    ahead and the last round's is masked); rows of a strided view, 10 bytes into each row."""
    wide = torch.randn(M, N + 7, device=cluster_device, dtype=torch.bfloat16) * 2
    x = wide[:, 5:N + 5].requires_grad_()
    dy = torch.randn(M, N + 7, device=cluster_device, dtype=torch.bfloat16)[:, :N]
    ours_fn, torch_fn = OPS[op]

    def forward_and_backward():
        y = ours_fn(x, -1)
        assert_matches(y, torch_fn(x.double(), -1), torch_fn(x, -1))
        (dx,) = torch.autograd.grad(y, x, dy)
        dx_exact = exact_backward(op, y, dy)
        assert_matches(dx, dx_exact, dx_exact.to(dx.dtype), scale=backward_scale(op, y, dy))

    # the persistent clusters of 32768 may leave their last rows to the two-pass kernel (SIDE_ROWS)
    assert plans_run(monkeypatch, forward_and_backward) in (
        ["_forward_cluster_kernel", "_backward_cluster_kernel"],
        ["_forward_cluster_kernel", "_forward_two_pass_kernel", "_backward_cluster_kernel"])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("N", [28672, 30002, 32768])
@pytest.mark.kernels_only
def test_packed_forward(op, dtype, N, monkeypatch, device):
    """16-bit rows of even length from 28672 to 32768: held as packed words (two values a
    32-bit word, the last word of a masked row two -inf), against torch, with -inf entries and
    an extreme value; a row of -inf gives NaN, as torch's."""
    x = torch.randn(3, N, device=device, dtype=dtype) * 3
    x[0, 1::7] = float("-inf")
    x[1, 5] = 1e4 if dtype == torch.bfloat16 else 6e4
    monkeypatch.setattr(cluster, "available", lambda device: False)  # where clusters take them
    assert forward_plans_run(monkeypatch, lambda: check_op(op, x)) == ["_forward_packed_kernel"]
    x[2] = float("-inf")
    ours_fn, torch_fn = OPS[op]
    assert torch.isnan(ours_fn(x, -1)[2]).all() and torch.isnan(torch_fn(x, -1)[2]).all()


@pytest.mark.kernels_only
def test_packed_forward_only_where_words_fit(monkeypatch, device):
    """Rows of odd length, rows that start 2 bytes past a 4-byte boundary, float32 rows and
    an output of another dtype keep the other plans, and give torch's result."""
    odd = torch.randn(2, 30001, device=device, dtype=torch.bfloat16)
    shifted = torch.randn(2, 30003, device=device, dtype=torch.bfloat16)[:, 1:]  # even length, odd offset
    wide = torch.randn(2, 30002, device=device)
    narrow = torch.randn(2, 30002, device=device, dtype=torch.bfloat16)
    for x, dtype in ((odd, None), (shifted, None), (wide, None), (narrow, torch.float32)):
        plans = forward_plans_run(monkeypatch, lambda: check_op("softmax", x, dtype=dtype))
        assert plans and "_forward_packed_kernel" not in plans


@pytest.mark.parametrize("M, N", [(1, 1), (5, 63), (3, 65), (2, 1000), (9, 130), (1, 4097)])
@pytest.mark.kernels_only
def test_own_row_backward_with_small_slices(M, N, device):
    """The own-row backward (each slice published, waited for and written by the program
    that loaded it) at a slice size small enough that on the GPU tiny rows cut into many
    slices (the interpreter cuts rows into at most two: pintail/_core/split.py)."""
    config = {"plan": "own_row", "BLOCK": 64, "num_warps": 4, "PROGRAMS_PER_SM": 3}
    x = torch.randn(M, N, device=device) * 4
    for log in (False, True):
        y = (torch.log_softmax if log else torch.softmax)(x, -1)
        dy = torch.randn_like(x)
        dx = torch.empty_like(x)
        softmax_api.launch_backward(y, dy, dx, log, config)
        backward = torch.ops.aten._log_softmax_backward_data if log else torch.ops.aten._softmax_backward_data
        dx_truth = backward(dy.double(), y.double(), 1, torch.float64)
        assert_matches(dx, dx_truth, dx_truth.float())


def test_long_rows_backward_plans():
    """Past the on-chip limit softmax's backward takes the own-row plan, and past 64 slices
    of its largest slice the lagged split plan; log_softmax's takes the lagged plan."""
    assert softmax_plans.backward_config(PAST_ON_CHIP, log=False)["plan"] == "own_row"
    assert softmax_plans.backward_config(262144, log=False)["plan"] == "own_row"
    largest = softmax_plans.BACKWARD_OWN_ROW[-1][0]
    assert softmax_plans.backward_config(largest + 1, log=False)["plan"] == "split"
    assert softmax_plans.backward_config(PAST_ON_CHIP, log=True)["plan"] == "split"


def test_long_rows_backward_plans_with_clusters():
    """Where the GPU has thread-block clusters, rows past 16384 elements up to 262144 go
    across a cluster for either op: one row a cluster of 4096-element slices up to 65536,
    persistent clusters of 16384 past it. float32 rows go one a cluster of 8192-element slices
    up to 131072; past that softmax's take the own-row plan of 4096-element slices. Longer
    rows keep their plans."""
    for log in (False, True):
        config = lambda N, item_size=2: softmax_plans.backward_config(N, log, item_size, clusters=True)
        assert config(16384)["plan"] == "rows"
        assert config(16385) == config(65536) == {"plan": "cluster", "BLOCK": 4096, "num_warps": 4,
                                                  "PERSISTENT": False}
        assert config(65537) == config(262144) == {"plan": "cluster", "BLOCK": 16384, "num_warps": 16,
                                                   "PERSISTENT": True}
        assert config(262145) == softmax_plans.backward_config(262145, log)
        assert config(16385, 4) == config(131072, 4) == {"plan": "cluster", "BLOCK": 8192, "num_warps": 8,
                                                         "PERSISTENT": False}
        assert config(131073, 4) == softmax_plans.backward_config(131073, log, 4)
    assert softmax_plans.backward_config(262144, False, 4, clusters=True) == {
        "plan": "own_row", "BLOCK": 4096, "num_warps": 4, "PROGRAMS_PER_SM": 4}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.kernels_only
def test_rows_plan_with_tiles_of_rows(op, device):
    """Several rows per program, and a last tile that runs past the end."""
    x = torch.randn(11, 100, device=device)
    config = {"plan": "rows", "BLOCK_M": 4, "BLOCK_N": 128, "num_warps": 4}
    log = op == "log_softmax"
    y, dx = torch.empty_like(x), torch.empty_like(x)
    dy = torch.randn_like(x)
    softmax_api.launch_forward(x, y, log, config)
    softmax_api.launch_backward(y, dy, dx, log, config)
    ref = OPS[op][1](x.double(), -1)
    assert_matches(y, ref, ref.float())
    backward = torch.ops.aten._log_softmax_backward_data if log else torch.ops.aten._softmax_backward_data
    dx_ref = backward(dy.double(), ref, 1, torch.float64)
    assert_matches(dx, dx_ref, dx_ref.float())


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dim", [0, 1, -2, 2])
def test_any_dim(op, dim, device):
    x = torch.randn(4, 5, 37, device=device, dtype=torch.float32)
    check_op(op, x, dim)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("view", ["transpose", "row_step", "column_step", "expand", "narrow"])
def test_non_contiguous_views(op, view, device):
    base = torch.randn(12, 40, device=device, dtype=torch.bfloat16)
    x = {
        "transpose": base.t(),              # rows strided: copied
        "row_step": base[::3],              # one row stride: no copy
        "column_step": base[:, ::2],        # columns strided: copied
        "expand": base[:1].expand(5, 40),   # row stride 0
        "narrow": base[2:9, 5:31],          # offset view with a row stride
    }[view]
    check_op(op, x)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.kernels_only
def test_views_need_no_copy(op, device, monkeypatch):
    """A slice of rows reaches the kernel as it is: no contiguous() copy in between."""
    calls = []
    original = softmax_api.launch_forward
    monkeypatch.setattr(softmax_api, "launch_forward",
                        lambda x, y, log, config=None: (calls.append(x), original(x, y, log, config)))
    base = torch.randn(12, 40, device=device)
    x = base[::3]
    OPS[op][0](x)
    assert calls[0].data_ptr() == x.data_ptr() and calls[0].stride() == (120, 1)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape, dim", [((0, 7), -1), ((3, 0), -1), ((0,), 0), ((2, 0, 3), 0), ((), 0), ((), -1)])
def test_empty_and_scalar(op, shape, dim, device):
    x = torch.randn(shape, device=device)
    check_op(op, x, dim, dy=torch.randn(shape, device=device))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [33, PAST_ON_CHIP])
def test_extreme_values(op, dtype, N, device):
    x = torch.randn(6, N, device=device) * 2
    x[0, ::5] = 1e4
    x[1, ::7] = -1e4
    x[2, 1::3] = -float("inf")
    x[3, :] = -float("inf")        # every entry -inf: torch gives NaN
    x[4, 3] = float("inf")         # one +inf: torch gives NaN
    x[5, :] = 1e4                  # all equal and large: uniform
    check_op(op, x.to(dtype), dy=torch.randn(6, N, device=device, dtype=dtype))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("in_dtype, out_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16),
                                                 (torch.float16, torch.bfloat16), (torch.int64, torch.float32)],
                         ids=str)
def test_dtype_argument(op, in_dtype, out_dtype, device):
    x = (torch.randn(5, 300, device=device) * 4).to(in_dtype)
    y = check_op(op, x, dtype=out_dtype)
    assert y.dtype == out_dtype


@pytest.mark.uses_reference
@pytest.mark.parametrize("op", OPS)
def test_float64_goes_to_torch(op, device):
    x = torch.randn(4, 50, device=device, dtype=torch.float64)
    check_op(op, x)


@pytest.mark.parametrize("op", OPS)
def test_bad_input_raises_what_torch_raises(op, device):
    ours, theirs = OPS[op]
    x = torch.randn(3, 4, device=device)
    for bad_dim in (2, -3):
        with pytest.raises(IndexError, match=r"Dimension out of range \(expected to be in range of \[-2, 1\]"):
            ours(x, bad_dim)
        with pytest.raises(IndexError):
            theirs(x, bad_dim)
    ints = torch.ones(3, 4, dtype=torch.int64, device=device)
    with pytest.raises(NotImplementedError, match="input has dtype torch.int64, expected a floating point"):
        ours(ints, -1)
    with pytest.raises(NotImplementedError):
        theirs(ints, -1)
    with pytest.raises(TypeError, match="dtype must be a floating point dtype, got torch.int32"):
        ours(x, -1, dtype=torch.int32)
    with pytest.raises(TypeError, match="input must be a torch.Tensor, got list"):
        ours([1.0, 2.0], -1)


def test_modules_drop_in(device):
    x = torch.randn(3, 5, 17, device=device)
    for ours, theirs in ((pintail.nn.Softmax(dim=1), torch.nn.Softmax(dim=1)),
                         (pintail.nn.LogSoftmax(dim=-1), torch.nn.LogSoftmax(dim=-1))):
        truth = theirs(x.double())
        assert_matches(ours(x), truth, theirs(x))
        assert isinstance(ours, type(theirs))


def test_cluster_forward_in_a_cuda_graph(cluster_device):
    """The cluster launch (rewritten launcher metadata, a grid from the occupancy query)
    captured in a CUDA graph and replayed on new input."""
    x = torch.randn(64, 65536, device=cluster_device, dtype=torch.bfloat16)
    pintail.softmax(x, -1)  # compiled and prepared before the capture, as a warm-up step would
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = pintail.softmax(x, -1)
    x.copy_(torch.randn_like(x) * 3)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(y, torch.softmax(x.double(), -1), torch.softmax(x, -1))


def test_side_rows_plan():
    """The rows the persistent clusters leave to their idle SMs: at 262144 on the H200 (15
    clusters of 8 on 132 SMs) 17 of 512 (33 rounds, not 35), 18 of 768 (50, not 52), 4 of
    1024 (19 would be more than 1.5 an idle SM); none where the clusters' rounds are too few
    for a side row (256 rows: 18 rounds, against 24), no SM is idle, or the clusters
    outnumber the rows."""
    assert softmax_plans.side_rows(512, 15, 8, 132) == 17
    assert softmax_plans.side_rows(768, 15, 8, 132) == 18
    assert softmax_plans.side_rows(1024, 15, 8, 132) == 4
    assert softmax_plans.side_rows(256, 15, 8, 132) == 0
    assert softmax_plans.side_rows(512, 16, 8, 128) == 0
    assert softmax_plans.side_rows(12, 15, 8, 132) == softmax_plans.side_rows(15, 15, 8, 132) == 0


def side_rows_input(dtype, device, M=512, N=262144):
    """Rows of the bench's shape whose last ones (the side rows) hold extremes: a row of
    -inf (NaN out, as torch), a leading slice of -inf, values near 1e4."""
    x = torch.randn(M, N, device=device) * 3
    x[-1] = -float("inf")
    x[-2, : N // 3] = -float("inf")
    x[-3] += 1e4
    x[0, ::5] = 1e4 if dtype != torch.float16 else 6e4
    return x.to(dtype)


def assert_rows_match(op, y, x, rows):
    _, torch_fn = OPS[op]
    assert_matches(y[rows], torch_fn(x[rows].double(), -1), torch_fn(x[rows], -1))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_side_rows_beside_persistent_clusters(op, dtype, monkeypatch, cluster_device):
    """At 262144 x 512 the persistent clusters take the first rows and the two-pass kernel
    the last side_rows, launched behind them by programmatic dependent launch: both kernels
    run, and every row is right, the side rows' extremes too."""
    x = side_rows_input(dtype, cluster_device)
    y = []
    assert plans_run(monkeypatch, lambda: y.append(OPS[op][0](x, -1))) == ["_forward_cluster_kernel",
                                                                           "_forward_two_pass_kernel"]
    for rows in (slice(0, 8), slice(-40, None)):  # cluster rows, then the last cluster rows and the side rows
        assert_rows_match(op, y[0], x, rows)


def test_side_rows_in_a_cuda_graph(cluster_device):
    """The clusters and the side rows captured in a CUDA graph (the dependent launch
    becomes a programmatic edge) and replayed on new input."""
    x = side_rows_input(torch.bfloat16, cluster_device)
    pintail.softmax(x, -1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = pintail.softmax(x, -1)
    x.copy_(side_rows_input(torch.bfloat16, cluster_device).flip(0))
    graph.replay()
    torch.cuda.synchronize()
    for rows in (slice(0, 8), slice(-40, None)):
        assert_rows_match("softmax", y, x, rows)


def test_cluster_size_checked():
    """A cluster outside 2..16 CTAs is refused before anything is launched."""
    for size in (1, cluster.MAX_CLUSTER + 1):
        with pytest.raises(ValueError, match=f"a cluster of {size} CTAs"):
            cluster.launch(None, 1, size)
