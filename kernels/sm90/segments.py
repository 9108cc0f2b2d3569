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
          (block << 1) | masked, masked meaning the block needs element masking.
          Forward (B, query tiles, 1 + key blocks): key blocks from the last to the
          first. Backward (B, key blocks, 1 + 2 * query tiles): query tiles in ascending
          order, and entry 1 + query tiles + i is the deterministic dQ turn of visit i
          (the number of key blocks above this one that visit the same query tile: they
          add in descending order, as the grid launches them).
Blocks left out of the plan are never loaded. Rows and keys past Sq / Sk are never read:
indices are clamped, and key_end <= Sk.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

KEY_BEGIN, KEY_END, SEGMENT = 0, 1, 2


class Views:
    """One CTA's views of its batch: rows (3, Sq), keys (Sk,), its tile's plan row, Sq,
    and (backward) the number of query tiles, where the plan row's turns start."""

    def __init__(self, rows, keys, plan_row, seqlen_q, q_tiles=None):
        self.rows, self.keys, self.plan_row = rows, keys, plan_row
        self.seqlen_q, self.q_tiles = seqlen_q, q_tiles


@cute.jit
def visit(plan_row: cute.Tensor, i: Int32):
    """(block, masked) of visit i of a tile, from its plan row."""
    entry = plan_row[1 + i]
    return entry >> 1, entry & 1


@cute.jit
def mask_block(
    s_rc: cute.Tensor,
    coord_rc: cute.Tensor,
    row0: Int32,
    col0: Int32,
    rows: cute.Tensor,
    keys: cute.Tensor,
    seqlen_q: Int32,
    seqlen_k: Int32,
):
    """Set invisible scores of one (query rows, keys) block to -inf. `coord_rc` holds
    each value's (row, col) inside the block, `row0`, `col0` place it; `rows` is this
    batch's (3, Sq) view, `keys` its (Sk,) ids."""
    n_rows = cute.size(s_rc, mode=[0])
    n_cols = cute.size(s_rc, mode=[1])
    col_ids = cute.make_rmem_tensor((n_cols,), Int32)
    for c in cutlass.range_constexpr(n_cols):
        col_ids[c] = keys[cutlass.min(col0 + coord_rc[0, c][1], seqlen_k - 1)]
    for r in cutlass.range_constexpr(n_rows):
        row = cutlass.min(row0 + coord_rc[r, 0][0], seqlen_q - 1)
        begin = rows[KEY_BEGIN, row] - col0
        end = rows[KEY_END, row] - col0
        segment = rows[SEGMENT, row]
        for c in cutlass.range_constexpr(n_cols):
            col = coord_rc[r, c][1]
            if col < begin or col >= end or col_ids[c] != segment:
                s_rc[r, c] = -Float32.inf


@cute.jit
def mask_block_kq(
    s_rc: cute.Tensor,
    coord_rc: cute.Tensor,
    key0: Int32,
    q0: Int32,
    rows: cute.Tensor,
    keys: cute.Tensor,
    seqlen_q: Int32,
    seqlen_k: Int32,
):
    """mask_block for a transposed block S^T: rows are keys (from key0), columns are
    query rows (from q0)."""
    n_rows = cute.size(s_rc, mode=[0])
    n_cols = cute.size(s_rc, mode=[1])
    key_ids = cute.make_rmem_tensor((n_rows,), Int32)
    for r in cutlass.range_constexpr(n_rows):
        key_ids[r] = keys[cutlass.min(key0 + coord_rc[r, 0][0], seqlen_k - 1)]
    for c in cutlass.range_constexpr(n_cols):
        row = cutlass.min(q0 + coord_rc[0, c][1], seqlen_q - 1)
        begin = rows[KEY_BEGIN, row] - key0
        end = rows[KEY_END, row] - key0
        segment = rows[SEGMENT, row]
        for r in cutlass.range_constexpr(n_rows):
            key = coord_rc[r, c][0]
            if key < begin or key >= end or key_ids[r] != segment:
                s_rc[r, c] = -Float32.inf
