"""Does a cache hint lift the copy ceiling of the softmax forward's slice pattern (session 49)?

Session 21 measured the one-row pattern as a plain Triton copy at 0.915-0.94 of the copy
bandwidth, where torch's copy_ of the same rows (the driver's memcpy) reads 0.965: the forward
at 32768 / 131072 runs at its pattern's ceiling, 0.94 is that ceiling, and only a better copy
moves the bar. Here each 16-byte chunk is moved by inline PTX with the L2 prefetch-size
qualifiers (`.L2::128B`, `.L2::256B`), the non-coherent path (`.nc`), L1 no-allocate, and
stores likewise, beside tl.load / tl.store of the same slices (the same grid: one program a
slice, SLICES programs a row). Whole rows only (N a multiple of BLOCK): no masks.

    python scripts/exp_copy_hints.py --check     # CPU: the plain kernel is exact (asm needs a GPU)
    python scripts/exp_copy_hints.py --inspect   # CPU: sm_90 SASS of each load / store form
    python scripts/exp_copy_hints.py             # GPU: every form at 32768 / 131072, copy_ and the library
"""

import torch
import triton
import triton.language as tl

import measure

LOADS = {
    "plain": "ld.global.v4.b32 {$0, $1, $2, $3}, [$4];",
    "L2::128B": "ld.global.L2::128B.v4.b32 {$0, $1, $2, $3}, [$4];",
    "L2::256B": "ld.global.L2::256B.v4.b32 {$0, $1, $2, $3}, [$4];",
    "nc": "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];",
    "nc L1::no_allocate L2::256B": "ld.global.nc.L1::no_allocate.L2::256B.v4.b32 {$0, $1, $2, $3}, [$4];",
}
STORES = {
    "plain": "st.global.v4.b32 [$1], {$2, $3, $4, $5};\nmov.u32 $0, 0;",
    "L1::no_allocate": "st.global.L1::no_allocate.v4.b32 [$1], {$2, $3, $4, $5};\nmov.u32 $0, 0;",
}


@triton.jit
def _copy_kernel(x_ptr, y_ptr, row_stride, BLOCK: tl.constexpr, SLICES: tl.constexpr, LOAD: tl.constexpr,
                 STORE: tl.constexpr):
    # program p copies slice p % SLICES of row p // SLICES, in 16-byte chunks of 8 bf16
    program = tl.program_id(0)
    row = (program // SLICES).to(tl.int64)
    if LOAD == "":
        cols = (program % SLICES) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + row * row_stride + cols, tl.load(x_ptr + row * row_stride + cols))
    else:
        chunks = (program % SLICES) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        a, b, c, d = tl.inline_asm_elementwise(LOAD, "=r,=r,=r,=r,l", [x_ptr + row * row_stride + chunks * 8],
                                               dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False,
                                               pack=1)
        tl.inline_asm_elementwise(STORE, "=r,l,r,r,r,r", [y_ptr + row * row_stride + chunks * 8, a, b, c, d],
                                  dtype=tl.int32, is_pure=False, pack=1)


def copy(x, block, warps, load="", store=""):
    M, N = x.shape
    assert N % block == 0 and x.is_contiguous()
    y = torch.empty_like(x)
    _copy_kernel[(M * (N // block),)](x, y, N, BLOCK=block, SLICES=N // block, LOAD=LOADS.get(load, ""),
                                      STORE=STORES.get(store, ""), num_warps=warps)
    return y


FORMS = [("tl.load / tl.store", "", "")] + [(f"asm load {ld}, store {st}", ld, st) for ld in LOADS for st in
                                                ("plain",)] + [("asm load L2::256B, store L1::no_allocate",
                                                                "L2::256B", "L1::no_allocate")]
SHAPES = [(32768, 8192, 4), (32768, 32768, 16), (131072, 8192, 4)]  # (N, slice, warps): the library's and the best


def check(device):
    x = torch.randn(5, 1024, device=device, dtype=torch.bfloat16)
    assert torch.equal(copy(x, 256, 4), x)
    if device.type == "cuda":
        for _, ld, st in FORMS[1:]:
            assert torch.equal(copy(x, 256, 4, ld, st), x), (ld, st)
    print("copies exact")


def inspect():
    import inspect_kernel as ik
    for label, ld, st in FORMS:  # prints each form's LDG / STG opcodes (the hints show as LTC128B, ...)
        print(label)
        ik.inspect(_copy_kernel, ik.signature(_copy_kernel),
                   {"BLOCK": 8192, "SLICES": 4, "LOAD": LOADS.get(ld, ""), "STORE": STORES.get(st, "")}, 4)


def main():
    import pintail
    for N, M, copy_bw in measure.long_rows(check, sizes=(32768, 131072)):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        nbytes = 2 * x.numel() * 2
        for _ in range(2):
            measure.print_fraction(f"N={N} torch copy_", lambda: y.copy_(x), nbytes, copy_bw)
            measure.print_fraction(f"N={N} library softmax", lambda: pintail.softmax(x), nbytes, copy_bw)
            for n, block, warps in SHAPES:
                if n != N:
                    continue
                for label, ld, st in FORMS:
                    measure.print_fraction(f"N={N} {N // block} x {block}/{warps}w {label}",
                                           lambda: copy(x, block, warps, ld, st), nbytes, copy_bw)


if __name__ == "__main__":
    measure.experiment(check, inspect, main)
