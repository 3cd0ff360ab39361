"""The row-shift plan (rows of the rows plan whose starts no vector width divides, one a
program from the row's first 16-byte boundary; session 24) against the rows plan's narrower
loads, at the warps given: where it starts to win (ROWS_SHIFT_PAST) and its warps per row
length (FORWARD_ROW_SHIFT, BACKWARD_ROW_SHIFT in pintail/softmax.py).

Session 23 prepared this with its own 1-D kernels (the rows kernels then took SHIFT in a
[rows, BLOCK] tile whose ends were replicated in every thread); they won from 1001 to 8191
and moved into the library in session 24, so the script now times the library's kernels.

    python scripts/exp_softmax_rows_shift.py --sizes 129,257,513,1001 --warps 1,2,4   # GPU only
"""

import argparse
import importlib

import torch

import measure

sm = importlib.import_module("pintail.softmax")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="129,257,385,513,769,1001,4097")
    p.add_argument("--warps", default="1,2,4,8")
    args = p.parse_args()
    sm.ROWS_SHIFT_PAST = 0  # the plan at every size given, to find where it wins
    copy_bw = measure.copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    for N in map(int, args.sizes.split(",")):
        M = 2**27 // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        y, dy, dx = torch.empty_like(x), torch.randn_like(x), torch.empty_like(x)
        for log in (False, True):
            configs = [("rows", sm.forward_config(N, log), sm.backward_config(N, log))]
            for w in map(int, args.warps.split(",")):  # the library's row-shift plan at w warps, at any N
                configs.append((f"row_shift {w}w", {**sm._row_shift_config(N, "forward", log, x, y), "num_warps": w},
                                {**sm._row_shift_config(N, "backward", log, y, dy, dx), "num_warps": w}))
            for name, forward_cfg, backward_cfg in configs:
                measure.print_fraction(f"N={N} log={log} fwd {name}", lambda: sm.launch_forward(x, y, log, forward_cfg),
                                       2 * x.numel() * 2, copy_bw)
                measure.print_fraction(f"N={N} log={log} bwd {name}",
                                       lambda: sm.launch_backward(y, dy, dx, log, backward_cfg), 3 * x.numel() * 2, copy_bw)
        del x, y, dy, dx
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
