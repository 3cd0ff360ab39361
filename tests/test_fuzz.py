"""Seeded random cases of every op against float64 torch (tests/fuzz_cases.py): shapes,
dtypes, layouts and options that the hand-picked tests do not combine. Seeds 0 and 1 by
default; `--fuzz-seeds 20` draws 20 fresh seeds (each printed when its case fails), for
long runs."""

import os
import random

import pytest
import torch
from fuzz_cases import CASES

CASES_PER_RUN = 15


def pytest_generate_tests(metafunc):
    if "seed" in metafunc.fixturenames:
        fresh = metafunc.config.getoption("fuzz_seeds")
        base = random.Random(os.environ.get("PINTAIL_FUZZ_BASE"))  # conftest draws it, once for all workers
        seeds = [base.randrange(2**31) for _ in range(fresh)] if fresh else [0, 1]
        metafunc.parametrize("seed", seeds)


@pytest.mark.parametrize("op", sorted(CASES))
def test_random_cases_match_torch(op, seed, device):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for case in range(CASES_PER_RUN):
        try:
            CASES[op](rng, device)
        except AssertionError as e:
            raise AssertionError(f"{op} case {case} (seed {seed}): {e}") from e
