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
          (block << 2) | mask, mask one of NO_MASK (every row of the tile sees the
          whole block), RANGES (element masking by the rows' key ranges alone: the
          block's keys and the tile's rows that see any key all have one id) or IDS
          (by the ranges and each key's id).
          Forward (B, query tiles, 1 + key blocks): key blocks from the last to the
          first (paged calls that append: from the first to the last). Backward (B,
          key blocks, 1 + 2 * query tiles): the query tiles in ascending order, as
          (tile << 2) | mask, and entry 1 + query tiles + i is the deterministic dQ
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
NO_MASK, RANGES, IDS = 0, 1, 3


class Views:
    """One CTA's views of its batch: rows (3, Sq), keys (Sk,), its tile's plan row, Sq,
    and (backward) the number of query tiles, where the plan row's turns start. The
    plan's count and first entry are read up front, together: the first loads of a
    CTA wait for both. `count` replaces the row's count for a row of `skip_visits`."""

    def __init__(self, rows, keys, plan_row, seqlen_q, q_tiles=None, count=None):
        self.rows, self.keys, self.plan_row = rows, keys, plan_row
        self.seqlen_q, self.q_tiles = seqlen_q, q_tiles
        # Every plan row has its count and at least one entry (Sk >= 1: one block).
        self.count = plan_row[0] if count is None else count
        self.first = plan_row[1]


@cute.jit
def skip_visits(plan_row: cute.Tensor, n: Int32) -> cute.Tensor:
    """The forward plan row seen from visit n on: its entry 1 + i is visit n + i (its
    entry 0 is no count: pass the count to Views). n <= the row's count."""
    return cute.make_tensor(plan_row.iterator + n, plan_row.layout)


@cute.jit
def decode(entry: Int32):
    """(block, mask) of a plan entry; mask != NO_MASK where the block needs masking."""
    return entry >> 2, entry & 3


@cute.jit
def visit(plan_row: cute.Tensor, i: Int32):
    """(block, mask) of visit i of a tile, from its plan row."""
    return decode(plan_row[1 + i])


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
    check_ids: cutlass.Constexpr = True,
):
    """Set invisible scores of one block to -inf. `coord_rc` holds each value's (row,
    col) inside the block; query rows start at q0 and keys at key0, keys along the
    block's columns, or along its rows for a transposed block S^T (`keys_along_rows`);
    `rows` is this batch's (3, Sq) view, `keys` its (Sk,) ids. Without `check_ids`
    (blocks the plan flags RANGES) the key ranges alone: the keys' ids are not read."""
    q_mode, k_mode = (1, 0) if keys_along_rows else (0, 1)
    n_k = cute.size(s_rc, mode=[k_mode])
    key_ids = None
    if cutlass.const_expr(check_ids):
        key_ids = cute.make_rmem_tensor((n_k,), Int32)
        for j in cutlass.range_constexpr(n_k):
            first = (j, 0) if keys_along_rows else (0, j)
            key_ids[j] = keys[cutlass.min(key0 + coord_rc[first][k_mode], seqlen_k - 1)]
    for t in cutlass.range_constexpr(cute.size(s_rc, mode=[q_mode])):
        first = (0, t) if keys_along_rows else (t, 0)
        row = cutlass.min(q0 + coord_rc[first][q_mode], seqlen_q - 1)
        begin = rows[KEY_BEGIN, row] - key0
        end = rows[KEY_END, row] - key0
        segment = rows[SEGMENT, row] if cutlass.const_expr(check_ids) else None
        for j in cutlass.range_constexpr(n_k):
            at = (j, t) if keys_along_rows else (t, j)
            key = coord_rc[at][k_mode]
            if cutlass.const_expr(check_ids):
                if key < begin or key >= end or key_ids[j] != segment:
                    s_rc[at] = -Float32.inf
            else:
                if key < begin or key >= end:
                    s_rc[at] = -Float32.inf
