"""Softmax forward one row a cluster, the slice staged in shared memory by cp.async (session 20, bf16 only).

quack's forward (0.94 at 131072, 0.89 at 262144 in BENCHMARKS.md) copies each thread's 16
bytes of the slice into shared memory with cp.async, waits for its own copies, then reads
them back into registers; our one-row forward loads the slice straight into registers (0.93
/ 0.87, persistent at 262144), and session 18's bulk copies through the TMA engine lost
(0.70-0.85). Here the library's one-row kernel (block reductions, then the exchange; the
late cluster wait) takes its slice through shared memory the per-thread way: a 16-byte
cp.async per chunk (zero-filled past N), cp.async.wait_all, and a 16-byte ld.shared per
chunk by the thread that copied it (the chunk layout is the load's, so no bar.sync). Only
the path of the bytes changes: the registers and the reductions stay the library's.
Measured (session 20, kernel alone, bf16; library in the same run): lost everywhere.
131072 0.84 at 8192 / 4 warps (80 registers, with or without a bar.sync; library 0.92),
0.89 at 16384 / 8 warps; 65536 0.84-0.92 (0.94); 262144 0.84 (0.88).

    python scripts/exp_softmax_staged.py --inspect          # CPU: sm_90 registers, spills, bar.syncs
    python scripts/exp_softmax_staged.py [--sizes N,...]    # GPU: checked against torch, then timed
"""

import argparse
import importlib

import torch
import triton
import triton.language as tl

sm = importlib.import_module("pintail.softmax")
cluster = importlib.import_module("pintail._cluster")
launch_ = importlib.import_module("pintail._launch")

# chunk i (16 bytes) of the slice from global $2 to shared $1 past global_smem; $3 bytes read
# (16, or 0 past N: the chunk is zero-filled)
_STAGE = tl.constexpr("{\n.reg .b32 s;\nmov.u32 s, global_smem;\nadd.u32 s, s, $1;\n"
                      "cp.async.cg.shared.global [s], [$2], 16, $3;\nmov.b32 $0, 0;\n}")
_WAIT_ALL = tl.constexpr("cp.async.wait_all;\nmov.b32 $0, $1;")
# eight 16-bit values (one chunk, four words) from shared $4 past global_smem
_READ = tl.constexpr("{\n.reg .b32 a;\nmov.u32 a, global_smem;\nadd.u32 a, a, $4;\n"
                     "ld.shared.v4.b32 {$0, $1, $2, $3}, [a];\n}")


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _forward_staged_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, zero, WORDS, SLICE, ROUNDS,
                           LOG: tl.constexpr, BLOCK: tl.constexpr, CLUSTER: tl.constexpr,
                           CLUSTER_POW2: tl.constexpr, VEC: tl.constexpr, BARRIER: tl.constexpr):
    rank, row, _, token = cluster.start(WORDS, CLUSTER, WAIT=False)
    row = row.to(tl.int64)
    chunks = tl.arange(0, BLOCK // VEC)
    first = rank * BLOCK + chunks * VEC  # the chunk's first column
    tl.inline_asm_elementwise(
        _STAGE, "=r,r,l,r", [SLICE + chunks * 16, x_ptr + row * x_row_stride + first,
                             tl.where(first < N, 16, 0)], dtype=tl.int32, is_pure=False, pack=1)
    token = tl.inline_asm_elementwise(_WAIT_ALL, "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)
    if BARRIER:
        tl.debug_barrier()
    # each thread reads back the chunks it copied (the same chunk layout: no bar.sync), eight
    # values an asm. The asm takes its layout from its operand: a load with every lane
    # masked off (`zero` is 0 at run time; no bytes move) gives the operand the load's
    # layout, eight contiguous values a thread, as the library's x has; from an arange the
    # operand would get one value a thread, and eight of those are not a chunk.
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    anchor = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < zero, other=0).to(tl.int32)
    x = tl.inline_asm_elementwise(_READ, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [SLICE + (cols - rank * BLOCK) * 2 + anchor],
                                  dtype=x_ptr.dtype.element_ty, is_pure=False, pack=8)
    x = tl.where(mask, x.to(tl.float32), -float("inf"))
    y, token = sm._softmax_across_cluster(x, WORDS, 0, token, LOG, CLUSTER, CLUSTER_POW2, True)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def staged_forward(x, block, warps, log=False, barrier=False, maxnreg=None):
    """y from the staged kernel on a grid of one cluster a row."""
    M, N = x.shape
    y = torch.empty_like(x)
    ctas = triton.cdiv(N, block)
    args = (x, y, M, N, x.stride(0), y.stride(0), 0, 0, 0, 1)
    kw = dict(LOG=log, BLOCK=block, CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas),
              VEC=16 // x.element_size(), BARRIER=barrier, num_warps=warps)
    if maxnreg:
        kw["maxnreg"] = maxnreg

    def prepare(compiled):
        words = -(-compiled.metadata.shared // 16) * 16
        slice_at = words + -(-cluster.words_bytes(ctas) // 16) * 16
        shared = slice_at + block * x.element_size()
        fits = cluster._clusters_that_fit(compiled.function, compiled.metadata.num_warps, ctas, shared)
        return compiled, (words, slice_at), (compiled.metadata.num_warps, ctas, shared), fits

    bound, (compiled, (words, slice_at), packed, _) = launch_.compiled_for(_forward_staged_kernel, x.device.index,
                                                                           (ctas,), args, kw, prepare)
    bound["WORDS"], bound["SLICE"] = words, slice_at
    compiled.run(M, 1, 1, torch.cuda.current_stream().cuda_stream, compiled.function, packed,
                 None, None, None, *bound.values())
    return y


def inspect():
    """Registers, spills and bar.syncs for sm_90 (CPU machine)."""
    ik = importlib.import_module("inspect_kernel")
    sig = {**ik.signature(_forward_staged_kernel), "WORDS": "i32", "SLICE": "i32", "ROUNDS": "i32", "zero": "i32"}
    for block, warps, r, barrier in ((8192, 4, 80, False), (8192, 4, None, False), (8192, 4, 80, True),
                                     (16384, 8, 80, False)):
        const = {"LOG": False, "BLOCK": block, "CLUSTER": 16, "CLUSTER_POW2": 16, "VEC": 8, "BARRIER": barrier}
        ik.EXTRA_OPTIONS.clear()
        if r:
            ik.EXTRA_OPTIONS["maxnreg"] = r
        ik.inspect(_forward_staged_kernel, sig, const, warps)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--inspect", action="store_true")
    p.add_argument("--sizes", default="32768,65536,131072,262144")
    args = p.parse_args()
    if args.inspect:
        return inspect()
    from measure import softmax_forms

    def forms(N, x):
        return [(f"staged {triton.cdiv(N, block)} x {block}/{warps}w maxnreg {r}{' barrier' if barrier else ''}",
                 lambda log, b=block, w=warps, r=r, bar=barrier: staged_forward(x, b, w, log, bar, r))
                for block, warps, r, barrier in ((8192, 4, 80, False), (8192, 4, 80, True), (8192, 4, None, False),
                                                 (8192, 8, None, False), (16384, 8, 80, False), (16384, 8, None, False))
                if 2 <= triton.cdiv(N, block) <= 16]

    softmax_forms(forms, tuple(map(int, args.sizes.split(","))))


if __name__ == "__main__":
    main()
