"""Compile pintail's kernels for sm_90 on a machine without a GPU (Triton ships ptxas) and
print registers, spills and the global memory instructions: catches compile errors and
unvectorised loads before a GPU call. Integer arguments and pointers are taken as
divisible by 16, as Triton specialises them at launch when they are. --digest adds a hash
of each variant's SASS: a refactor that should leave the machine code as it was is checked
by comparing the listings before and after.

    python tools/inspect_kernel.py [--digest]
"""

import argparse
import hashlib
import subprocess
import tempfile
import os
from collections import Counter

import triton
from op_modules import Op
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sm = Op("softmax")
ce = Op("cross_entropy")
norm = Op("norm")
rot = Op("rotary")
lce = Op("linear_cross_entropy")
gated = Op("gated")
log_probs = Op("log_probs")
distillation = Op("distillation")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


FLOAT_ARGS = {"eps", "weight_offset", "inv_n", "smoothing", "z_scale", "softcap", "inv_temperature", "beta",
              "log_beta", "log_rest"}
FLOAT32_POINTERS = {"mean_ptr", "rstd_ptr", "sums_ptr", "dw_ptr", "db_ptr", "loss_ptr", "stats_ptr",
                    "denom_ptr", "mass_ptr", "grad_ptr", "dw_parts_ptr", "db_parts_ptr", "state_ptr",
                    "weight_total_ptr", "z_ratio_ptr", "lp_ptr", "entropy_ptr", "grad_lp_ptr", "grad_entropy_ptr"}
EXTRA_OPTIONS = {}  # e.g. {"maxnreg": 64}: a register cap for ptxas
NOT_16_DIVISIBLE = set()  # e.g. {"N", "x_row_stride"}: sizes Triton may not take as 16-divisible (rows of 9000)
INT_POINTERS = {"target_ptr": "*i64", "count_ptr": "*i32", "slots_ptr": "*i64", "pos_ptr": "*i64"}
DIGEST = False  # --digest


def signature(fn):
    """A signature for a kernel from its argument names: bf16 tensors, float32 statistics,
    int32 sizes and strides, the float scalars by name."""
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in FLOAT_ARGS:
            sig[p.name] = "fp32"
        elif p.name in FLOAT32_POINTERS:
            sig[p.name] = "*fp32"
        elif p.name in INT_POINTERS:
            sig[p.name] = INT_POINTERS[p.name]
        elif p.name.endswith("_ptr"):
            sig[p.name] = "*bf16"
        else:
            sig[p.name] = "i32"
    return sig


def inspect(fn, signature, constexprs, num_warps):
    divisible = {(i,): [["tt.divisibility", 16]] for i, (name, t) in enumerate(signature.items())
                 if t not in ("constexpr", "fp32") and name not in ("SLICES", "LAG", "WORDS", "ROUNDS", "ignore_index", "seq_offset",
                                                                   "rows_per_program", "HQ", "HK", "S", "D")
                 and name not in NOT_16_DIVISIBLE}
    if "ALIGN" in signature and "ALIGN" not in constexprs:  # rows of 16-divisible length (the bench's)
        constexprs = {**constexprs, "ALIGN": 1}
    if "EVEN" in signature and "EVEN" not in constexprs:  # rows of whole chunks (the bench's)
        constexprs = {**constexprs, "EVEN": True}
    if "SHIFT" in signature and "SHIFT" not in constexprs:  # rows from their own starts (the bench's)
        constexprs = {**constexprs, "SHIFT": 0}
    if "TAIL" in signature and "TAIL" not in constexprs:  # the norms' row as one tile
        constexprs = {**constexprs, "TAIL": 0}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=divisible)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **EXTRA_OPTIONS})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:  # one file a variant
        f.write(k.asm["cubin"])
    path = f.name
    usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    os.unlink(path)
    ops = Counter(line.split()[1] if line.split()[1].startswith("@") is False else line.split()[2]
                  for line in sass.splitlines()
                  if any(op in line for op in ("LDG", "STG", "ATOMG", "RED.", "BAR.")) and len(line.split()) > 2)
    regs = [l.strip() for l in usage.splitlines() if "REG" in l]
    # static SASS instructions (and MUFU ops) over the elements of BLOCK a thread holds: for a
    # loop-free body, the issue cost an element (~31 at full bandwidth for 4 bytes an element)
    body = [line for line in sass.splitlines() if line.strip().startswith("/*") and ";" in line]
    per_thread = constexprs.get("BLOCK", 0) // (32 * num_warps)
    cost = (f", {len(body) / per_thread:.1f} instructions / {sum('MUFU' in l for l in body) / per_thread:.1f} MUFU"
            f" an element of BLOCK" if per_thread else "")
    loops = loop_bodies(body)
    if loops and per_thread:  # a streaming kernel's cost an element is its loop's, not the whole body's
        cost += f"; loops {', '.join(f'{n / per_thread:.1f}' for n in loops)} an element"
    if DIGEST:
        cost += f"; sass {hashlib.sha256(sass.encode()).hexdigest()[:12]}"
    print(f"{fn.__name__} {constexprs} warps={num_warps}: {regs[0] if regs else '?'}{cost}")
    print("   ", dict(ops))
    return instruction_mix(body, per_thread)


def instruction_mix(body, per_thread):
    """The SASS body's opcodes (predicates dropped), most frequent first, each a count an
    element of BLOCK where per_thread is known (else a count): where an element's issue goes."""
    codes = [line.split("*/", 1)[1].split() for line in body]
    mix = Counter(words[1] if words[0].startswith("@") else words[0] for words in codes if words)
    return {op: round(n / per_thread, 2) if per_thread else n for op, n in mix.most_common()}


def loop_bodies(body):
    """Instructions in each loop of a SASS listing (from a branch's target back up to the
    branch), largest first."""
    address = [int(line.split("*/")[0].split("/*")[1], 16) for line in body]
    sizes = []
    for line, at in zip(body, address):
        code = line.split("*/", 1)[1]
        if " BRA " in f" {code}" and "0x" in code:
            target = int(code.split("0x")[1].split()[0].rstrip(";"), 16)
            if target < at:
                sizes.append(sum(target <= a <= at for a in address))
    return sorted(sizes, reverse=True)


def main():
    for block, warps in ((8192, 4), (8192, 8), (4096, 4)):
        for kernel in (sm._forward_split_kernel, sm._backward_split_kernel):
            inspect(kernel, signature(kernel), {"LOG": False, "BLOCK": block, "SLICES_POW2": 32}, warps)
        own_row = signature(sm._backward_own_row_kernel)
        for log in (False, True):
            inspect(sm._backward_own_row_kernel, own_row, {"LOG": log, "BLOCK": block, "SLICES_POW2": 32}, warps)
    for kernel, block, warps in ((sm._forward_cluster_kernel, 8192, 4), (sm._backward_cluster_kernel, 8192, 8)):
        cluster_sig = {**signature(kernel), "WORDS": "i32", "ROUNDS": "i32"}
        for log in (False, True):  # the cluster plans at 16 CTAs: registers (5 / 3 CTAs an SM), no fence in the loop
            inspect(kernel, cluster_sig, {"LOG": log, "BLOCK": block, "CLUSTER": 16, "CLUSTER_POW2": 16}, warps)
    for log in (False, True):  # the packed forward: the row's words held, no spill
        inspect(sm._forward_packed_kernel, signature(sm._forward_packed_kernel),
                {"LOG": log, "BF16": True, "BLOCK": 32768}, sm.FORWARD_PACKED[2]["num_warps"])
    for log in (False, True):  # the two-pass forward: its loads carry the eviction hints (LDG.E.EL / .EF)
        inspect(sm._forward_two_pass_kernel, signature(sm._forward_two_pass_kernel),
                {"LOG": log, "BLOCK": sm.FORWARD_TWO_PASS[log]["BLOCK"]}, sm.FORWARD_TWO_PASS[log]["num_warps"])
    for flags in (False, True):
        options = {"HAS_WEIGHT": flags, "SMOOTH": flags, "SOFTCAP": flags}
        inspect(ce._forward_kernel, signature(ce._forward_kernel),
                {**options, "BLOCK": ce.FORWARD_BLOCKS[flags]}, ce.FORWARD_WARPS)
        for block in ce.BACKWARD_BLOCKS[-1:] if flags else ce.BACKWARD_BLOCKS:  # heavy bodies: the smallest
            inspect(ce._backward_kernel, signature(ce._backward_kernel),
                    {**options, "MEAN": flags, "BLOCK": block}, ce.BACKWARD_WARPS)
    for rms in (True, False):
        flags = {"RMS": rms, "HAS_RESIDUAL": rms, "HAS_WEIGHT": True, "HAS_BIAS": not rms}
        for N in (1024, 4096, 8192, 16384, 32768):
            cfg = norm.forward_config(N, rms, residual=rms)
            if cfg["plan"] != "rows":
                continue
            inspect(norm._forward_rows_kernel, signature(norm._forward_rows_kernel),
                    {**flags, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]}, cfg["num_warps"])
        for N in (1024, 4096, 8192):
            cfg = norm.backward_config(N, rms)
            inspect(norm._backward_rows_kernel, signature(norm._backward_rows_kernel),
                    {"RMS": rms, "HAS_WEIGHT": True, "HAS_BIAS": not rms, "HAS_DH": rms, "BLOCK_M": cfg["BLOCK_M"],
                     "BLOCK_N": cfg["BLOCK_N"]}, cfg["num_warps"])
        for N in (1024, 4096, 8192, 24576, 32768):  # without the residual (with it, rows stay in registers)
            cfg = norm.forward_config(N, rms)
            if cfg["plan"] == "long":
                inspect(norm._forward_long_kernel, signature(norm._forward_long_kernel),
                        {**flags, "HAS_RESIDUAL": False, "BLOCK": cfg["BLOCK"], "ONE_CHUNK": cfg["BLOCK"] >= N},
                        cfg["num_warps"])
        split_cfg = norm.forward_config(262144, rms, residual=rms)
        inspect(norm._forward_split_kernel, signature(norm._forward_split_kernel),
                {**flags, "BLOCK": split_cfg["BLOCK"], "SLICES_POW2": 32}, split_cfg["num_warps"])
        for one_chunk in (True, False):
            inspect(norm._backward_chunks_kernel, signature(norm._backward_chunks_kernel),
                    {"RMS": rms, "HAS_WEIGHT": True, "HAS_BIAS": not rms, "HAS_DH": rms, "ONE_CHUNK": one_chunk,
                     "BLOCK": norm.BACKWARD_LONG["BLOCK"]}, norm.BACKWARD_LONG["num_warps"])
    blocks = norm.BACKWARD_BLOCKS["rms"]
    for dh in (False, True):
        inspect(norm._backward_blocks_kernel, signature(norm._backward_blocks_kernel),
                {"HAS_WEIGHT": True, "HAS_BIAS": dh, "HAS_DH": dh, "ROWS": blocks["ROWS"], "BLOCK": blocks["BLOCK"],
                 "SLICES_POW2": 16}, blocks["num_warps"])
    inspect(norm._sum_partials_kernel, signature(norm._sum_partials_kernel),
            {"HAS_WEIGHT": True, "HAS_BIAS": True, "PARTS_BLOCK": norm.SUM_PARTIALS["PARTS_BLOCK"], "BLOCK_N": 128}, 4)
    for interleaved in (False, True):
        inspect(rot._rotary_kernel, signature(rot._rotary_kernel),
                {"PAIRS": 64, "INTERLEAVED": interleaved, "TABLE_STEP": 1, "TABLE_SECOND": 64 if not interleaved else 1,
                 "HAS_POS": interleaved, "BACKWARD": interleaved, "COPY_REST": interleaved,
                 "BLOCK_H": rot.HEADS_PER_STEP, "BLOCK_S": rot.TILE_FEATURES // 128, "BLOCK_P": 64,
                 "BLOCK_REST": 64}, rot.NUM_WARPS)
    for flags in (False, True):  # linear_cross_entropy's chunk kernels, plain and with every option
        options = {"HAS_WEIGHT": flags, "SMOOTH": flags, "SOFTCAP": flags, "Z_RATIO": flags, "ALIGN": 1}
        for first, last in ((True, False), (False, True)):
            inspect(lce.fold_kernel, signature(lce.fold_kernel),
                    {**options, "FIRST": first, "LAST": last, "BLOCK": lce.FOLD_BLOCK}, lce.FOLD_WARPS)
        inspect(lce.gradient_kernel, signature(lce.gradient_kernel), {**options, "BLOCK": 2048},
                lce.GRADIENT_WARPS)
    for flags in (False, True):  # probability targets
        inspect(ce._forward_probs_kernel, signature(ce._forward_probs_kernel),
                {"HAS_WEIGHT": flags, "SOFTCAP": flags, "BLOCK": ce.FORWARD_BLOCKS[flags]}, ce.FORWARD_WARPS)
    for rms in (True, False):  # the norms' cluster plans at 8 CTAs
        inspect(norm._forward_cluster_kernel, signature(norm._forward_cluster_kernel),
                {"RMS": rms, "HAS_RESIDUAL": rms, "HAS_WEIGHT": True, "HAS_BIAS": not rms, "STATS": True,
                 "BLOCK": 8192, "CLUSTER": 8, "CLUSTER_POW2": 8, "BF16_HELD": rms, "AHEAD": rms}, 4)
        inspect(norm._backward_cluster_kernel, signature(norm._backward_cluster_kernel),
                {"RMS": rms, "HAS_WEIGHT": True, "HAS_BIAS": not rms, "HAS_DH": False, "BLOCK": 8192, "CLUSTER": 8,
                 "CLUSTER_POW2": 8, "AHEAD": rms}, 8)
    for flags in (False, True):  # log_probs and the distillation loss
        inspect(log_probs._forward_kernel, signature(log_probs._forward_kernel),
                {"SOFTCAP": flags, "ENTROPY": flags, "PARTIAL": False, "BLOCK": log_probs.FORWARD_BLOCK},
                log_probs.FORWARD_WARPS)
        inspect(log_probs._backward_kernel, signature(log_probs._backward_kernel),
                {"SOFTCAP": flags, "ENTROPY": flags, "BLOCK": log_probs.BACKWARD_BLOCK}, log_probs.BACKWARD_WARPS)
    for mode in (0, 1, 2):
        inspect(distillation._distillation_kernel, signature(distillation._distillation_kernel),
                {"HAS_TARGET": mode == 2, "MODE": mode, "GRADIENT": True, "BLOCK": distillation.BLOCK},
                distillation.WARPS)
    for activation in (0, 1, 2):  # the gated activations: SiLU, GELU (tanh), GELU (erf)
        for kernel in (gated._gated_forward_kernel, gated._gated_backward_kernel):
            inspect(kernel, signature(kernel), {"ACTIVATION": activation, "BLOCK": gated.BLOCK, "ALIGN": 1},
                    gated.NUM_WARPS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--digest", action="store_true", help="add a hash of each variant's SASS")
    DIGEST = parser.parse_args().digest
    main()
