"""Rotary position embeddings: a Triton kernel for forward and backward, autograd and
torch.library registration.

The rotation, as Hugging Face Llama-style models write it: out = x * cos + rotate(x) * sin,
over the first rotary_dim features of each head (the rest pass through). The features pair
up either half-split (GPT-NeoX / Llama: feature i with i + rotary_dim/2) or interleaved
(GPT-J: 2i with 2i + 1). For a pair (a, b) with table entries (c1, s1) at a's feature and
(c2, s2) at b's:
    forward:  a' = a c1 - b s1,   b' = b c2 + a s2
    backward: da = da' c1 + db' s2,   db = db' c2 - da' s1   (the transpose; with c1 = c2 and
              s1 = s2, as rotary tables are, the rotation by the opposite angle)
cos / sin tables hold rotary_dim columns (Hugging Face: each frequency twice) or
rotary_dim / 2 (one per pair); rows are positions, or per-token rows of shape
(batch, seq, width).

Bytes: read x, write the output; the table rows are read once per token for all heads.
"""

from .api import apply_rotary, rotary

__all__ = ['apply_rotary', 'rotary']
