"""Rows too long for one program, cut into slices of BLOCK elements: the machinery that
softmax's and the norms' split plans share.

Each program does two jobs per ticket, `lag` rows apart:
    read:  slice s of row r from HBM; publish the slice's partial statistics (two float32
           in one 64-bit word, which is its own arrival flag);
    write: slice s of row r - lag; wait until every slice of that row has published,
           combine the partials, re-read the slice (from L2: it was read from HBM only
           `lag` rows ago) and write the output.
Programs take their work from a ticket counter (an atomic at entry), not from program_id,
so a program only ever waits for work whose ticket is smaller, taken by a program already
running that itself never waits on larger tickets: no deadlock, whatever the dispatch
order or how many programs fit on the GPU (the idea of the decoupled look-back in
single-pass prefix scans). In the interpreter, programs run one after another in ticket
order, so every wait is over before it starts. HBM traffic: the input read once, the
output written once; the lag keeps waits rare (more tickets than programs in flight) while
the lagged rows still fit in L2.

slots: [next ticket, one word per (row, slice)], zeroed before the launch.
"""

import torch
import triton
import triton.language as tl

from ._launch import cdiv, program_slots


@triton.jit
def publish(slots_ptr, ticket, hi, lo):
    """Publish two float32 as one 64-bit word: the word is its own arrival flag (never 0
    once written: see the callers), so no fence orders it against anything else."""
    word = (hi.to(tl.int32, bitcast=True).to(tl.int64) << 32) | \
        (lo.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    tl.atomic_xchg(slots_ptr + 1 + ticket, word, sem="relaxed")


@triton.jit
def wait_for_row(slots_ptr, row, SLICES, SLICES_POW2: tl.constexpr):
    """The published words of all slices of `row`, once every one is there, unpacked."""
    k = tl.arange(0, SLICES_POW2)
    ptrs = slots_ptr + 1 + row * SLICES + k
    words = tl.load(ptrs, mask=k < SLICES, other=1, volatile=True)
    while tl.sum((words == 0).to(tl.int32), axis=0) > 0:
        words = tl.load(ptrs, mask=k < SLICES, other=1, volatile=True)
    hi = (words >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    lo = words.to(tl.int32).to(tl.float32, bitcast=True)
    return hi, lo, k < SLICES


@triton.jit
def ticket_work(ticket, SLICES, LAG, BLOCK: tl.constexpr):
    """Ticket t: read slice t % SLICES of row t // SLICES, write that slice of the row LAG
    before (`done`; negative: nothing to write yet)."""
    row = ticket // SLICES
    return row, row - LAG, (ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)


def split_plan(M, N, cfg, device):
    """Slices per row, the lag in rows (at least one: a row is never written by its own
    readers), the persistent grid, and the zeroed slots: [next ticket, a word per slice]."""
    slices = cdiv(N, cfg["BLOCK"])
    programs = program_slots(device, cfg["PROGRAMS_PER_SM"])
    lag = max(1, min(M, int(cfg["LAG_ROUNDS"] * programs) // slices))
    grid = min((M + lag) * slices, programs)
    return slices, lag, (grid,), torch.zeros(1 + M * slices, dtype=torch.int64, device=device)
