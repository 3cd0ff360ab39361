"""Many random cases of every op against float64 torch (tests/fuzz_cases.py), in the Triton
interpreter on the CPU, or compiled on a GPU with --device cuda. Prints each failing case
and exits non-zero if any failed.

    python tools/fuzz_against_torch.py [--ops cross_entropy,norm,softmax,rotary] [--cases 200] [--seed 0] [--device cpu]
"""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="cross_entropy,norm,softmax,rotary")
    p.add_argument("--cases", type=int, default=200, help="per op")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before pintail's import: CPU tensors run the kernels
    import torch
    from fuzz_cases import CASES
    failures = 0
    for op in args.ops.split(","):
        rng = random.Random(args.seed)
        torch.manual_seed(args.seed)
        for case in range(args.cases):
            try:
                CASES[op](rng, args.device)
            except AssertionError as e:
                failures += 1
                print(f"{op} case {case} (seed {args.seed}): {e}", flush=True)
        print(f"{op}: {args.cases} cases", flush=True)
    print(f"{failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
