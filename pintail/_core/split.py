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

The own-row variant (softmax backward) has no lag: a program keeps its ticket's slice in
registers, waits for the other slices of that same row, and writes the slice's output
from registers (no L2 re-read). Before it waits it takes its next ticket, loads that slice
and publishes its partials, so every ticket a running program holds is published without
waiting on anything. A wait can then only stall on tickets nobody has taken yet; tickets
are taken in order, so that needs every running program's two tickets inside the row
waited on: impossible while more programs run than half a row's slices (the plans keep
slices <= 64; a GPU runs at least one program per SM). Programs not yet running (the SMs
busy with another kernel) only delay the row until they start. The interpreter runs one
program at a time, which can only wait on slices it took itself: there rows are cut into
at most two slices.
slots: [next ticket, one word per (row, slice), a spare word for tickets past the end].
"""

import torch
import triton
import triton.language as tl

from .launch import INTERPRET, cdiv, next_power_of_2, program_slots


@triton.jit
def publish(slots_ptr, ticket, hi, lo):
    """Publish two float32 as one 64-bit word: the word is its own arrival flag (never 0
    once written: see the callers), so no fence orders it against anything else."""
    word = (hi.to(tl.int32, bitcast=True).to(tl.int64) << 32) | \
        (lo.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    tl.atomic_xchg(slots_ptr + 1 + ticket, word, sem="relaxed")


@triton.jit
def publish_own(slots_ptr, ticket, end, partial):
    """Own-row plan: publish (1.0, partial) for `ticket`; tickets past the end (a program's
    last, empty one) write the spare word after the rows'. 1.0: the word is never 0."""
    publish(slots_ptr, tl.minimum(ticket, end), tl.full((), 1.0, tl.float32), partial)


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
def take_ticket(slots_ptr):
    """The next ticket (slots[0] counts them)."""
    return tl.atomic_add(slots_ptr, 1, sem="relaxed")


@triton.jit
def ticket_slice(ticket, M, N, SLICES, BLOCK: tl.constexpr):
    """Ticket t's slice: row t // SLICES, the columns of slice t % SLICES, and which of them
    are in one of the M rows of N."""
    row = ticket // SLICES
    cols = (ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
    return row, cols, (cols < N) & (row < M)


@triton.jit
def ticket_work(ticket, M, N, SLICES, LAG, BLOCK: tl.constexpr):
    """Ticket t: read its slice (ticket_slice), write that slice of the row LAG before
    (`done`; negative: nothing to write yet). Returns both rows, the slice's columns and the
    masks of the read (`new`) and of the write (`old`)."""
    row = ticket // SLICES
    done = row - LAG
    cols = (ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
    # not through ticket_slice: its order of these steps compiles the split kernels differently
    return row, done, cols, (cols < N) & (row < M), (cols < N) & (done >= 0)


def split_plan(M, N, cfg, device):
    """Slices per row, the lag in rows (at least one: a row is never written by its own
    readers), the persistent grid, and the zeroed slots: [next ticket, a word per slice]."""
    slices = cdiv(N, cfg["BLOCK"])
    programs = program_slots(device, cfg["PROGRAMS_PER_SM"])
    lag = max(1, min(M, int(cfg["LAG_ROUNDS"] * programs) // slices))
    grid = min((M + lag) * slices, programs)
    return slices, lag, (grid,), torch.zeros(1 + M * slices, dtype=torch.int64, device=device)


def own_row_plan(M, N, cfg, device):
    """Slice length, slices per row (at most two in the interpreter: see above), the
    persistent grid and the zeroed slots of the own-row plan."""
    block = cfg["BLOCK"] if not INTERPRET else max(cfg["BLOCK"], next_power_of_2(cdiv(N, 2)))
    slices = cdiv(N, block)
    grid = min(M * slices, program_slots(device, cfg["PROGRAMS_PER_SM"]))
    return block, slices, (grid,), torch.zeros(2 + M * slices, dtype=torch.int64, device=device)
