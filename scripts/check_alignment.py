"""Which width the loads and stores of a row kernel get when the row length and strides are
8-divisible but not 16 (rows of 1000 or 3000 bf16 elements, a vocabulary of 50264): compiles for sm_90 on the CPU
machine (Triton ships ptxas), with ALIGN 1 and 8, and counts the SASS memory instructions.
LDG.E.U16 / STG.E.U16 are 2-byte accesses; LDG.E.128 / STG.E.128 are 16-byte ones.

    python scripts/check_alignment.py
"""

import importlib
import os
import subprocess
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import inspect_kernel

norm = importlib.import_module("pintail.norm")
softmax = importlib.import_module("pintail.softmax")
ce = importlib.import_module("pintail.cross_entropy")
CASES = [(norm._forward_rows_kernel, {"RMS": False, "HAS_RESIDUAL": False, "HAS_WEIGHT": True, "HAS_BIAS": True,
                                      "BLOCK_M": 2, "BLOCK_N": 1024}),
         (norm._forward_long_kernel, {"RMS": True, "HAS_RESIDUAL": False, "HAS_WEIGHT": True, "HAS_BIAS": False,
                                      "BLOCK": 1024, "ONE_CHUNK": False}),
         (softmax._forward_rows_kernel, {"LOG": False, "BLOCK_M": 2, "BLOCK_N": 1024}),
         (softmax._forward_two_pass_kernel, {"LOG": False, "BLOCK": 8192}),
         (softmax._backward_rows_kernel, {"LOG": False, "BLOCK_M": 2, "BLOCK_N": 1024}),
         (norm._backward_rows_kernel, {"RMS": False, "HAS_WEIGHT": True, "HAS_BIAS": True, "HAS_DH": False,
                                       "BLOCK_M": 2, "BLOCK_N": 1024}),
         (norm._backward_chunks_kernel, {"RMS": True, "HAS_WEIGHT": True, "HAS_BIAS": False, "HAS_DH": True,
                                         "ONE_CHUNK": False, "BLOCK": 4096}),
         (norm._row_sums_kernel, {"RMS": False, "HAS_WEIGHT": True, "BLOCK": 4096}),
         (norm._backward_blocks_kernel, {"HAS_WEIGHT": True, "HAS_BIAS": False, "HAS_DH": False, "ROWS": 16,
                                         "BLOCK": 2048, "SLICES_POW2": 16}),
         (ce._forward_kernel, {"HAS_WEIGHT": False, "SMOOTH": False, "SOFTCAP": False, "BLOCK": 8192}),
         (ce._forward_probs_kernel, {"HAS_WEIGHT": False, "SOFTCAP": False, "BLOCK": 8192}),
         (ce._backward_kernel, {"HAS_WEIGHT": False, "SMOOTH": False, "SOFTCAP": False, "MEAN": True, "BLOCK": 8192}),
         (ce._backward_probs_kernel, {"HAS_WEIGHT": False, "SOFTCAP": False, "MEAN": True, "BLOCK": 8192})]


def main():
    for fn, constexprs in CASES:
        signature = inspect_kernel.signature(fn)
        # pointers 16-byte aligned (torch's allocations); sizes and strides without Triton's 16-divisibility
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name.endswith("_ptr")}
        for align in (1, 8):
            even = {"EVEN": False} if "EVEN" in signature else {}  # odd rows: masked
            one_tile = {"TAIL": 0} if "TAIL" in signature else {}  # the row as one tile
            src = ASTSource(fn=fn, signature=signature, constexprs={**constexprs, **even, **one_tile, "ALIGN": align},
                            attrs=attrs)
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            path = "/tmp/pintail_alignment.cubin"
            with open(path, "wb") as f:
                f.write(kernel.asm["cubin"])
            sass = subprocess.run([os.path.join(inspect_kernel.BIN, "cuobjdump"), "-sass", path],
                                  capture_output=True, text=True).stdout
            ops = Counter(word for line in sass.splitlines() for word in line.split() if word.startswith(("LDG", "STG")))
            print(f"{fn.__module__}.{fn.__name__} ALIGN={align}: {dict(ops)}")


if __name__ == "__main__":
    main()
