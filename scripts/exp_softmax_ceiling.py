"""The copy ceiling of the softmax forward's plan shapes (session 21): each plan's memory
pattern with no math and no exchange, so the gap between a plan and its own ceiling is what
its work costs, and the gap between the ceiling and 1.0 is what its shape costs.

A program copies one slice of BLOCK elements of a row, as CTA `rank` of a cluster does
(SLICES programs a row, no cluster launched). PERSISTENT: PROGRAMS programs (a multiple of
SLICES) take row after row, loading the next row's slice before storing this one (the
library's form at 262144: 15 clusters of 8 x 32768 / 16 warps, 120 of 132 SMs). Otherwise
one row's slices a group of programs, M x SLICES programs (the one-row form at 131072).

    python scripts/exp_softmax_ceiling.py --check   # CPU, in the interpreter: the copies are exact
    python scripts/exp_softmax_ceiling.py           # GPU: the library, then each shape's copy
"""

import torch
import triton
import triton.language as tl

import measure


@triton.jit
def _slice_copy_kernel(x_ptr, y_ptr, M, N, row_stride, ROUNDS, BLOCK: tl.constexpr, SLICES: tl.constexpr,
                       PERSISTENT: tl.constexpr, STREAM: tl.constexpr = False):
    # STREAM: loads evict_first, stores .cs (streaming: neither is read again)
    program = tl.program_id(0)
    cols = (program % SLICES) * BLOCK + tl.arange(0, BLOCK)
    first_row = program // SLICES
    if PERSISTENT:
        groups = tl.num_programs(0) // SLICES
        x_next = tl.load(x_ptr + first_row.to(tl.int64) * row_stride + cols, mask=(cols < N) & (first_row < M))
        for i in range(0, ROUNDS):
            row = first_row + i * groups
            x = x_next
            next_row = row + groups
            x_next = tl.load(x_ptr + next_row.to(tl.int64) * row_stride + cols, mask=(cols < N) & (next_row < M))
            tl.store(y_ptr + row.to(tl.int64) * row_stride + cols, x, mask=(cols < N) & (row < M))
    else:
        offsets = first_row.to(tl.int64) * row_stride + cols
        if STREAM:
            x = tl.load(x_ptr + offsets, mask=cols < N, eviction_policy="evict_first")
            tl.store(y_ptr + offsets, x, mask=cols < N, cache_modifier=".cs")
        else:
            tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=cols < N), mask=cols < N)


def slice_copy(x, block, warps, programs=None, stream=False):
    """Copy x (rows) by slices of `block`: persistent on `programs` programs, or one group of
    programs a row where programs is None."""
    M, N = x.shape
    y = torch.empty_like(x)
    slices = triton.cdiv(N, block)
    if programs is None:
        _slice_copy_kernel[(M * slices,)](x, y, M, N, N, 0, BLOCK=block, SLICES=slices, PERSISTENT=False,
                                          STREAM=stream, num_warps=warps)
    else:
        rounds = triton.cdiv(M, programs // slices)
        _slice_copy_kernel[(programs,)](x, y, M, N, N, rounds, BLOCK=block, SLICES=slices, PERSISTENT=True,
                                        num_warps=warps)
    return y


# (N, block, warps, programs or None), beside the library's plan at that N
SHAPES = [(131072, 8192, 4, None), (131072, 16384, 8, None), (131072, 8192, 4, 768),
          (262144, 32768, 16, 120), (262144, 32768, 16, 128), (262144, 65536, 32, 132), (262144, 16384, 8, 256),
          (262144, 16384, 8, None), (262144, 32768, 16, None)]
# one row a group of programs, every slice a size and warps allow without spilling
ONE_ROW = [(4096, 4), (8192, 4), (8192, 8), (16384, 4), (16384, 8), (16384, 16), (32768, 8), (32768, 16), (32768, 32)]


def check(device):
    x = torch.randn(37, 1000, device=device)
    for block, programs, stream in ((256, None, False), (256, None, True), (256, 8, False), (512, 6, False)):
        assert torch.equal(slice_copy(x, block, 4, programs, stream), x), (block, programs)
    print("slice copies exact")


def main():
    import pintail
    for N, M, copy_bw in measure.long_rows(check, sizes=(65536, 131072, 262144)):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * x.numel() * 2
        measure.print_fraction(f"N={N} library softmax", lambda: pintail.softmax(x), nbytes, copy_bw)
        y = torch.empty_like(x)
        measure.print_fraction(f"N={N} torch copy_ of the same rows", lambda: y.copy_(x), nbytes, copy_bw)
        for block, warps in ONE_ROW:
            for stream in (False, True):
                measure.print_fraction(f"N={N} copy {block} / {warps}w, one row a group, stream {stream}",
                                       lambda: slice_copy(x, block, warps, None, stream), nbytes, copy_bw)
        for n, block, warps, programs in SHAPES:
            if n == N:
                measure.print_fraction(f"N={N} copy {block} / {warps}w, "
                                       f"{'one row a group' if programs is None else f'{programs} programs'}",
                                       lambda: slice_copy(x, block, warps, programs), nbytes, copy_bw)


if __name__ == "__main__":
    main()
