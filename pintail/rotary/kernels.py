"""The rotary Triton kernels: what each reads and writes is in its comments."""

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, out_ptr, H, stride_b, stride_s, stride_h, out_stride_b, out_stride_s, out_stride_h,
                  b, tokens, token_mask, c1, c2, s1, s2, D, PAIRS: tl.constexpr, INTERLEAVED: tl.constexpr,
                  BACKWARD: tl.constexpr, COPY_REST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_REST: tl.constexpr):
    """Every head of one tensor for the program's tokens, BLOCK_H heads at a time: a
    [heads, tokens, pairs] tile; the table tiles [tokens, pairs] broadcast over the heads."""
    pair = tl.arange(0, BLOCK_P)[None, None, :]
    feats = tl.arange(0, 2 * BLOCK_P)[None, None, :]  # interleaved: the pairs side by side, one load
    rest = 2 * PAIRS + tl.arange(0, BLOCK_REST)[None, None, :]
    token_rows = b * stride_b + tokens[None, :, None] * stride_s
    out_token_rows = b * out_stride_b + tokens[None, :, None] * out_stride_s
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        rows_mask = (heads < H)[:, None, None] & token_mask[None, :, None]
        heads = heads.to(tl.int64)[:, None, None]
        x_head = x_ptr + token_rows + heads * stride_h
        o_head = out_ptr + out_token_rows + heads * out_stride_h
        if INTERLEAVED:  # features (2i, 2i + 1): split in registers, not two stride-2 loads
            mask = rows_mask & (feats < 2 * PAIRS)
            both = tl.load(x_head + feats, mask=mask, other=0.0).to(tl.float32)
            a, z = tl.split(tl.reshape(both, (BLOCK_H, BLOCK_S, BLOCK_P, 2)))
        else:  # features (i, i + PAIRS): two contiguous halves
            mask = rows_mask & (pair < PAIRS)
            a = tl.load(x_head + pair, mask=mask, other=0.0).to(tl.float32)
            z = tl.load(x_head + PAIRS + pair, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            new_a = a * c1 + z * s2
            new_z = z * c2 - a * s1
        else:
            new_a = a * c1 - z * s1
            new_z = z * c2 + a * s2
        if INTERLEAVED:
            both = tl.reshape(tl.join(new_a, new_z), (BLOCK_H, BLOCK_S, 2 * BLOCK_P))
            tl.store(o_head + feats, both.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(o_head + pair, new_a.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(o_head + PAIRS + pair, new_z.to(out_ptr.dtype.element_ty), mask=mask)
        if COPY_REST:  # features past rotary_dim pass through
            rest_mask = rows_mask & (rest < D)
            tl.store(o_head + rest, tl.load(x_head + rest, mask=rest_mask), mask=rest_mask)


@triton.jit
def _rotary_kernel(q_ptr, q_out_ptr, k_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr, S, HQ, HK, D, seq_offset,
                   table_rows, q_stride_b, q_stride_s, q_stride_h, q_out_stride_b, q_out_stride_s, q_out_stride_h,
                   k_stride_b, k_stride_s, k_stride_h, k_out_stride_b, k_out_stride_s, k_out_stride_h,
                   table_stride_b, table_stride_row, pos_stride_b, pos_stride_s,
                   PAIRS: tl.constexpr, INTERLEAVED: tl.constexpr,
                   TABLE_STEP: tl.constexpr, TABLE_SECOND: tl.constexpr,
                   HAS_POS: tl.constexpr, BACKWARD: tl.constexpr, COPY_REST: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_REST: tl.constexpr):
    # BLOCK_S tokens of one sequence: their table rows once, then every head of q and of k
    # (HK = 0: q only). A head's tile is BLOCK_S rows of contiguous features, whichever the
    # layout.
    blocks = tl.cdiv(S, BLOCK_S)
    b = (tl.program_id(0) // blocks).to(tl.int64)
    tokens = (tl.program_id(0) % blocks) * BLOCK_S + tl.arange(0, BLOCK_S)
    token_mask = tokens < S
    tokens = tokens.to(tl.int64)
    if HAS_POS:
        positions = tl.load(pos_ptr + b * pos_stride_b + tokens * pos_stride_s, mask=token_mask, other=0).to(tl.int64)
    else:
        positions = tokens + seq_offset
    in_table = (positions >= 0) & (positions < table_rows)  # outside: NaN out, never a wild read
    pair = tl.arange(0, BLOCK_P)
    # the table entries of each pair's first and second feature (cos and sin share strides)
    at1 = b * table_stride_b + positions[:, None] * table_stride_row + pair[None, :] * TABLE_STEP
    at2 = at1 + TABLE_SECOND
    table_mask = (token_mask & in_table)[:, None] & (pair < PAIRS)[None, :]
    c1 = tl.load(cos_ptr + at1, mask=table_mask, other=float("nan")).to(tl.float32)[None, :, :]
    c2 = tl.load(cos_ptr + at2, mask=table_mask, other=float("nan")).to(tl.float32)[None, :, :]
    s1 = tl.load(sin_ptr + at1, mask=table_mask, other=float("nan")).to(tl.float32)[None, :, :]
    s2 = tl.load(sin_ptr + at2, mask=table_mask, other=float("nan")).to(tl.float32)[None, :, :]
    _rotate_heads(q_ptr, q_out_ptr, HQ, q_stride_b, q_stride_s, q_stride_h, q_out_stride_b, q_out_stride_s,
                  q_out_stride_h, b, tokens, token_mask, c1, c2, s1, s2, D, PAIRS, INTERLEAVED, BACKWARD, COPY_REST,
                  BLOCK_H, BLOCK_S, BLOCK_P, BLOCK_REST)
    _rotate_heads(k_ptr, k_out_ptr, HK, k_stride_b, k_stride_s, k_stride_h, k_out_stride_b, k_out_stride_s,
                  k_out_stride_h, b, tokens, token_mask, c1, c2, s1, s2, D, PAIRS, INTERLEAVED, BACKWARD, COPY_REST,
                  BLOCK_H, BLOCK_S, BLOCK_P, BLOCK_REST)
