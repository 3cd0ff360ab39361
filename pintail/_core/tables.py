"""The entries of the launch tables in each op's plans.py: which rows an entry covers and
how they launch. Named tuples, so that a table reads as rows and unpacks as tuples."""

from typing import NamedTuple


class Span(NamedTuple):
    """A launch config for rows of low < N <= high."""
    low: int
    high: int
    config: dict


class UpTo(NamedTuple):
    """A launch config for rows of up to `limit` elements (a table's limits ascend)."""
    limit: float
    config: dict


class Tiles(NamedTuple):
    """Rows of up to `limit` elements in tiles of at least `tile` elements (whole rows), at
    `warps`, `per_sm` persistent programs an SM."""
    limit: float
    tile: int
    warps: int
    per_sm: int


class Slices(NamedTuple):
    """Rows of up to `limit` elements cut in slices of `block`, at `warps`, `per_sm`
    persistent programs an SM."""
    limit: float
    block: int
    warps: int
    per_sm: int
