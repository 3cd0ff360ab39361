"""Invariants of the launch plans, whatever the tables hold: every row length, with every
flag, maps to exactly one known plan; that plan covers the row; its tile fits the registers
(at most 128 float32 values a thread: 255 registers hold them and the addresses); a cluster
has at most 16 CTAs (Hopper's non-portable maximum). The tables' own entries (each with
its measurement) are in the op packages' plans.py; the numerical tests run the edges."""

import importlib
import itertools

import pytest

from pintail._core.launch import next_power_of_2

softmax_plans = importlib.import_module("pintail.softmax.plans")
norm_plans = importlib.import_module("pintail.norm.plans")
cross_entropy_plans = importlib.import_module("pintail.cross_entropy.plans")
loss_plans = importlib.import_module("pintail._loss.plans")

PLANS = {"rows", "two_pass", "packed", "split", "own_row", "cluster", "long", "blocks"}
VALUES_A_THREAD = 128


def row_lengths():
    """Every length to 4200, then powers of two, their neighbours and the tables' edges."""
    lengths = set(range(1, 4200))
    for k in range(12, 20):
        lengths |= {2**k - 1, 2**k, 2**k + 1, 3 * 2**(k - 1), 3 * 2**(k - 1) + 1}
    for table in (softmax_plans.FORWARD_ROWS, softmax_plans.BACKWARD_ROWS):
        for limit, *_ in table:
            lengths |= {limit, limit + 1}
    return sorted(n for n in lengths if n <= 600_000)


def check_covers(N, cfg, context):
    plan = cfg["plan"]
    assert plan in PLANS, (context, N, cfg)
    warps = cfg["num_warps"]
    assert warps in (1, 2, 4, 8, 16, 32), (context, N, cfg)
    if plan == "rows":
        width = cfg["BLOCK_N"] + cfg.get("TAIL", 0)
        assert width >= N, (context, N, cfg)
        assert cfg["BLOCK_N"] == next_power_of_2(cfg["BLOCK_N"]), (context, N, cfg)
        tile = cfg.get("BLOCK_M", 1) * width
        assert tile <= VALUES_A_THREAD * 32 * warps, (context, N, cfg)
    elif plan == "cluster":
        assert N <= 16 * cfg["BLOCK"] or cfg.get("PERSISTENT"), (context, N, cfg)
        assert cfg["BLOCK"] <= VALUES_A_THREAD * 32 * warps, (context, N, cfg)
    elif plan in ("long", "two_pass", "split", "own_row", "blocks", "packed"):
        block = cfg.get("BLOCK")
        assert block is None or block <= 2 * VALUES_A_THREAD * 32 * warps, (context, N, cfg)


@pytest.mark.parametrize("log", [False, True])
def test_softmax_plans_cover_every_row(log):
    flags = itertools.product([2, 4], [False, True], [False, True], [False, True])
    for item_size, packable, clusters, vectors in flags:
        for N in row_lengths():
            context = ("forward", log, item_size, packable, clusters, vectors)
            check_covers(N, softmax_plans.forward_config(N, log, item_size, packable and item_size == 2, clusters,
                                                         vectors), context)
    for item_size, clusters in itertools.product([2, 4], [False, True]):
        for N in row_lengths():
            check_covers(N, softmax_plans.backward_config(N, log, item_size, clusters),
                         ("backward", log, item_size, clusters))


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
def test_norm_plans_cover_every_row(rms):
    flags = itertools.product([False, True], repeat=5)
    for residual, narrow, packable, clusters, bf16 in flags:
        if residual and not rms:
            continue
        for N in row_lengths():
            check_covers(N, norm_plans.forward_config(N, rms, residual, narrow, packable, clusters, bf16),
                         ("forward", rms, residual, narrow, packable, clusters, bf16))
    for dh, clusters in itertools.product([False, True], repeat=2):
        if dh and not rms:
            continue
        for N in row_lengths():
            check_covers(N, norm_plans.backward_config(N, rms, dh, clusters), ("backward", rms, dh, clusters))


def test_cross_entropy_chunks_are_powers_of_two_that_fit():
    for V in row_lengths():
        for smoothing, prob in itertools.product([0.0, 0.1], [False, True]):
            block = cross_entropy_plans._forward_block(V, smoothing, prob)
            assert block == next_power_of_2(block) and block <= VALUES_A_THREAD * 32 * cross_entropy_plans.FORWARD_WARPS
        for heavy in (False, True):
            block, chunks = loss_plans.backward_chunks(V, 0, heavy)
            assert block == next_power_of_2(block) and block * chunks >= V, (V, block, chunks)
