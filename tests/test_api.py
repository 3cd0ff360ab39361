"""Across ops: that the kernels are what ran, torch.compile, torch.library checks, CUDA graphs."""

import importlib

import pytest
import torch
import triton

import pintail
import pintail.reference
from helpers import assert_matches

softmax_kernels = importlib.import_module("pintail.softmax.kernels")
softmax_plans = importlib.import_module("pintail.softmax.plans")


@pytest.mark.kernels_only
def test_kernels_are_what_runs(device):
    """On CPU the kernels are the interpreter's; on CUDA, compiled ones. Either way the torch
    reference is out of reach during the tests (conftest), so every passing op ran a kernel."""
    kernel = softmax_kernels._forward_rows_kernel
    if device.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction
        assert isinstance(kernel, InterpretedFunction)
    else:
        assert isinstance(kernel, triton.runtime.JITFunction)
    with pytest.raises(AssertionError, match="torch reference ran"):
        pintail.reference.softmax_forward(torch.ones(2), 0, False, torch.float32)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_torch_library_opcheck(op, device):
    """Fake (meta) implementations, schema and autograd registration agree with the real op."""
    x = torch.randn(4, 3, 50, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.pintail.softmax_forward.default, (x, 1, op == "log_softmax", torch.float32))
    y = torch.rand(4, 50, device=device)
    torch.library.opcheck(torch.ops.pintail.softmax_backward.default,
                          (y, torch.randn_like(y), 1, op == "log_softmax", torch.bfloat16))


def test_compile_fullgraph(device):
    """torch.compile(fullgraph=True) traces through the ops with no graph break."""
    def step(x, w):
        h = pintail.softmax(x * w, dim=-1)
        return pintail.log_softmax(h.transpose(0, 1), dim=0, dtype=torch.float32).square().mean()

    backend = "inductor" if device.type == "cuda" else "aot_eager"  # aot_eager: fast on CPU, same tracing
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    x = torch.randn(6, 70, device=device)
    w = torch.randn(70, device=device, requires_grad=True)
    loss = compiled(x, w)
    (grad,) = torch.autograd.grad(loss, w)
    (grad_eager,) = torch.autograd.grad(step(x, w), w)
    assert torch.allclose(grad, grad_eager, rtol=1e-5, atol=1e-7)  # the same kernels ran

    def step_torch(x, w):  # the same step in plain torch
        h = torch.softmax(x * w, dim=-1)
        return torch.log_softmax(h.transpose(0, 1), dim=0, dtype=torch.float32).square().mean()

    (grad_torch,) = torch.autograd.grad(step_torch(x, w), w)
    w64 = w.detach().double().requires_grad_()
    (grad_truth,) = torch.autograd.grad(step_torch(x.double(), w64), w64)
    assert_matches(grad, grad_truth, grad_torch)


def test_cuda_graph_capture(device):
    """No host synchronisation: forward and backward capture into a CUDA graph and replay."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    # every plan: rows; the split forward with the rows backward; the split forward with the
    # own-row backward (past the backward's rows plan)
    for N in (1000, 3 * softmax_plans.FORWARD_SPLIT["BLOCK"] + 5, softmax_plans.BACKWARD_ROWS[-1][0] + 7232):
        x = torch.randn(8, N, device=device, requires_grad=True)
        dy = torch.randn(8, N, device=device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up compiles the kernels outside the capture
            torch.autograd.grad(pintail.softmax(x, -1), x, dy)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = pintail.softmax(x, -1)
            (dx,) = torch.autograd.grad(y, x, dy)
        for _ in range(2):  # twice: the slots the split plans capture must be clean again
            with torch.no_grad():
                x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            x_ref = x.detach().double().requires_grad_()
            y_ref = torch.softmax(x_ref, -1)
            (dx_ref,) = torch.autograd.grad(y_ref, x_ref, dy.double())
            assert_matches(y, y_ref, torch.softmax(x.detach(), -1))
            assert_matches(dx, dx_ref, dx_ref.float())


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_cuda_graph_capture_of_norm_backward(kind, device):
    """The norm backward past the rows plan in a CUDA graph (RMSNorm: the blocks plan and its
    slots; LayerNorm: the long plan's two kernels), replayed twice on new inputs."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    N = 20000
    x = torch.randn(16, N, device=device, requires_grad=True)
    w = torch.randn(N, device=device, requires_grad=True)
    dy = torch.randn(16, N, device=device)
    ours = (lambda x, w: pintail.rms_norm(x, (N,), w)) if kind == "rms" else \
        (lambda x, w: pintail.layer_norm(x, (N,), w))
    theirs = (lambda x, w: torch.nn.functional.rms_norm(x, (N,), w)) if kind == "rms" else \
        (lambda x, w: torch.nn.functional.layer_norm(x, (N,), w))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernels outside the capture
        torch.autograd.grad(ours(x, w), (x, w), dy)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dx, dw = torch.autograd.grad(ours(x, w), (x, w), dy)
    for _ in range(2):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        leaves = (x.detach().double().requires_grad_(), w.detach().double().requires_grad_())
        truth = torch.autograd.grad(theirs(*leaves), leaves, dy.double())
        assert_matches(dx, truth[0], truth[0].float())
        assert_matches(dw, truth[1], truth[1].float())


def test_tensors_on_another_gpu_than_the_current_one(device):
    """Tensors on cuda:1 while cuda:0 is current: the kernels run on the tensors' GPU."""
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    other = torch.device("cuda", 1 - torch.cuda.current_device())
    x = torch.randn(8, 40000, device=other, requires_grad=True)
    w = torch.randn(40000, device=other, requires_grad=True)
    target = torch.randint(0, 40000, (8,), device=other)
    for ours, theirs in ((lambda: pintail.softmax(x, -1), lambda: torch.softmax(x, -1)),
                         (lambda: pintail.rms_norm(x, (40000,), w), lambda: torch.nn.functional.rms_norm(x, (40000,), w)),
                         (lambda: pintail.cross_entropy(x, target), lambda: torch.nn.functional.cross_entropy(x, target))):
        y, y_ref = ours(), theirs()
        assert y.device == other
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, (x, w), dy, allow_unused=True)
        grads_ref = torch.autograd.grad(y_ref, (x, w), dy, allow_unused=True)
        torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
        for g, g_ref in zip(grads, grads_ref):
            if g_ref is not None:
                torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-4)
    for _ in range(20):  # the eager target check waits on the check kernel's stream, on the tensors' GPU
        with pytest.raises(IndexError, match=r"target\[5\] = 40000 is out of bounds"):
            pintail.cross_entropy(x, torch.where(torch.arange(8, device=other) == 5, 40000, target))


@pytest.mark.large
def test_past_2_to_the_31_elements(device):
    """Row offsets in int64: a (8200, 262144) bf16 tensor has 2^31 + 2^21 elements."""
    if device.type != "cuda":
        pytest.skip("needs 8.6 GB of GPU memory")
    M, N = 8200, 262144
    x = torch.randn(M, N, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = pintail.softmax(x, -1)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    for r in (0, 4095, 8192, M - 1):
        row, row64 = x[r].detach(), x[r].detach().double().requires_grad_()
        truth = torch.softmax(row64, -1)
        (dx_truth,) = torch.autograd.grad(truth, row64, dy[r].double())
        row = row.requires_grad_()
        same_dtype = torch.softmax(row, -1)
        (dx_same_dtype,) = torch.autograd.grad(same_dtype, row, dy[r])
        assert_matches(y[r], truth, same_dtype)
        assert_matches(dx[r], dx_truth, dx_same_dtype)


def test_expanded_gradients(device):
    """loss = out.sum() hands the backward an expanded gradient (strides 0): every op must
    read it as the values it stands for, never past its one element."""
    x = torch.randn(6, 50, device=device, requires_grad=True)
    w = torch.randn(50, device=device, requires_grad=True)
    t = torch.randint(0, 50, (6,), device=device)
    cos, sin = torch.randn(7, 16, device=device), torch.randn(7, 16, device=device)
    q = torch.randn(2, 7, 3, 16, device=device, requires_grad=True)
    cases = [
        (lambda x: pintail.log_softmax(x, -1), lambda x: torch.log_softmax(x, -1), x),
        (lambda x: pintail.rms_norm(x, (50,), w), lambda x: torch.nn.functional.rms_norm(x, (50,), w), x),
        (lambda x: pintail.layer_norm(x, (50,), w, w), lambda x: torch.nn.functional.layer_norm(x, (50,), w, w), x),
        (lambda x: pintail.cross_entropy(x, t, reduction="none"),
         lambda x: torch.nn.functional.cross_entropy(x, t, reduction="none"), x),
        (lambda q: pintail.rotary(q, cos, sin), None, q),
    ]
    for ours, theirs, leaf in cases:
        (grad,) = torch.autograd.grad(ours(leaf).sum(), leaf)
        (grad_full,) = torch.autograd.grad(ours(leaf), leaf, torch.ones_like(ours(leaf)).contiguous())
        assert torch.allclose(grad, grad_full, rtol=1e-6, atol=1e-6)
        if theirs is not None:
            (grad_torch,) = torch.autograd.grad(theirs(leaf).sum(), leaf)
            assert torch.allclose(grad, grad_torch, rtol=1e-4, atol=1e-5)


def test_double_backward_raises(device):
    """The backward kernels are not differentiable: differentiating a gradient that went
    through one raises instead of silently treating pintail's part as a constant."""
    x = torch.randn(4, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    cos, sin = torch.randn(4, 16, device=device), torch.randn(4, 16, device=device)
    ops = [lambda: pintail.softmax(x, -1), lambda: pintail.rms_norm(x, (16,), w),
           lambda: pintail.layer_norm(x, (16,), w),
           lambda: pintail.cross_entropy(x, torch.randint(0, 16, (4,), device=device)),
           lambda: pintail.rotary(x.view(1, 4, 1, 16), cos, sin)]
    for op in ops:
        (grad,) = torch.autograd.grad((op() ** 2).sum(), x, create_graph=True)  # its upstream depends on x
        with pytest.raises(RuntimeError, match="a second derivative through a pintail op is not supported"):
            grad.sum().backward()
    # Where nothing pintail computed is differentiated again, create_graph=True works: the
    # rotation is linear in x, so with a constant upstream its gradient does not depend on x.
    upstream = torch.randn(1, 4, 1, 16, device=device)
    rotated = pintail.rotary(x.view(1, 4, 1, 16), cos, sin)
    (grad,) = torch.autograd.grad((rotated * upstream).sum() + (x ** 3).sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(grad.sum(), x)
    assert torch.allclose(second, 6 * x.detach(), atol=1e-5)


@pytest.mark.kernels_only
def test_bf16_stores_round_to_nearest_even(device):
    """A float32 value stored to bf16 rounds to nearest even, as torch's cast and the GPU do
    (the interpreter's own cast truncates; tests/conftest.py makes it round)."""
    import triton.language as tl

    @triton.jit
    def store_bf16(x_ptr, y_ptr, N: tl.constexpr):
        cols = tl.arange(0, N)
        tl.store(y_ptr + cols, tl.load(x_ptr + cols).to(tl.bfloat16))

    x = torch.randn(4096, device=device)
    y = torch.empty(4096, dtype=torch.bfloat16, device=device)
    store_bf16[(1,)](x, y, N=4096)
    assert torch.equal(y, x.to(torch.bfloat16))
