"""Rotary's half-split pairs from whole rows (session 36). The library loads a head tile's two
halves (features 0-63 and 64-127 of each token) as two loads of 128-byte pieces at a 256-byte
stride, and stores them so. Here each token's row is one contiguous load and store, and each
feature's partner (f xor 64) comes from the same registers by an xor reduction over the
halves' axis (y ^ xor_sum(y) over two values is the other one), a shuffle in the warp:
    forward:  out_f = x_f cos_f + x_partner(f) sign_f sin_f,          sign -1 on the first half
    backward: dx_f = g_f cos_f + g_partner(f) sign_f sin_partner(f),  sign +1 on the first half
It prints, on the bench's shape (q (8, 32, 4096, 128), k (8, 8, 4096, 128), bhsd, bf16, fp32
tables), the copy ceiling of both access patterns on the library's grid, then the library's
rotary and this form, forward and backward, as fractions of the copy bandwidth.

    python scripts/exp_rotary_partner.py
"""

import importlib

import torch
import triton
import triton.language as tl
from measure import copy_bandwidth, rotary_inputs, time_ms

rot = importlib.import_module("pintail.rotary")


@triton.jit
def _partner(x, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr):
    """Each feature's partner f xor BLOCK_P of an integer tile [BLOCK_H, BLOCK_S, 2 BLOCK_P]."""
    halves = tl.reshape(x, (BLOCK_H, BLOCK_S, 2, BLOCK_P))
    return tl.reshape(halves ^ tl.xor_sum(halves, 2, keep_dims=True), (BLOCK_H, BLOCK_S, 2 * BLOCK_P))


@triton.jit
def _copy_heads(x_ptr, out_ptr, b, tokens, S, H, WHOLE: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr):
    for h0 in range(0, H, BLOCK_H):
        heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        rows = ((b * H + heads[:, None, None]) * S + tokens[None, :, None]) * (2 * BLOCK_P)
        if WHOLE:
            feats = tl.arange(0, 2 * BLOCK_P)[None, None, :]
            tl.store(out_ptr + rows + feats, tl.load(x_ptr + rows + feats))
        else:
            pair = tl.arange(0, BLOCK_P)[None, None, :]
            a = tl.load(x_ptr + rows + pair)
            z = tl.load(x_ptr + rows + BLOCK_P + pair)
            tl.store(out_ptr + rows + pair, a)
            tl.store(out_ptr + rows + BLOCK_P + pair, z)


@triton.jit
def _copy_kernel(q_ptr, q_out_ptr, k_ptr, k_out_ptr, S, HQ, HK, WHOLE: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr):
    # the library's grid and loop, the rotation left out: whole rows, or two halves a row
    blocks = tl.cdiv(S, BLOCK_S)
    b = (tl.program_id(0) // blocks).to(tl.int64)
    tokens = ((tl.program_id(0) % blocks) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    _copy_heads(q_ptr, q_out_ptr, b, tokens, S, HQ, WHOLE, BLOCK_H, BLOCK_S, BLOCK_P)
    _copy_heads(k_ptr, k_out_ptr, b, tokens, S, HK, WHOLE, BLOCK_H, BLOCK_S, BLOCK_P)


@triton.jit
def _rotary_whole_rows_kernel(q_ptr, q_out_ptr, k_ptr, k_out_ptr, cos_ptr, sin_ptr, S, HQ, HK,
                              BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                              BLOCK_P: tl.constexpr):
    # contiguous q / k of (B, H, S, 2 BLOCK_P), full-width tables (S, 2 BLOCK_P): the bench's case
    blocks = tl.cdiv(S, BLOCK_S)
    b = (tl.program_id(0) // blocks).to(tl.int64)
    tokens = ((tl.program_id(0) % blocks) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    feats = tl.arange(0, 2 * BLOCK_P)
    at = tokens[:, None] * (2 * BLOCK_P) + feats[None, :]
    c = tl.load(cos_ptr + at)[None, :, :]
    s = tl.load(sin_ptr + at)[None, :, :]
    first = (feats < BLOCK_P)[None, None, :]
    if BACKWARD:  # sin at the partner's feature, once a program
        s = _partner(s.to(tl.int32, bitcast=True), 1, BLOCK_S, BLOCK_P).to(tl.float32, bitcast=True)
        s = tl.where(first, s, -s)
    else:
        s = tl.where(first, -s, s)
    _rotate_heads(q_ptr, q_out_ptr, b, tokens, c, s, S, HQ, BLOCK_H, BLOCK_S, BLOCK_P)
    _rotate_heads(k_ptr, k_out_ptr, b, tokens, c, s, S, HK, BLOCK_H, BLOCK_S, BLOCK_P)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, b, tokens, c, s, S, H, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    feats = tl.arange(0, 2 * BLOCK_P)[None, None, :]
    for h0 in range(0, H, BLOCK_H):
        heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        rows = ((b * H + heads[:, None, None]) * S + tokens[None, :, None]) * (2 * BLOCK_P)
        x = tl.load(x_ptr + rows + feats)
        partner = _partner(x.to(tl.int16, bitcast=True), BLOCK_H, BLOCK_S, BLOCK_P)
        out = x.to(tl.float32) * c + partner.to(tl.bfloat16, bitcast=True).to(tl.float32) * s
        tl.store(out_ptr + rows + feats, out.to(out_ptr.dtype.element_ty))


def main():
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    q, k, cos, sin = rotary_inputs()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    nbytes = 2 * 2 * (q.numel() + k.numel())
    frac = lambda fn: nbytes / (time_ms(fn) * 1e-3) / copy_bw
    for tile, heads, warps in ((2048, 2, 4), (2048, 1, 4), (2048, 2, 8), (4096, 2, 8), (1024, 2, 4)):
        block_s = tile // 128
        grid = (8 * 4096 // block_s,)
        for whole in (False, True):
            fn = lambda: _copy_kernel[grid](q, q_out, k, k_out, 4096, 32, 8, WHOLE=whole, BLOCK_H=heads,
                                            BLOCK_S=block_s, BLOCK_P=64, num_warps=warps)
            print(f"copy {'whole rows' if whole else 'two halves'} tile={tile} heads={heads} warps={warps}: "
                  f"{frac(fn):.3f}", flush=True)
        for backward in (False, True):
            fn = lambda: _rotary_whole_rows_kernel[grid](q, q_out, k, k_out, cos, sin, 4096, 32, 8, BACKWARD=backward,
                                                         BLOCK_H=heads, BLOCK_S=block_s, BLOCK_P=64, num_warps=warps)
            fn()
            want = [rot.reference.rotary(t, cos, sin, None, 2, 0, 128, False, backward) for t in (q, k)]
            err = max((o.float() - w.float()).abs().max().item() for o, w in zip((q_out, k_out), want))
            print(f"{'bwd' if backward else 'fwd'} whole rows tile={tile} heads={heads} warps={warps}: "
                  f"{frac(fn):.3f} (max error {err:.1e})", flush=True)
    for backward in (False, True):
        fn = lambda: rot._launch([(q, q_out), (k, k_out)], cos, sin, None, 2, 0, 128, False, backward)
        print(f"{'bwd' if backward else 'fwd'} library: {frac(fn):.3f}", flush=True)


if __name__ == "__main__":
    main()
