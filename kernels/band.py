"""Which blocks a band of visibility touches: the integer arithmetic of the Hopper
kernels' block ranges (kernels/sm90/mask.py), shared with the CPU tests.

Key j is visible from query row i iff j < Sk and lo <= j - i <= hi. The functions take
`mn` / `mx`: the DSL's min / max on runtime Int32 in the kernels, Python's in the
tests. Every division has a non-negative numerator (the DSL's truncates toward zero).
"""


def ceil_div(a, b):
    return (a + b - 1) // b


def kv_blocks(row0, tile_m, seqlen_k, lo, hi, tile_n, mn=min, mx=max):
    """Key blocks of the query tile of rows [row0, row0 + tile_m): (n_begin, n_end,
    masked_end, masked_begin). Blocks [n_begin, n_end) hold a key some row sees; the
    top masked_end and the bottom masked_begin of them may hold invisible elements; the
    ones between are seen whole by every row. masked_end >= 1 when n_end > n_begin:
    the forward masks the first block it visits (the top one) in any case."""
    row1 = row0 + tile_m - 1
    # Keys some row sees: [row0 + lo, row1 + hi], within [0, Sk).
    n_end = ceil_div(mx(mn(seqlen_k, row1 + hi + 1), 0), tile_n)
    n_begin = mn(mx(row0 + lo, 0) // tile_n, n_end)
    # Keys every row sees: [row1 + lo, row0 + hi], in whole blocks. The top block stays
    # masked, and it is the only one that can hold the Sk tail.
    whole_begin = ceil_div(mx(row1 + lo, 0), tile_n)
    whole_end = mx(mn(mx(row0 + hi + 1, 0) // tile_n, n_end - 1), n_begin)
    whole_begin = mn(mx(whole_begin, n_begin), whole_end)
    return n_begin, n_end, n_end - whole_end, whole_begin - n_begin


def q_tiles(key0, tile_n, seqlen_q, lo, hi, tile_m, mn=min, mx=max):
    """Query tiles of the key block [key0, key0 + tile_n): (m_begin, m_end,
    masked_front, masked_back). Tiles [m_begin, m_end) hold a row that sees a key of the
    block; the first masked_front and the last masked_back of them may hold invisible
    elements (the Sk tail aside: the caller masks every tile of the block holding it)."""
    key1 = key0 + tile_n - 1
    # Rows that see some key: [key0 - hi, key1 - lo], within [0, Sq).
    m_end = mn(ceil_div(mx(key1 - lo + 1, 0), tile_m), ceil_div(seqlen_q, tile_m))
    m_begin = mn(mx(key0 - hi, 0) // tile_m, m_end)
    # Rows that see every key: [key1 - hi, key0 - lo].
    whole_begin = ceil_div(mx(key1 - hi, 0), tile_m)
    whole_end = mx(mn(mx(key0 - lo + 1, 0) // tile_m, m_end), m_begin)
    whole_begin = mn(mx(whole_begin, m_begin), whole_end)
    return m_begin, m_end, whole_begin - m_begin, m_end - whole_end


def last_block(m_block, tile_m, hi, tile_n, n_blocks, mn=min, mx=max):
    """The highest key block whose q_tiles range holds query tile m_block (when any
    does): block n's m_begin <= m iff n * tile_n < (m + 1) * tile_m + hi, and its m_end
    then lies above m, since lo <= hi."""
    return mn(mx((m_block + 1) * tile_m + hi - 1, 0) // tile_n, n_blocks - 1)


def pair_q_tiles(own, peer, pick, mn=min, mx=max):
    """The common walk of a 2-CTA pair of key blocks (kernels/sm90/bwd_pair.py), from
    each block's (m_begin, m_end, masked_front, masked_back) (q_tiles, with the Sk tail
    masked): the union of the two ranges, every tile outside this block's unmasked
    middle masked; an empty range joins the other. `pick(c, a, b)` is a if c else b
    (the DSL's select in the kernels)."""
    b0, e0, f0, k0 = own
    b1, e1 = peer[0], peer[1]
    own_empty = e0 <= b0
    peer_empty = e1 <= b1
    begin = pick(own_empty, b1, pick(peer_empty, b0, mn(b0, b1)))
    end = pick(own_empty, e1, pick(peer_empty, e0, mx(e0, e1)))
    whole_begin = pick(own_empty, end, b0 + f0)
    whole_end = pick(own_empty, end, mx(e0 - k0, whole_begin))
    return begin, end, whole_begin - begin, end - whole_end


def split_visits(visits, split, splits, mn=min):
    """Visits [first, end) of split `split` of `splits` over a tile's `visits` key
    blocks: consecutive runs of ceil(visits / splits); the last ones may be shorter or
    empty (first == end)."""
    per = ceil_div(visits, splits)
    first = mn(split * per, visits)
    return first, mn(first + per, visits)


def split_blocks(n_begin, n_end, masked_end, masked_begin, first, end, mn=min, mx=max):
    """kv_blocks' (n_begin, n_end, masked_end, masked_begin) for the visits [first, end)
    of a tile (visit v is block n_end - 1 - v): the blocks of those visits, how many of
    them at the top may hold invisible elements (at least 1 when any is visited: the
    forward masks its first block in any case) and how many at the bottom, never the
    same block twice."""
    total = n_end - n_begin
    top = mx(mn(masked_end, end) - first, 1)
    top = mn(top, end - first)
    bottom_from = mx(total - masked_begin, first + top)
    return n_end - end, n_end - first, top, mx(end - bottom_from, 0)


def at_most(n, bound, mn=min):
    """1 where n <= bound, else 0, for n, bound >= 0, in integer arithmetic (launch
    dimensions must be integers)."""
    return 1 - mn(n // (bound + 1), 1)


def shifted(blocks, tiles, allowed, mn=min):
    """1 where the deterministic walks without a band over `tiles` query tiles are
    shifted (shifted_walk): `allowed` (1 or 0) and no more than `blocks` key blocks
    (pairs) than tiles; else 0. Integer arithmetic: launch dimensions must be
    integers."""
    return allowed * at_most(blocks, tiles, mn)


def shifted_walk(block, blocks, tiles, allowed, mn=min):
    """(first, turns) of key block `block`'s walk over the `tiles` query tiles without a
    band, one of `blocks` blocks: where shifted, block n starts at tile n and wraps
    around, and its dQ turns are shifted_turn's among `turns` = blocks; else (0, 0),
    the walk in order."""
    on = shifted(blocks, tiles, allowed, mn)
    return block * on, blocks * on


def shifted_turn(block, m, blocks, tiles, mn=min, mx=max):
    """Block `block`'s place among `blocks` key blocks in the order in which they reach
    query tile m, each block n < blocks <= tiles walking the `tiles` tiles from tile n
    and wrapping: block n reaches m at its visit d = (m - n) mod tiles, so the blocks
    before it are n + 1 .. n + d (mod tiles), those of them below `blocks` counted."""
    d = (m - block + tiles) % tiles
    return mx(mn(block + d, blocks - 1) - block, 0) + mx(block + d - tiles + 1, 0)
