"""Segment kernels: which keys a query row sees comes from runtime arrays, and which
blocks a tile visits from a plan that jax_fa4 computes before the launch
(jax_fa4/_segment_plan.py). Segment ids, lengths, varlen and any band with them all
reduce to this form.

Per batch b (int32, all written by jax_fa4):
    rows  (B, 3, Sq): for query row i, [key_begin, key_end) and its segment id: row i
          sees key j iff key_begin <= j < key_end and keys[j] == id (an empty range:
          the row sees nothing);
    keys  (B, 1, Sk): the segment id of key j;
    plan  per tile, entry 0 is the count c of blocks it visits, entries 1 .. c are
          (block << 10) | mask, mask one of NO_MASK (every row of the tile sees the
          whole block), RANGES (element masking by the rows' key ranges alone: the
          block's keys and the tile's rows that see any key all have one id), RUNS |
          (split << 2) (the block's keys are one run of ids up to its key `split` and
          one from there: by the rows' ranges cut to their id's run) or IDS (by the
          ranges and each key's id). Only IDS reads the keys' ids per element.
          Forward (B, query tiles, 1 + key blocks): key blocks from the last to the
          first (paged calls that append: from the first to the last). Backward (B,
          key blocks, 1 + 2 * query tiles): the query tiles in ascending order, as
          (tile << 10) | mask, and entry 1 + query tiles + i is the deterministic dQ
          turn of visit i (the number of key blocks above this one that visit the
          same query tile: they add in descending order, as the grid launches them).
Blocks left out of the plan are never loaded. Rows and keys past Sq / Sk are never read:
indices are clamped, and key_end <= Sk.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

KEY_BEGIN, KEY_END, SEGMENT = 0, 1, 2
# A plan entry's mask (the module docstring); jax_fa4/_segment_plan.py writes them.
NO_MASK, RANGES, RUNS, IDS = 0, 1, 2, 3
MASK_BITS = 10  # the mask and a RUNS block's split: blocks of at most 255 keys


class Views:
    """One CTA's views of its batch: rows (3, Sq), keys (Sk,), its tile's plan row, Sq,
    and (backward) the number of query tiles, where the plan row's turns start. The
    plan's count and first entry are read up front, together: the first loads of a
    CTA wait for both. `count` replaces the row's count for a row of `skip_visits`;
    `count` and `first` given (both read earlier elsewhere), nothing is read here."""

    def __init__(self, rows, keys, plan_row, seqlen_q, q_tiles=None, count=None,
                 first=None):
        self.rows, self.keys, self.plan_row = rows, keys, plan_row
        self.seqlen_q, self.q_tiles = seqlen_q, q_tiles
        # Every plan row has its count and at least one entry (Sk >= 1: one block).
        self.count = plan_row[0] if count is None else count
        self.first = plan_row[1] if first is None else first


@cute.jit
def skip_visits(plan_row: cute.Tensor, n: Int32) -> cute.Tensor:
    """The forward plan row seen from visit n on: its entry 1 + i is visit n + i (its
    entry 0 is no count: pass the count to Views). n <= the row's count."""
    return cute.make_tensor(plan_row.iterator + n, plan_row.layout)


@cute.jit
def decode(entry: Int32):
    """(block, mask) of a plan entry: mask is NO_MASK, RANGES or IDS, else a RUNS
    mask with its split (for mask_block's `runs`)."""
    return entry >> MASK_BITS, entry & ((1 << MASK_BITS) - 1)


@cute.jit
def visit(plan_row: cute.Tensor, i: Int32):
    """(block, mask) of visit i of a tile, from its plan row."""
    return decode(plan_row[1 + i])


@cute.jit
def mask_as_planned(masked: Int32, mask_with, runs_as_ids: cutlass.Constexpr = False):
    """mask_with(kind, runs) as the plan's mask of a block says (`decode`): nothing for
    NO_MASK. Where a branch may sit inside the step; the forward's step loops branch
    around whole steps instead (FwdSm90). `runs_as_ids`: RUNS blocks take the ids' mask,
    tested first (the backward: see BwdSm90._mask_kq)."""
    if cutlass.const_expr(runs_as_ids):
        if masked & IDS >= RUNS:  # the kind's two bits: RUNS (with its split) or IDS
            mask_with(IDS, None)
        elif masked != NO_MASK:
            mask_with(RANGES, None)
    else:
        if masked == IDS:
            mask_with(IDS, None)
        elif masked == RANGES:
            mask_with(RANGES, None)
        elif masked != NO_MASK:
            mask_with(RUNS, masked)


@cute.jit
def mask_block(
    s_rc: cute.Tensor,
    coord_rc: cute.Tensor,
    q0: Int32,
    key0: Int32,
    rows: cute.Tensor,
    keys: cute.Tensor,
    seqlen_q: Int32,
    seqlen_k: Int32,
    keys_along_rows: cutlass.Constexpr = False,
    kind: cutlass.Constexpr = IDS,
    runs=None,
):
    """Set invisible scores of one block to -inf. `coord_rc` holds each value's (row,
    col) inside the block; query rows start at q0 and keys at key0, keys along the
    block's columns, or along its rows for a transposed block S^T (`keys_along_rows`);
    `rows` is this batch's (3, Sq) view, `keys` its (Sk,) ids. `kind`: the plan's mask
    of the block (not NO_MASK). RUNS, with `runs` the plan's mask of the key block that
    starts at key0: each row's key range cut to its id's run (the block's keys before
    the split have its first id, the rest the id at the split)."""
    q_mode, k_mode = (1, 0) if keys_along_rows else (0, 1)
    n_k = cute.size(s_rc, mode=[k_mode])
    by_ids, by_runs = kind == IDS, kind == RUNS
    key_ids = None
    split, first_id, split_id = None, None, None
    if cutlass.const_expr(by_ids):
        key_ids = cute.make_rmem_tensor((n_k,), Int32)
        for j in cutlass.range_constexpr(n_k):
            first = (j, 0) if keys_along_rows else (0, j)
            key_ids[j] = keys[cutlass.min(key0 + coord_rc[first][k_mode], seqlen_k - 1)]
    if cutlass.const_expr(by_runs):
        split = runs >> 2
        first_id = keys[cutlass.min(key0, seqlen_k - 1)]
        split_id = keys[cutlass.min(key0 + split, seqlen_k - 1)]
    for t in cutlass.range_constexpr(cute.size(s_rc, mode=[q_mode])):
        first = (0, t) if keys_along_rows else (t, 0)
        row = cutlass.min(q0 + coord_rc[first][q_mode], seqlen_q - 1)
        begin = rows[KEY_BEGIN, row] - key0
        end = rows[KEY_END, row] - key0
        segment = rows[SEGMENT, row] if cutlass.const_expr(kind != RANGES) else None
        if cutlass.const_expr(by_runs):
            # The first run is [0, split), the second [split, ...); a row of another id
            # gets end <= begin: it sees nothing here.
            in_first = segment == first_id
            end = cutlass.select_(in_first, cutlass.min(end, split),
                                  cutlass.select_(segment == split_id, end, begin))
            begin = cutlass.select_(in_first, begin, cutlass.max(begin, split))
        for j in cutlass.range_constexpr(n_k):
            at = (j, t) if keys_along_rows else (t, j)
            key = coord_rc[at][k_mode]
            if cutlass.const_expr(by_ids):
                if key < begin or key >= end or key_ids[j] != segment:
                    s_rc[at] = -Float32.inf
            else:
                if key < begin or key >= end:
                    s_rc[at] = -Float32.inf
