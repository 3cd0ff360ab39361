"""Experiment: RMSNorm's blocks backward (pintail/norm.py, `_backward_blocks_kernel`,
0.60-0.64 of copy alone past N = 8192) with x and dy brought in by TMA, several rows ahead,
into shared memory instead of registers.

Why: the library's kernel has one row's loads in flight per program (8 KB at 2048 bf16
elements), ~32 KB per SM at 4 programs per SM; Little's law asks ~64 KB per SM for the
H200's HBM under load (~4.25 TB/s x ~2 us / 132 SMs). Every way of getting more in flight
through registers lost: rows published two ahead (more registers, 3 programs per SM),
smaller slices on more programs (the same bytes per SM), the wait moved before the publish
(session 12: 0.57-0.59). Triton 3.6 pipelines loads only when they come from a tensor
descriptor (TMA) in a `tl.range(..., num_stages=S)` loop, and only if the loop holds no
other loop: the spin on the row's words is a `noinline` function here, so that the
pipeliner sees a call, not a loop (checked by compiling for sm_90 on the CPU machine:
`--inspect` prints the TMA copies and shared memory of each configuration). S - 1 rows of
x and dy are then in flight in shared memory while a row is reduced and written.

AHEAD (0 or 1): 0 publishes row r and waits for it in the same iteration; 1 publishes row
r and then waits for row r - 1 (the library's order: a row of slack for the slowest slice),
carrying row r - 1's x and dy in registers.

Predicted: 0.75-0.85 at N = 32768-262144 if bytes in flight are the limit; if not (about
0.60-0.64 again), the limit is the row's round trip itself, and the blocks plan is at its
end in Triton 3.6.

    TRITON_INTERPRET=1 python scripts/exp_norm_blocks_tma.py --check   # the interpreter, CPU
    python scripts/exp_norm_blocks_tma.py --inspect                     # TMA copies, registers, sm_90, CPU
    python scripts/exp_norm_blocks_tma.py                               # GPU: check, then time
"""

import importlib
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import exp_norm_blocks_deep as deep

norm = importlib.import_module("pintail.norm")
split = importlib.import_module("pintail._split")
launch_module = importlib.import_module("pintail._launch")


@triton.jit
def _row_sum(slots_ptr, row, SLICES, SLICES_POW2: tl.constexpr, SPIN_ASM: tl.constexpr):
    """The sum of the published words of `row`, once all are there. SPIN_ASM: each thread
    spins on its own words in inline PTX, so that the pipeliner sees no loop (a noinline
    function would hide the loop too, but Triton 3.6 gives its reduction scratch the same
    shared memory as the caller's TMA buffers); the interpreter takes the library's loop."""
    if SPIN_ASM:
        k = tl.arange(0, SLICES_POW2)
        # past the row's slices: the ticket counter, nonzero once any ticket is taken
        ptrs = tl.where(k < SLICES, slots_ptr + 1 + row * SLICES + k, slots_ptr)
        words = tl.inline_asm_elementwise(
            """{
            .reg .pred p;
            spin${:uid}:
            ld.volatile.global.b64 $0, [$1];
            setp.eq.s64 p, $0, 0;
            @p bra spin${:uid};
            }""", "=l,l", [ptrs], dtype=tl.int64, is_pure=False, pack=1)
        parts = words.to(tl.int32).to(tl.float32, bitcast=True)
        return tl.sum(tl.where(k < SLICES, parts, 0.0), axis=0)
    else:
        _, parts, valid = split.wait_for_row(slots_ptr, row, SLICES, SLICES_POW2)
        return tl.sum(tl.where(valid, parts, 0.0), axis=0)


@triton.jit
def _load_row(x_desc, dy_desc, row, col0, BLOCK: tl.constexpr):
    row, col0 = row.to(tl.int32), col0.to(tl.int32)  # TMA coordinates are 32-bit
    return x_desc.load([row, col0]).reshape([BLOCK]), dy_desc.load([row, col0]).reshape([BLOCK])


@triton.jit
def _dx_row(x_raw, dy_raw, w, total, rstd_ptr, dx_ptr, row, cols, mask, dx_row_stride, inv_n, dw):
    rstd = tl.load(rstd_ptr + row)
    x_hat = x_raw.to(tl.float32) * rstd
    dy = dy_raw.to(tl.float32)
    dx = rstd * (dy * w - x_hat * (total * inv_n))
    tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    return dw + dy * x_hat


@triton.jit(do_not_specialize=["SLICES"])
def tma_kernel(x_desc, w_ptr, dy_desc, rstd_ptr, slots_ptr, dx_ptr, dw_ptr, M, N, inv_n, SLICES, dx_row_stride,
               ROWS: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr, STAGES: tl.constexpr,
               AHEAD: tl.constexpr, SPIN_ASM: tl.constexpr):
    # The library's blocks kernel (RMSNorm with a weight, no bias, no residual gradient), its
    # rows' x and dy through TMA (rows past M and columns past N come in as zeros).
    end = tl.cdiv(M, ROWS) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        block = ticket // SLICES
        slice_index = ticket % SLICES
        col0 = slice_index * BLOCK
        cols = col0 + tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        first = block * ROWS
        rows = tl.minimum(ROWS, M - first)
        if AHEAD:
            x_prev = tl.zeros([BLOCK], x_desc.dtype)
            dy_prev = tl.zeros([BLOCK], dy_desc.dtype)
            for i in tl.range(0, rows + 1, num_stages=STAGES):
                row = first + i
                x_raw, dy_raw = _load_row(x_desc, dy_desc, tl.minimum(row, first + rows - 1), col0, BLOCK)
                if i < rows:
                    norm._publish_sum_gx(slots_ptr, x_raw, dy_raw, w, rstd_ptr, row, SLICES, slice_index)
                if i > 0:
                    total = _row_sum(slots_ptr, row - 1, SLICES, SLICES_POW2, SPIN_ASM)
                    dw = _dx_row(x_prev, dy_prev, w, total, rstd_ptr, dx_ptr, row - 1, cols, mask, dx_row_stride,
                                 inv_n, dw)
                x_prev, dy_prev = x_raw, dy_raw
        else:
            for i in tl.range(0, rows, num_stages=STAGES):
                row = first + i
                x_raw, dy_raw = _load_row(x_desc, dy_desc, row, col0, BLOCK)
                norm._publish_sum_gx(slots_ptr, x_raw, dy_raw, w, rstd_ptr, row, SLICES, slice_index)
                total = _row_sum(slots_ptr, row, SLICES, SLICES_POW2, SPIN_ASM)
                dw = _dx_row(x_raw, dy_raw, w, total, rstd_ptr, dx_ptr, row, cols, mask, dx_row_stride, inv_n, dw)
        tl.store(dw_ptr + block * N + cols, dw, mask=mask)
        ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")


def backward(dy, x, w, rstd, cfg):
    """(dx, dweight) of RMSNorm rows x[M, N] (contiguous, N * elem a multiple of 16 bytes:
    TMA's rule) with a weight (float32 dweight)."""
    M, N = x.shape
    block, slices, dx, dw, slots, grid = deep.blocks_plan(x, cfg)
    x_desc = TensorDescriptor.from_tensor(x, [1, block])
    dy_desc = TensorDescriptor.from_tensor(dy, [1, block])
    tma_kernel[grid](
        x_desc, w, dy_desc, rstd, slots, dx, dw, M, N, 1.0 / N, slices, dx.stride(0), ROWS=cfg["ROWS"], BLOCK=block,
        SLICES_POW2=launch_module.next_power_of_2(slices), STAGES=cfg["STAGES"], AHEAD=cfg["AHEAD"],
        SPIN_ASM=not launch_module.INTERPRET,
        num_warps=cfg["num_warps"], **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {}))
    return dx, dw.sum(0)


def check(device):
    for ahead in (0, 1):
        for stages in (1, 3):
            deep.check_against_library(
                f"TMA (ahead {ahead}, {stages} stages)",
                lambda dy, x, w, rstd, cfg: backward(dy, x, w, rstd, {**cfg, "STAGES": stages, "AHEAD": ahead}),
                device, cases=CHECK_CASES)


# deep.check_against_library's cases with row lengths TMA takes (16-byte rows in float32).
CHECK_CASES = ((13, 300, 4, 64), (5, 1000, 8, 256), (3, 4100, 2, 1024), (9, 36, 1, 64), (2, 4, 4, 64),
               (40, 200, 32, 64))
# Registers (--inspect, sm_90): 2048 / 8 warps 128 (2 programs per SM: 3-5 rows of 8 KB in
# flight each), 2048 / 4 warps 227-255 uncapped (2 per SM) or 128 capped with ~200 B of
# spills, 1024 / 4 warps 96-110 (4 per SM; 256 slices at 262144, more than the SMs: skipped).
CONFIGS = [{"ROWS": 32, "BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm, "STAGES": stages,
            "AHEAD": ahead, **extra}
           for block, warps, per_sm, stages, ahead, extra in (
               (2048, 8, 2, 4, 1, {}), (2048, 8, 2, 4, 0, {}), (2048, 8, 2, 6, 1, {}),
               (2048, 4, 4, 4, 0, {"maxnreg": 128}), (2048, 4, 2, 4, 1, {}), (1024, 4, 4, 4, 1, {}),
               (1024, 4, 4, 4, 0, {}), (4096, 16, 1, 4, 1, {}))]


def inspect():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    for cfg in CONFIGS:
        sig = {p.name: "constexpr" if p.is_constexpr else "i32" for p in tma_kernel.params}
        for name in ("x_desc", "dy_desc"):
            sig[name] = f"tensordesc<bf16[1, {cfg['BLOCK']}]>"
        sig.update(w_ptr="*bf16", rstd_ptr="*fp32", slots_ptr="*i64", dx_ptr="*bf16", dw_ptr="*fp32", inv_n="fp32")
        constexprs = {"ROWS": cfg["ROWS"], "BLOCK": cfg["BLOCK"], "SLICES_POW2": 16, "STAGES": cfg["STAGES"],
                      "AHEAD": cfg["AHEAD"], "SPIN_ASM": True}
        options = {"num_warps": cfg["num_warps"], **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {})}
        compiled = triton.compile(ASTSource(tma_kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                                  options=options)
        ttgir = compiled.asm["ttgir"]
        print(f"{cfg}: TMA copies {ttgir.count('async_tma_copy')}, shared {compiled.metadata.shared} B, "
              f"registers {registers(compiled)}")


def registers(compiled):
    import os
    import re
    import subprocess
    import tempfile
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                             text=True).stderr
    return " / ".join(re.findall(r"Used (\d+) registers", out)) + ", spills " + " / ".join(
        re.findall(r"(\d+) bytes spill stores", out))


def main():
    """Per long-row size: the library's blocks plan, then each configuration, checked against
    the library's dx and dweight at that size (a race shows only at full size) and timed."""
    from measure import long_rows, print_fraction
    for N, M, copy_bw in long_rows(check):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        _, _, _, rstd = norm._forward(x, None, w, None, 1e-6, 0.0, True, x.dtype)
        want = deep.library(dy, x, w, rstd, {})
        print_fraction(f"N={N} library blocks", lambda: deep.library(dy, x, w, rstd, {}), 3 * x.numel() * 2, copy_bw)
        for cfg in CONFIGS:
            if launch_module.cdiv(N, cfg["BLOCK"]) > launch_module.program_slots(x.device, 1):
                continue  # a row's slices must all run at once
            got = backward(dy, x, w, rstd, cfg)
            errors = [((g.float() - r.float()).abs().max() / r.float().abs().max()).item() for g, r in zip(got, want)]
            print_fraction(f"N={N} TMA {cfg} (error dx {errors[0]:.1e}, dw {errors[1]:.1e})",
                           lambda: backward(dy, x, w, rstd, cfg), 3 * x.numel() * 2, copy_bw)


if __name__ == "__main__":
    from measure import experiment
    experiment(check, inspect, main)
