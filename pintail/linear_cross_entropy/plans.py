"""Plans of linear_cross_entropy, and which one a call takes within its memory budget:

- logits: the whole (M, V) logits kept from the forward to the backward (eager only);
  three GEMMs at full size.
- tokens: m rows at a time over the whole vocabulary, the gradients made in the forward
  (tokens.py); three GEMMs, m rows wide. Needs a float32 V x K sum of dW unless the head's
  weight is float32 (then that sum is its gradient), and reduction "mean" or "sum".
- vocabulary: chunks of classes for every row, the logits made again in the backward
  (api.py); four GEMMs, the smallest workspace.
`choose` takes the first that the budget holds, in that order: by GEMM count, and among
three-GEMM plans the one with the widest GEMMs. Without a budget: the token chunks, or the
kept logits where those are no larger than the token chunks' workspace (a 16-bit head whose
float32 dW sum is as large as the logits: Llama-3-8B's at 8192 tokens; on an H200 1.04x
the GEMMs against 1.24x, docs/design.md).
"""

import dataclasses

from .._loss.plans import buffer_columns

NAME = "pintail.linear_cross_entropy"

# The vocabulary chunks' default workspace holds about 1/32 of the logits (a goal of 3 % of the
# bf16 logits), in chunks no narrower than MIN_CHUNK_COLUMNS.
DEFAULT_LOGITS_FRACTION = 32
# Chunk widths are whole multiples of this (GEMM tiles of 128 or 256 columns), and the
# narrowest chunk a budget may ask for.
CHUNK_MULTIPLE = 256
MIN_CHUNK_COLUMNS = 256


def default_budget(M: int, V: int, K: int, element_size: int, accumulates: bool) -> int:
    """Bytes of workspace by default: a chunk of about V / DEFAULT_LOGITS_FRACTION columns
    (MIN_CHUNK_COLUMNS at least), and the float32 accumulator of dx where one is needed."""
    columns = max(MIN_CHUNK_COLUMNS, V // DEFAULT_LOGITS_FRACTION)
    return M * buffer_columns(columns) * element_size + accumulator_bytes(M, K, accumulates)


def accumulator_bytes(M: int, K: int, accumulates: bool) -> int:
    """The float32 (M, K) sum of dx over the chunks, kept where dx is 16-bit and chunked."""
    return M * K * 4 if accumulates else 0


def minimum_budget(M: int, V: int, K: int, element_size: int, accumulates: bool) -> int:
    """The smallest budget a call can keep to: one chunk of the whole vocabulary where it
    is narrow, else the narrowest chunk and the accumulator."""
    whole = M * buffer_columns(V) * element_size
    narrow = M * buffer_columns(MIN_CHUNK_COLUMNS) * element_size + accumulator_bytes(M, K, accumulates)
    return min(whole, narrow)


def chunk_columns(M: int, V: int, K: int, element_size: int, budget: int | None, accumulates: bool) -> int:
    """The widest chunk of vocabulary columns whose workspace fits the budget (default:
    default_budget): V where the whole logits fit (one chunk: no accumulator), else a
    multiple of CHUNK_MULTIPLE. `accumulates`: dx is 16-bit and wanted. The caller checks
    the budget against minimum_budget first."""
    if budget is None:
        budget = default_budget(M, V, K, element_size, accumulates)
    if M * buffer_columns(V) * element_size <= budget:
        return V
    room = budget - accumulator_bytes(M, K, accumulates)
    columns = room // max(M * element_size, 1) // CHUNK_MULTIPLE * CHUNK_MULTIPLE
    return min(max(columns, MIN_CHUNK_COLUMNS), V)


def keeps_logits(M: int, V: int, element_size: int, budget: int | None) -> bool:
    """Whether a budget holds the whole logits (rows padded as buffer_columns), which the
    forward then keeps for the backward (three GEMMs instead of four)."""
    return budget is not None and M * buffer_columns(V) * element_size <= budget


# Token chunks: rows a chunk by default (the dW sum's re-reads, 8 V K bytes a chunk, stay
# small beside the chunk's 6 m V K GEMM FLOPs from about 1000 rows), and the fewest rows
# a budget may ask for.
TOKEN_ROWS = 1024
MIN_TOKEN_ROWS = 64


@dataclasses.dataclass(frozen=True)
class Plan:
    kind: str   # "logits", "tokens" or "vocabulary"
    width: int  # rows a chunk (tokens), classes a chunk (vocabulary), V (logits)


def token_workspace(rows: int, M: int, V: int, K: int, element_size: int, sums_dx: bool, sums_dW: bool) -> int:
    """Bytes the token-chunk plan holds beyond the gradients: a chunk's logits, the float32
    dx where dx is 16-bit, the float32 sum of dW where the head's weight is 16-bit."""
    return rows * buffer_columns(V) * element_size + (M * K * 4 if sums_dx else 0) + (V * K * 4 if sums_dW else 0)


def choose(M: int, V: int, K: int, element_size: int, budget: int | None, *, gradients: bool, uniform_rows: bool,
           can_keep: bool, sums_dx: bool, sums_dW: bool) -> Plan:
    """The plan a call takes. gradients: some gradient is wanted; uniform_rows: the row
    losses' gradients are one value (reduction "mean" or "sum"); can_keep: the logits may be
    kept across forward and backward (eager); sums_dx / sums_dW: dx is 16-bit / the head's
    weight is 16-bit and its gradient wanted. budget None: where the token-chunk plan serves,
    the kept logits if they are no larger than its workspace (eager), else token chunks of
    TOKEN_ROWS rows; else vocabulary chunks of the default width."""
    if gradients and can_keep and keeps_logits(M, V, element_size, budget):
        return Plan("logits", V)
    if gradients and uniform_rows and M > 0:
        if budget is None:
            rows = min(M, TOKEN_ROWS)
            if can_keep and M * buffer_columns(V) * element_size <= token_workspace(rows, M, V, K, element_size,
                                                                                    sums_dx, sums_dW):
                return Plan("logits", V)  # faster (three full GEMMs) and no larger
            return Plan("tokens", rows)
        fixed = token_workspace(0, M, V, K, element_size, sums_dx, sums_dW)
        rows = (budget - fixed) // max(buffer_columns(V) * element_size, 1)
        if rows >= min(M, MIN_TOKEN_ROWS):
            return Plan("tokens", min(M, rows))
    return Plan("vocabulary", chunk_columns(M, V, K, element_size, budget, sums_dx and gradients))
