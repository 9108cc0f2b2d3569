"""Which key blocks a query tile visits, and which elements inside a block are visible.

Visibility of key column j from query row i (bottom-right aligned causal, the
FlashAttention convention):  j < Sk, and if causal  j <= i + Sk - Sq.

Query heads share key/value heads in groups (GQA/MQA; `kv_head`).

Key blocks are visited from the last to the first, so the blocks that need element
masking (the Sk tail and the causal diagonal) come first and the rest run unmasked.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


@cute.jit
def kv_block_range(
    m_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr,
    causal: cutlass.Constexpr,
):
    """(n_blocks, n_masked): blocks [0, n_blocks) are visited, and the last n_masked of
    them (visited first) can hold invisible elements. n_masked >= 1 when n_blocks >= 1
    (the first visited block may hold the Sk tail)."""
    n_blocks = (seqlen_k + tile_n - 1) // tile_n
    n_masked = Int32(1)
    if cutlass.const_expr(causal):
        offset = seqlen_k - seqlen_q
        # Exclusive column bound of the tile's last row, and the first column the
        # tile's first row cannot see.
        end = cutlass.min(seqlen_k, (m_block + 1) * tile_m + offset)
        end = cutlass.max(end, 0)
        n_blocks = (end + tile_n - 1) // tile_n
        first_hidden = cutlass.max(m_block * tile_m + offset + 1, 0)
        n_unmasked = cutlass.min(first_hidden // tile_n, n_blocks)
        n_masked = cutlass.max(n_blocks - n_unmasked, 1)
    return n_blocks, n_masked


@cute.jit
def mask_block(
    s_rc: cute.Tensor,
    coord_rc: cute.Tensor,
    row0: Int32,
    col0: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr,
):
    """Set invisible scores of one block to -inf. `coord_rc` holds each value's (row, col)
    inside the block; `row0`, `col0` place the block in the (Sq, Sk) matrix."""
    for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
        col_end = seqlen_k - col0
        if cutlass.const_expr(causal):
            row = row0 + coord_rc[r, 0][0]
            col_end = cutlass.min(col_end, row + 1 + seqlen_k - seqlen_q - col0)
        for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            if coord_rc[r, c][1] >= col_end:
                s_rc[r, c] = -Float32.inf


# ---------------------------------------------------------------- backward (KV-stationary)
@cute.jit
def q_block_range(
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr,
    causal: cutlass.Constexpr,
):
    """(m_begin, m_end, n_masked) for key block `n_block`: query tiles [m_begin, m_end)
    see at least one of its keys, visited in ascending order; the first n_masked of them
    can hold invisible elements (the causal diagonal; every tile when the block holds
    the Sk tail)."""
    m_end = (seqlen_q + tile_m - 1) // tile_m
    m_begin = Int32(0)
    n_masked = Int32(0)
    if cutlass.const_expr(causal):
        offset = seqlen_k - seqlen_q
        # Query row q sees key j iff q >= j - offset.
        first_row = cutlass.max(n_block * tile_n - offset, 0)  # sees the block's first key
        full_row = cutlass.max((n_block + 1) * tile_n - 1 - offset, 0)  # sees all its keys
        m_begin = cutlass.min(first_row // tile_m, m_end)
        m_full = cutlass.min((full_row + tile_m - 1) // tile_m, m_end)
        n_masked = m_full - m_begin
    holds_tail = (n_block + 1) * tile_n > seqlen_k
    n_masked = cutlass.select_(holds_tail, m_end - m_begin, n_masked)
    return m_begin, m_end, n_masked


@cute.jit
def mask_block_kq(
    s_rc: cute.Tensor,
    coord_rc: cute.Tensor,
    key0: Int32,
    q0: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr,
):
    """mask_block for a transposed block S^T: rows are keys (from key0), columns are
    query rows (from q0)."""
    big = Int32(1 << 30)
    for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
        key = key0 + coord_rc[r, 0][0]
        # First visible column of this key's row, relative to q0.
        col_start = Int32(0)
        if cutlass.const_expr(causal):
            col_start = key - (seqlen_k - seqlen_q) - q0
        col_start = cutlass.select_(key >= seqlen_k, big, col_start)
        for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            if coord_rc[r, c][1] < col_start:
                s_rc[r, c] = -Float32.inf


@cute.jit
def dq_turn(
    n_block: Int32,
    m_block: Int32,
    n_blocks: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr,
    causal: cutlass.Constexpr,
):
    """Deterministic backward: the place of key block n_block in the fixed order in which
    the key blocks that visit query tile m_block add their dQ partials. Without a mask,
    ascending. Causal, descending from the last block that visits the tile: each block
    then adds first at its diagonal tile, where its walk over the query tiles starts,
    so the blocks' walks stay in step instead of waiting on block 0's."""
    turn = n_block
    if cutlass.const_expr(causal):
        # Block n visits tile m iff n * tile_n < (m + 1) * tile_m + Sk - Sq (q_block_range).
        last = ((m_block + 1) * tile_m + seqlen_k - seqlen_q - 1) // tile_n
        turn = cutlass.min(last, n_blocks - 1) - n_block
    return turn


@cute.jit
def kv_head(head: Int32, heads: Int32, heads_kv: Int32) -> Int32:
    """The key/value head query head `head` reads: GQA/MQA groups heads / heads_kv
    consecutive query heads on one key/value head (heads_kv divides heads)."""
    return head // (heads // heads_kv)
