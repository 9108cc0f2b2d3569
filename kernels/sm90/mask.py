"""Which key blocks a query tile visits, and which elements inside a block are visible.

Visibility of key column j from query row i: j < Sk and, in a banded kernel (`banded`
in kernels/config.py),

    lo <= j - i <= hi

with lo, hi runtime int32 (ffi: the alignment offset, Sk - Sq for bottom-right or 0
for top-left, minus / plus the window sides; causal is hi = offset; an unbounded side
is -BAND_LIMIT / BAND_LIMIT). Rows beyond Sq are never masked: their LSE2 is +inf in the
backward and the forward does not store them.

Key blocks are visited from the last to the first: the blocks that need element
masking at the band's right edge (and the Sk tail) come first, then the blocks every
row sees whole, then the ones cut by the band's left edge. The backward's query tiles
run in the same three groups, in ascending order.

Integer division here always has a non-negative numerator (the DSL's truncates).

Query heads share key/value heads in groups (GQA/MQA; `kv_head`).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kernels import band

# An unbounded side of the band: beyond any j - i of rows and keys a GPU can hold (the
# FFI clamps to it).
BAND_LIMIT = 1 << 30


@cute.jit
def kv_block_range(
    m_block: Int32,
    seqlen_k: Int32,
    lo: Int32,
    hi: Int32,
    tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr,
    banded: cutlass.Constexpr,
):
    """(n_begin, n_end, masked_end, masked_begin) for query tile `m_block`: key blocks
    [n_begin, n_end) are visited, from the last to the first. The first masked_end
    visited (n_end - masked_end .. n_end - 1) and the last masked_begin visited
    (n_begin .. n_begin + masked_begin - 1) can hold invisible elements; the blocks
    between are seen whole by every row. masked_end >= 1 when a block is visited (the
    first one may hold the Sk tail)."""
    n_end = band.ceil_div(seqlen_k, tile_n)
    n_begin = Int32(0)
    masked_end = Int32(1)
    masked_begin = Int32(0)
    if cutlass.const_expr(banded):
        n_begin, n_end, masked_end, masked_begin = band.kv_blocks(
            m_block * tile_m, tile_m, seqlen_k, lo, hi, tile_n, cutlass.min, cutlass.max
        )
    return n_begin, n_end, masked_end, masked_begin


@cute.jit
def mask_block(
    s_rc: cute.Tensor,
    coord_rc: cute.Tensor,
    row0: Int32,
    col0: Int32,
    seqlen_k: Int32,
    lo: Int32,
    hi: Int32,
    banded: cutlass.Constexpr,
):
    """Set invisible scores of one block to -inf. `coord_rc` holds each value's (row, col)
    inside the block; `row0`, `col0` place the block in the (Sq, Sk) matrix."""
    for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
        # Visible columns of this row, relative to col0: [col_begin, col_end).
        col_end = seqlen_k - col0
        col_begin = Int32(0)
        if cutlass.const_expr(banded):
            row = row0 + coord_rc[r, 0][0]
            col_end = cutlass.min(col_end, row + hi + 1 - col0)
            col_begin = row + lo - col0
        for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            col = coord_rc[r, c][1]
            if col >= col_end or col < col_begin:
                s_rc[r, c] = -Float32.inf


# ---------------------------------------------------------------- backward (KV-stationary)
@cute.jit
def q_block_range(
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    lo: Int32,
    hi: Int32,
    tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr,
    banded: cutlass.Constexpr,
):
    """(m_begin, m_end, masked_front, masked_back) for key block `n_block`: query tiles
    [m_begin, m_end) see at least one of its keys (rows beyond Sq aside), visited in
    ascending order; the first masked_front and the last masked_back of them can hold
    invisible elements (the band's edges; every tile when the block holds the Sk
    tail)."""
    m_end = band.ceil_div(seqlen_q, tile_m)
    m_begin = Int32(0)
    masked_front = Int32(0)
    masked_back = Int32(0)
    if cutlass.const_expr(banded):
        m_begin, m_end, masked_front, masked_back = band.q_tiles(
            n_block * tile_n, tile_n, seqlen_q, lo, hi, tile_m, cutlass.min, cutlass.max
        )
    holds_tail = (n_block + 1) * tile_n > seqlen_k
    masked_front = cutlass.select_(holds_tail, m_end - m_begin, masked_front)
    masked_back = cutlass.select_(holds_tail, 0, masked_back)
    return m_begin, m_end, masked_front, masked_back


@cute.jit
def mask_block_kq(
    s_rc: cute.Tensor,
    coord_rc: cute.Tensor,
    key0: Int32,
    q0: Int32,
    seqlen_k: Int32,
    lo: Int32,
    hi: Int32,
    banded: cutlass.Constexpr,
):
    """mask_block for a transposed block S^T: rows are keys (from key0), columns are
    query rows (from q0)."""
    big = Int32(BAND_LIMIT)
    for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
        key = key0 + coord_rc[r, 0][0]
        # Visible query columns of this key's row, relative to q0: [col_begin, col_end].
        col_begin = Int32(0)
        col_end = big
        if cutlass.const_expr(banded):
            col_begin = key - hi - q0
            col_end = key - lo - q0
        col_begin = cutlass.select_(key >= seqlen_k, big, col_begin)
        for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            col = coord_rc[r, c][1]
            if col < col_begin or col > col_end:
                s_rc[r, c] = -Float32.inf


@cute.jit
def dq_turn(
    n_block: Int32,
    m_block: Int32,
    n_blocks: Int32,
    hi: Int32,
    tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr,
    banded: cutlass.Constexpr,
):
    """Deterministic backward: the place of key block n_block in the fixed order in which
    the key blocks that visit query tile m_block add their dQ partials. Without a band,
    ascending. Banded, descending from the last block that visits the tile: each block
    then adds first at its first tile, where its walk over the query tiles starts,
    so the blocks' walks stay in step instead of waiting on block 0's."""
    turn = n_block
    if cutlass.const_expr(banded):
        last = band.last_block(m_block, tile_m, hi, tile_n, n_blocks, cutlass.min, cutlass.max)
        turn = last - n_block
    return turn


@cute.jit
def kv_head(head: Int32, heads: Int32, heads_kv: Int32) -> Int32:
    """The key/value head query head `head` reads: GQA/MQA groups heads / heads_kv
    consecutive query heads on one key/value head (heads_kv divides heads)."""
    return head // (heads // heads_kv)
