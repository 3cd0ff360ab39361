"""Compile a pintail kernel for sm_90 on a machine without a GPU (Triton ships ptxas) and
print registers, spills and the global memory instructions: catches compile errors and
unvectorised loads before a GPU call. Integer arguments and pointers are taken as
divisible by 16, as Triton specialises them at launch when they are.

    python scripts/inspect_kernel.py
"""

import importlib
import subprocess
import os
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sm = importlib.import_module("pintail.softmax")
ce = importlib.import_module("pintail.cross_entropy")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def inspect(fn, signature, constexprs, num_warps):
    divisible = {(i,): [["tt.divisibility", 16]] for i, (name, t) in enumerate(signature.items())
                 if t != "constexpr" and t != "fp32" and name not in ("SLICES", "LAG", "ignore_index")}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=divisible)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    path = "/tmp/pintail_inspect.cubin"
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    ops = Counter(line.split()[1] if line.split()[1].startswith("@") is False else line.split()[2]
                  for line in sass.splitlines()
                  if any(op in line for op in ("LDG", "STG", "ATOMG", "RED.")) and len(line.split()) > 2)
    regs = [l.strip() for l in usage.splitlines() if "REG" in l]
    print(f"{fn.__name__} {constexprs} warps={num_warps}: {regs[0] if regs else '?'}")
    print("   ", dict(ops))


def main():
    fwd = {"x_ptr": "*bf16", "y_ptr": "*bf16", "slots_ptr": "*i64", "M": "i32", "N": "i32", "x_row_stride": "i32",
           "y_row_stride": "i32", "SLICES": "i32", "LAG": "i32", "LOG": "constexpr", "BLOCK": "constexpr",
           "SLICES_POW2": "constexpr"}
    bwd = {"y_ptr": "*bf16", "dy_ptr": "*bf16", "dx_ptr": "*bf16", "slots_ptr": "*i64", "M": "i32", "N": "i32",
           "y_row_stride": "i32", "dy_row_stride": "i32", "dx_row_stride": "i32", "SLICES": "i32", "LAG": "i32",
           "LOG": "constexpr", "BLOCK": "constexpr", "SLICES_POW2": "constexpr"}
    for block, warps in ((8192, 4), (8192, 8), (4096, 4)):
        inspect(sm._forward_split_kernel, fwd, {"LOG": False, "BLOCK": block, "SLICES_POW2": 32}, warps)
        inspect(sm._backward_split_kernel, bwd, {"LOG": False, "BLOCK": block, "SLICES_POW2": 32}, warps)
    ce_fwd = {"x_ptr": "*bf16", "target_ptr": "*i64", "weight_ptr": "*fp32", "weight_total_ptr": "*fp32",
              "loss_ptr": "*fp32", "lse_ptr": "*fp32", "V": "i32", "x_row_stride": "i32", "ignore_index": "i32",
              "smoothing": "fp32", "z_scale": "fp32", "softcap": "fp32", "HAS_WEIGHT": "constexpr",
              "SMOOTH": "constexpr", "SOFTCAP": "constexpr", "BLOCK": "constexpr"}
    ce_bwd = {"dx_ptr": "*bf16", "x_ptr": "*bf16", "target_ptr": "*i64", "weight_ptr": "*fp32",
              "weight_total_ptr": "*fp32", "lse_ptr": "*fp32", "grad_ptr": "*fp32", "V": "i32",
              "x_row_stride": "i32", "dx_row_stride": "i32", "grad_stride": "i32", "ignore_index": "i32",
              "smoothing": "fp32", "z_scale": "fp32", "softcap": "fp32", "HAS_WEIGHT": "constexpr",
              "SMOOTH": "constexpr", "SOFTCAP": "constexpr", "BLOCK": "constexpr"}
    for flags in (False, True):
        options = {"HAS_WEIGHT": flags, "SMOOTH": flags, "SOFTCAP": flags}
        inspect(ce._forward_kernel, ce_fwd, {**options, "BLOCK": ce.FORWARD_BLOCK}, ce.FORWARD_WARPS)
        inspect(ce._backward_kernel, ce_bwd, {**options, "BLOCK": ce.BACKWARD_BLOCK}, ce.BACKWARD_WARPS)


if __name__ == "__main__":
    main()
