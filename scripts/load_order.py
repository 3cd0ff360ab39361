"""The order of a kernel's global loads, stores and barriers in its sm_90 SASS, with the
row's masks (EVEN False) and without (EVEN True, the row whole chunks): compiled on the
CPU machine (Triton ships ptxas). Why: torch.compile's RMSNorm kernel at N = 32768 (the
row as one 32768 chunk, 32 warps, unmasked: its sizes are constants) issues pass 2's loads
four at a time and reaches 0.94 of copy; ours in the same form with masks issued them two
at a time (ptxas zeroes a masked load's registers first) and reached 0.83-0.88. Each line:
the kernel, EVEN, registers, and the memory instructions in program order ("|" a barrier,
"(n)" n other instructions between two, "?" a predicated one).

    python scripts/load_order.py
"""

import importlib
import os
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import inspect_kernel

norm = importlib.import_module("pintail.norm")
softmax = importlib.import_module("pintail.softmax")
CASES = [
    (norm._forward_long_kernel, {"RMS": True, "HAS_RESIDUAL": False, "HAS_WEIGHT": True, "HAS_BIAS": False,
                                 "BLOCK": 32768, "ONE_CHUNK": True, "ALIGN": 1}, 32),
    (norm._forward_long_kernel, {"RMS": True, "HAS_RESIDUAL": False, "HAS_WEIGHT": True, "HAS_BIAS": False,
                                 "BLOCK": 16384, "ONE_CHUNK": False, "ALIGN": 1}, 16),
    (norm._backward_chunks_kernel, {"RMS": False, "HAS_WEIGHT": True, "HAS_BIAS": True, "HAS_DH": False,
                                    "ONE_CHUNK": False, "BLOCK": 4096, "ALIGN": 1}, 16),
    (softmax._forward_rows_kernel, {"LOG": False, "BLOCK_M": 1, "BLOCK_N": 16384, "TAIL": 0, "EVEN": False, "ALIGN": 1},
     8),
]


def sass(fn, constexprs, warps):
    signature = inspect_kernel.signature(fn)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
             if kind not in ("constexpr", "fp32")}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    path = "/tmp/pintail_load_order.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    run = lambda flag: subprocess.run([os.path.join(inspect_kernel.BIN, "cuobjdump"), flag, path],
                                      capture_output=True, text=True).stdout
    registers = next(w for w in run("-res-usage").split() if w.startswith("REG:"))
    order, since = [], 0
    for line in run("-sass").splitlines():
        words = line.split()
        if "/*" not in line or ";" not in line:
            continue
        since += 1
        op = next((w for w in words if w.startswith(("LDG", "STG", "BAR"))), None)
        if op:
            gap = f"({since - 1}) " if since > 1 else ""
            order.append(gap + ("|" if op.startswith("BAR") else ("?" if words[1].startswith("@") else "") + op))
            since = 0
    return registers, " ".join(order)


def main():
    for fn, constexprs, warps in CASES:
        for even in (False, True):
            registers, order = sass(fn, {**constexprs, "EVEN": even}, warps)
            print(f"{fn.__name__} BLOCK={constexprs.get('BLOCK', constexprs.get('BLOCK_N'))} warps={warps} EVEN={even} {registers}:\n    {order}")


if __name__ == "__main__":
    main()
