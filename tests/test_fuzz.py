"""Seeded random cases of every op against float64 torch (tests/fuzz_cases.py): shapes,
dtypes, layouts and options that the hand-picked tests do not combine. More of them:
scripts/fuzz_against_torch.py."""

import random

import pytest
import torch
from fuzz_cases import CASES

CASES_PER_RUN = 15


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("op", sorted(CASES))
def test_random_cases_match_torch(op, seed, device):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for case in range(CASES_PER_RUN):
        try:
            CASES[op](rng, device)
        except AssertionError as e:
            raise AssertionError(f"{op} case {case} (seed {seed}): {e}") from e
