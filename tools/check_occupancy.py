"""For every persistent launch configuration of the library (a grid of PROGRAMS_PER_SM
programs per SM): the kernel's registers compiled for sm_90 on this machine (no GPU
needed), how many of its programs fit on one SM, and whether that is at least the number
the plan counts on. A plan that counts more than fit runs the extra programs only as the
first ones finish, and its lag (split plans) is computed for programs that are not running.
Shapes are the bench's (bf16, M*N = 2^27), at the row lengths where each plan runs.

    python tools/check_occupancy.py

It found LayerNorm's split forward (80 registers at 8 warps: 3 fit, 4 counted),
log_softmax's split backward (163-168 at 4 warps: 3 fit, 4 counted) and RMSNorm's blocks
backward with a bias and the residual's gradient (166: 3 fit, 4 counted) counting on more
programs than fit.
"""

import argparse
import contextlib
import io
import re

import inspect_kernel as ik

REGISTERS_PER_SM, THREADS_PER_SM, PROGRAMS_PER_SM_AT_MOST = 65536, 2048, 32


def registers(fn, signature, constexprs, warps):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ik.inspect(fn, signature, constexprs, warps)
    return int(re.search(r"REG:(\d+)", out.getvalue()).group(1))


def programs_that_fit(regs, warps):
    per_thread = -(-regs // 8) * 8  # registers are given out in steps of 8 per thread
    return min(REGISTERS_PER_SM // (per_thread * 32 * warps), THREADS_PER_SM // (32 * warps), PROGRAMS_PER_SM_AT_MOST)


def report(name, fn, signature, constexprs, cfg):
    regs = registers(fn, signature, constexprs, cfg["num_warps"])
    fit, counted = programs_that_fit(regs, cfg["num_warps"]), cfg["PROGRAMS_PER_SM"]
    verdict = "ok" if fit >= counted else "FEWER FIT THAN COUNTED"
    print(f"{name}: {regs} registers at {cfg['num_warps']} warps, {fit} fit per SM, {counted} counted: {verdict}",
          flush=True)


def slices_pow2(N, block):
    return 1 << max(-(-N // block) - 1, 0).bit_length()


def main():
    sm, norm = ik.sm, ik.norm
    split_fwd = {"x_ptr": "*bf16", "y_ptr": "*bf16", "slots_ptr": "*i64", "M": "i32", "N": "i32",
                 "x_row_stride": "i32", "y_row_stride": "i32", "SLICES": "i32", "LAG": "i32", "LOG": "constexpr",
                 "BLOCK": "constexpr", "SLICES_POW2": "constexpr", "ALIGN": "constexpr"}
    split_bwd = {"y_ptr": "*bf16", "dy_ptr": "*bf16", "dx_ptr": "*bf16", "slots_ptr": "*i64", "M": "i32", "N": "i32",
                 "y_row_stride": "i32", "dy_row_stride": "i32", "dx_row_stride": "i32", "SLICES": "i32", "LAG": "i32",
                 "LOG": "constexpr", "BLOCK": "constexpr", "SLICES_POW2": "constexpr", "ALIGN": "constexpr"}
    own_row = {k: v for k, v in split_bwd.items() if k != "LAG"}
    for N in (131072, 262144):
        for log in (False, True):
            name = "log_softmax" if log else "softmax"
            cfg = sm.forward_config(N, log)
            report(f"{name} fwd N={N} ({cfg['plan']})", sm._forward_split_kernel, split_fwd,
                   {"LOG": log, "BLOCK": cfg["BLOCK"], "SLICES_POW2": slices_pow2(N, cfg["BLOCK"])}, cfg)
            cfg = sm.backward_config(N, log)
            kernel, signature = (sm._backward_own_row_kernel, own_row) if cfg["plan"] == "own_row" else \
                (sm._backward_split_kernel, split_bwd)
            report(f"{name} bwd N={N} ({cfg['plan']})", kernel, signature,
                   {"LOG": log, "BLOCK": cfg["BLOCK"], "SLICES_POW2": slices_pow2(N, cfg["BLOCK"])}, cfg)
    for rms in (True, False):
        kind = "rms_norm" if rms else "layer_norm"
        for residual in ((False, True) if rms else (False,)):
            cfg = norm.forward_config(262144, rms, residual)
            flags = {"RMS": rms, "HAS_RESIDUAL": residual, "HAS_WEIGHT": True, "HAS_BIAS": not rms}
            report(f"{kind}{' + residual' if residual else ''} fwd N=262144 ({cfg['plan']})",
                   norm._forward_split_kernel, ik.signature(norm._forward_split_kernel),
                   {**flags, "BLOCK": cfg["BLOCK"], "SLICES_POW2": slices_pow2(262144, cfg["BLOCK"])}, cfg)
        for N in (1024, 4096, 8192):
            cfg = norm.backward_config(N, rms)
            for dh in ((False, True) if rms else (False,)):
                report(f"{kind} bwd N={N}{' + residual' if dh else ''} (rows)", norm._backward_rows_kernel,
                       ik.signature(norm._backward_rows_kernel),
                       {"RMS": rms, "HAS_WEIGHT": True, "HAS_BIAS": not rms, "HAS_DH": dh,
                        "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]}, cfg)
        cfg = norm.backward_config(262144, rms)
        if cfg["plan"] == "blocks":
            for bias, dh in ((False, False), (False, True), (True, True)):
                report(f"{kind} bwd N=262144 bias={bias} residual={dh} (blocks)", norm._backward_blocks_kernel,
                       ik.signature(norm._backward_blocks_kernel),
                       {"HAS_WEIGHT": True, "HAS_BIAS": bias, "HAS_DH": dh, "ROWS": cfg["ROWS"], "BLOCK": cfg["BLOCK"],
                        "SLICES_POW2": slices_pow2(262144, cfg["BLOCK"])}, cfg)
        else:
            report(f"{kind} bwd N=262144 (long: chunks)", norm._backward_chunks_kernel,
                   ik.signature(norm._backward_chunks_kernel),
                   {"RMS": rms, "HAS_WEIGHT": True, "HAS_BIAS": not rms, "HAS_DH": False, "ONE_CHUNK": False,
                    "BLOCK": cfg["BLOCK"]}, cfg)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()
    main()
