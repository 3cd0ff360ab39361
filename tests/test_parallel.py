"""Cross-entropy over a vocabulary split across processes (gloo, on this machine, through a
file store: no network address): every rank's loss and gradient slice against the
single-process float64 result on the full logits, with 2 and 3 ranks and uneven slices."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pintail
from test_linear_cross_entropy import loss_of_logits as composition
from test_log_probs import truth as log_probs_truth

OPTIONS = [
    {},
    {"weight": True, "label_smoothing": 0.1},
    {"reduction": "none", "z_loss": 1e-3, "softcap": 5.0},
    {"reduction": "sum", "ignore_index": 4},
    {"weight": True, "z_loss": 1e-2, "label_smoothing": 0.2},
]
SLICES = {3: [10, 25, 15]}


def _inputs(M, V, K, options):
    generator = torch.Generator().manual_seed(0)  # the same on every rank
    x = torch.randn(M, K, generator=generator)
    W = torch.randn(V, K, generator=generator) / K**0.5
    t = torch.randint(0, V, (M,), generator=generator)
    t[1] = options.get("ignore_index", -100)
    weight = torch.rand(V, generator=generator) + 0.1 if options.get("weight") else None
    kwargs = {k: v for k, v in options.items() if k != "weight"}
    return x, W, t, weight, kwargs


def _refuse_reference():
    """As conftest's forbid_reference, in a spawned rank: a kernel path must reach the kernels."""
    import pintail.reference as reference

    def refuse(*args, **kwargs):
        raise AssertionError("the torch reference ran where a Triton kernel should have")

    for name, value in list(vars(reference).items()):
        if callable(value) and getattr(value, "__module__", None) == reference.__name__:
            setattr(reference, name, refuse)


def _join(rank, world, store_path, kernels):
    """A spawned rank joins the gloo group (the reference refused where the kernels must run):
    the group, the slices' sizes and this rank's classes [start, stop)."""
    if kernels:
        _refuse_reference()
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    sizes = SLICES[world]
    return dist.group.WORLD, sizes, sum(sizes[:rank]), sum(sizes[:rank + 1])


def _worker(rank, world, store_path, kernels):
    group, sizes, start, stop = _join(rank, world, store_path, kernels)
    try:
        M, V, K = 7, sum(sizes), 12
        for options in OPTIONS:
            x, W, t, weight, kwargs = _inputs(M, V, K, options)
            full = (x @ W.t()).double().requires_grad_()
            want = composition(full, t, weight.double() if weight is not None else None, **kwargs)
            upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
            (want_grad,) = torch.autograd.grad(want, full, upstream)
            # cross_entropy on this rank's slice of the logits
            local = (x @ W[start:stop].t()).requires_grad_()
            loss = pintail.cross_entropy(local, t, weight, process_group=group, **kwargs)
            (grad,) = torch.autograd.grad(loss, local, upstream.float())
            assert torch.allclose(loss.double(), want, rtol=2e-5, atol=1e-6), (options, loss, want)
            assert torch.allclose(grad.double(), want_grad[:, start:stop], rtol=1e-4, atol=1e-6), options
            # linear_cross_entropy on this rank's rows of the head; dx summed over the ranks
            xs, Ws = x.clone().requires_grad_(), W[start:stop].clone().requires_grad_()
            loss = pintail.linear_cross_entropy(xs, Ws, t, weight=weight, process_group=group, **kwargs)
            dx, dW = torch.autograd.grad(loss, (xs, Ws), upstream.float())
            x64, W64 = x.double().requires_grad_(), W.double().requires_grad_()
            want = composition(x64 @ W64.t(), t, weight.double() if weight is not None else None, **kwargs)
            want_dx, want_dW = torch.autograd.grad(want, (x64, W64), upstream)
            assert torch.allclose(loss.double(), want, rtol=2e-5, atol=1e-6), (options, loss, want)
            assert torch.allclose(dx.double(), want_dx, rtol=1e-4, atol=1e-6), options
            assert torch.allclose(dW.double(), want_dW[start:stop], rtol=1e-4, atol=1e-6), options
        # torch.compile(fullgraph=True) traces both (aot_eager: the graphs, forward and backward)
        x, W, t, weight, kwargs = _inputs(M, V, K, OPTIONS[1])
        full = (x @ W.t()).double().requires_grad_()
        want = composition(full, t, weight.double(), **kwargs)
        (want_grad,) = torch.autograd.grad(want, full)
        local = (x @ W[start:stop].t()).requires_grad_()
        torch._dynamo.reset()
        compiled = torch.compile(lambda z: pintail.cross_entropy(z * 1, t, weight, process_group=group, **kwargs),
                                 fullgraph=True, backend="aot_eager")
        loss = compiled(local)
        (grad,) = torch.autograd.grad(loss, local)
        assert torch.allclose(loss.double(), want, rtol=2e-5) and torch.allclose(
            grad.double(), want_grad[:, start:stop], rtol=1e-4, atol=1e-6)
        Ws = W[start:stop].clone().requires_grad_()
        compiled = torch.compile(lambda w: pintail.linear_cross_entropy(x, w * 1, t, weight=weight, process_group=group,
                                                                        **kwargs), fullgraph=True, backend="aot_eager")
        loss = compiled(Ws)
        (dW,) = torch.autograd.grad(loss, Ws)
        x64, W64 = x.double(), W.double().requires_grad_()
        (want_dW,) = torch.autograd.grad(composition(x64 @ W64.t(), t, weight.double(), **kwargs), W64)
        assert torch.allclose(dW.double(), want_dW[start:stop], rtol=1e-4, atol=1e-6)
        # a weight of this rank's slice only: a clear error
        local = torch.randn(3, sizes[rank])
        try:
            pintail.cross_entropy(local, torch.zeros(3, dtype=torch.long), torch.ones(sizes[rank]),
                                  process_group=group)
        except ValueError as error:
            assert "one entry per class of the whole vocabulary" in str(error)
        else:
            raise AssertionError("a slice-sized weight was accepted")
    finally:
        dist.destroy_process_group()


def _log_probs_worker(rank, world, store_path, kernels):
    """linear_log_probs on this rank's rows of the head (uneven slices, a ragged last token
    chunk, a bias, ignored and in-slice targets): lp, H and the gradients against float64."""
    import pintail._loss.plans
    pintail._loss.plans.MIN_TOKEN_ROWS = 2  # this process only: token chunks of 3 rows over 7
    group, sizes, start, stop = _join(rank, world, store_path, kernels)
    try:
        M, V, K = 7, sum(sizes), 12
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(M, K, generator=generator)
        W = torch.randn(V, K, generator=generator) / K**0.5 * 3
        b = torch.randn(V, generator=generator)
        t = torch.randint(0, V, (M,), generator=generator)
        t[1] = -100
        options = dict(temperature=0.8, softcap=4.0, return_entropy=True)
        upstream = torch.randn(2, M, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

        def losses(lp, H):
            return (lp * upstream[0].to(lp.dtype)).sum() + (H * upstream[1].to(H.dtype)).sum()

        for compiled in (False, True):
            xs, Ws, bs = x.clone().requires_grad_(), W[start:stop].clone().requires_grad_(), b[start:stop].clone()
            bs.requires_grad_()

            def fused(xs, Ws, bs):
                return pintail.linear_log_probs(xs, Ws, t, linear_bias=bs, process_group=group, memory_budget=3 * 64 * 4,
                                                **options)
            if compiled:
                torch._dynamo.reset()
                fused = torch.compile(fused, fullgraph=True, backend="aot_eager")
            lp, H = fused(xs, Ws, bs)
            grads = torch.autograd.grad(losses(lp, H), (xs, Ws, bs))
            x64, W64, b64 = (a.double().requires_grad_() for a in (x, W, b))
            want = log_probs_truth(x64 @ W64.t() + b64, t, **options)
            want_grads = torch.autograd.grad(losses(*want), (x64, W64, b64))
            assert torch.allclose(lp.double(), want[0], rtol=1e-5, atol=1e-6), (lp, want[0])
            assert torch.allclose(H.double(), want[1], rtol=1e-5, atol=1e-6), (H, want[1])
            for ours, expected in zip(grads, (want_grads[0], want_grads[1][start:stop], want_grads[2][start:stop])):
                assert torch.allclose(ours.double(), expected, rtol=1e-4, atol=1e-6)
    finally:
        dist.destroy_process_group()


def _cpu_ranks(device):
    if device.type != "cpu":
        pytest.skip("the gloo ranks hold CPU tensors, which reach the kernels in the interpreter only")


def test_split_log_probs_match_full(tmp_path, on_reference, device):
    """Three ranks of uneven slices (2 ranks take the same code)."""
    _cpu_ranks(device)
    mp.spawn(_log_probs_worker, args=(3, str(tmp_path / "store"), not on_reference), nprocs=3, join=True)


def test_split_vocabulary_matches_full(tmp_path, on_reference, device):
    """Three ranks of uneven slices (two ranks take the same code)."""
    _cpu_ranks(device)
    mp.spawn(_worker, args=(3, str(tmp_path / "store"), not on_reference), nprocs=3, join=True)


def test_needs_a_group_of_several(tmp_path):
    with pytest.raises(ValueError, match="process_group needs torch.distributed initialised"):
        pintail.cross_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), process_group=object())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'one'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="process_group has 1 rank"):
            pintail.cross_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), process_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()

