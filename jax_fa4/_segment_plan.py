"""The segment kernels' runtime inputs (kernels/sm90/segments.py), computed with jnp.

Segment ids, lengths, the band (causal / window, either alignment), their combinations
and attention_varlen's packed sequences all become two arrays:
    rows (B, 3, Sq) int32: per query row i, [key_begin, key_end) and its segment id;
        row i sees key j iff key_begin <= j < key_end and keys[j] equals its id;
    keys (B, Sk) int32: per key, its segment id.
An empty range is (0, 0). From those, `forward_plan` / `backward_plan` list per tile the
blocks that hold a visible key (by each tile's and block's range of keys and ids: sorted
or packed ids skip well, unsorted ones stay correct), each with its mask: none for the
blocks that every row of the tile sees whole, the key ranges alone where the block's
keys and the tile's rows have one id, the ranges cut to each row's id's run where the
block's keys are two runs of ids (one document boundary), else the ranges and the ids.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_fa4 import _masks

# Beyond any position of a call the segment kernels take (positions_support); window
# sides are clamped to it.
_FAR = 1 << 30
# Neutral elements of min / max over int32 ids.
_ID_MAX, _ID_MIN = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min
# A plan entry is (block << 10) | its mask (kernels/sm90/segments.py NO_MASK, RANGES,
# IDS, or RUNS | (split << 2): the block's first run of ids ends at its key `split`).
_NO_MASK, _RANGES, _RUNS, _IDS = 0, 1, 2, 3
_MASK_BITS = 10
_MAX_TILE_N = 255  # a split of the whole block still fits in the mask's 8 bits
# The segment kernels' smallest key block (tests/cpu/test_segment_plan.py holds the
# manifest to it). A forward plan entry keeps its block number in the int32's 21 bits
# above the mask, so a row's keys must number below 2^21 such blocks: 2^27.
MIN_TILE_N = 64
MAX_KEYS = MIN_TILE_N << (31 - _MASK_BITS)


def positions_support(seqlen_q, seqlen_k) -> tuple[bool, str]:
    """Whether the plans and rows hold a call of these sizes (as the kernels see them:
    varlen's packed totals, paged calls' max_pages * page_size keys): fewer than
    MAX_KEYS keys, and positions below _FAR. Symbolic sizes (jax.export) pass."""
    if isinstance(seqlen_k, int) and seqlen_k >= MAX_KEYS:
        return False, (f"the segment kernels (segment ids, lengths, varlen, pages) take "
                       f"fewer than {MAX_KEYS} keys a row; got {seqlen_k}")
    if all(isinstance(n, int) for n in (seqlen_q, seqlen_k)) and seqlen_q + seqlen_k >= _FAR:
        return False, (f"the segment kernels take Sq + Sk below {_FAR}; got "
                       f"{seqlen_q} + {seqlen_k}")
    return True, ""


def padded_rows(spec, sq: int, sk: int, *, q_segment_ids=None, kv_segment_ids=None,
                q_lengths=None, kv_lengths=None, batch: int):
    """rows (B, 3, Sq), keys (B, Sk) for `attention`'s padded features (the visibility of
    `_masks.padded`)."""
    i = jnp.arange(sq, dtype=jnp.int32)[None, :]
    lq = jnp.full((batch, 1), sq, jnp.int32)
    lk = jnp.full((batch, 1), sk, jnp.int32)
    if q_lengths is not None:
        lq = jnp.clip(q_lengths, 0, sq)[:, None]
    if kv_lengths is not None:
        lk = jnp.clip(kv_lengths, 0, sk)[:, None]
    aligned = i + (lk - lq if spec.alignment == "bottom_right" else 0)
    begin, end = _band_range(spec, aligned, 0, lk)
    ids = jnp.zeros((batch, sq), jnp.int32) if q_segment_ids is None else q_segment_ids
    keys = jnp.zeros((batch, sk), jnp.int32) if kv_segment_ids is None else kv_segment_ids
    return _rows(begin, end, ids, valid=i < lq), keys


def varlen_rows(spec, cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int):
    """rows (1, 3, total_q), keys (1, total_k) for `attention_varlen`: the packed axis is
    one row whose segment ids are the sequence indices, and each query row's key range
    is its sequence's keys cut by its band, in packed key indices (the visibility of
    `_masks.varlen`). Keys outside every sequence get id -1, which no row has."""
    q_seq, q_valid = _masks.sequence_index(cu_seqlens_q, total_q)
    k_seq, k_valid = _masks.sequence_index(cu_seqlens_k, total_k)
    # Any sequence for rows outside them all (they see nothing); none exists when
    # cu_seqlens has one entry, and then clamped gathers give values no row uses.
    s = jnp.clip(q_seq, 0, max(cu_seqlens_q.shape[0] - 2, 0))
    q_start, q_stop = cu_seqlens_q[s], cu_seqlens_q[s + 1]
    k_start, k_stop = cu_seqlens_k[s], cu_seqlens_k[s + 1]
    i = jnp.arange(total_q, dtype=jnp.int32)
    if spec.alignment == "bottom_right":  # the sequence's last query meets its last key
        aligned = i - q_stop + k_stop
    else:
        aligned = i - q_start + k_start
    begin, end = _band_range(spec, aligned, k_start, k_stop)
    keys = jnp.where(k_valid, k_seq, -1)
    return _rows(begin[None], end[None], q_seq[None], valid=q_valid[None]), keys[None]


def chunk_rows(rows, offset, length):
    """rows for the keys [offset, offset + length) only, in that chunk's own key indices
    (a ring's travelling K/V chunk)."""
    begin = jnp.clip(rows[:, 0] - offset, 0, length)
    end = jnp.clip(rows[:, 1] - offset, 0, length)
    return _rows(begin, end, rows[:, 2], valid=begin < end)


def _band_range(spec, aligned, start, stop):
    """[begin, end): the keys in [start, stop) inside the band around `aligned`."""
    left, right = spec.window_left, 0 if spec.causal else spec.window_right
    begin = start if left is None else jnp.maximum(aligned - min(left, _FAR), start)
    end = stop if right is None else jnp.minimum(aligned + min(right, _FAR) + 1, stop)
    return jnp.broadcast_arrays(begin, end, aligned)[:2]


def _rows(begin, end, ids, valid):
    empty = ~valid | (begin >= end)
    begin = jnp.where(empty, 0, begin)
    end = jnp.where(empty, 0, end)
    return jnp.stack([begin, end, ids], axis=-2).astype(jnp.int32)


def visibility(rows, keys):
    """bool (B, Sq, Sk): which keys each row sees, for the reference."""
    j = jnp.arange(keys.shape[-1], dtype=jnp.int32)
    begin, end, ids = rows[..., 0, :, None], rows[..., 1, :, None], rows[..., 2, :, None]
    return (begin <= j) & (j < end) & (ids == keys[..., None, :])


def _tile_summaries(rows, tile_m, repeat=1):
    """Per query tile (B, tiles): the union of its rows' key ranges [lo, hi) and their
    ids' range (over rows that see something), and the keys every row sees,
    [max begin, min end). Rows past Sq do not count. With `repeat`, each row of `rows`
    stands for that many consecutive kernel rows (pack-GQA's query heads of one
    position): a tile then holds tile_m / repeat of them when repeat divides tile_m,
    so the summaries need no repeated copy (and a decode step's single position none
    of the reductions)."""
    if repeat > 1:
        if tile_m % repeat:
            rows = jnp.repeat(rows, repeat, axis=-1)
        else:
            tile_m //= repeat
    b, _, sq = rows.shape
    tiles = -(-sq // tile_m)
    # One tile takes the rows there are, unpadded: a decode step's single row then
    # reduces over an axis of 1, which XLA drops. (A symbolic Sq, of jax.export, pads.)
    width = sq if isinstance(sq, int) and tiles == 1 else tile_m
    pad = tiles * width - sq

    def tiled(x, fill):
        return jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill).reshape(b, tiles, width)

    begin, end, ids = rows[:, 0], rows[:, 1], rows[:, 2]
    sees = end > begin
    lo = tiled(jnp.where(sees, begin, _FAR), _FAR).min(-1)
    hi = tiled(jnp.where(sees, end, 0), 0).max(-1)
    id_lo = tiled(jnp.where(sees, ids, _ID_MAX), _ID_MAX).min(-1)
    id_hi = tiled(jnp.where(sees, ids, _ID_MIN), _ID_MIN).max(-1)
    all_begin = tiled(begin, -_FAR).max(-1)
    all_end = tiled(end, _FAR).min(-1)
    return lo, hi, id_lo, id_hi, all_begin, all_end


def _block_summaries(keys, tile_n):
    """Per key block (B, blocks): its ids' range, whether it is whole (no Sk tail),
    whether its keys are at most two runs of ids, and then where the first ends (the
    count of keys with the block's first id; the Sk tail continues the last run)."""
    assert tile_n <= _MAX_TILE_N, tile_n
    b, sk = keys.shape
    blocks = -(-sk // tile_n)

    # The tail repeats the last key: it leaves every block's ids and runs as they are.
    runs = jnp.pad(keys, ((0, 0), (0, blocks * tile_n - sk)), mode="edge")
    runs = runs.reshape(b, blocks, tile_n)
    n = jnp.arange(blocks, dtype=jnp.int32)
    two_runs = (runs[..., 1:] != runs[..., :-1]).sum(-1) <= 1
    split = (runs == runs[..., :1]).sum(-1, dtype=jnp.int32)
    return (runs.min(-1), runs.max(-1), ((n + 1) * tile_n <= sk)[None, :], two_runs, split)


def _visits(rows, keys, tile_m, tile_n, repeat):
    """(visit bool, mask int32), (B, query tiles, key blocks): mask _NO_MASK, _RANGES,
    _IDS or a RUNS mask with its split (the module docstring)."""
    tiles = _tile_summaries(rows, tile_m, repeat)
    lo, hi, q_lo, q_hi, all_begin, all_end = (x[:, :, None] for x in tiles)
    k_lo, k_hi, whole_block, two_runs, split = (
        x[:, None, :] for x in _block_summaries(keys, tile_n))
    start = jnp.arange(k_lo.shape[-1], dtype=jnp.int32) * tile_n
    stop = start + tile_n
    visit = (lo < stop) & (hi > start) & (q_lo <= k_hi) & (k_lo <= q_hi)
    one_id = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
    whole = whole_block & (all_begin <= start) & (all_end >= stop) & one_id
    runs = jnp.where(two_runs, _RUNS | (split << 2), _IDS)
    mask = jnp.where(whole, _NO_MASK, jnp.where(one_id, _RANGES, runs))
    return visit, mask.astype(jnp.int32)


def forward_plan(rows, keys, tile_m: int, tile_n: int, *, one_segment: bool = False,
                 repeat: int = 1, ascending: bool = False):
    """(B, query tiles, 1 + key blocks) int32: per query tile, the count of key blocks it
    visits, then (block << 10) | its mask for each, from the last block to the first
    (`ascending`: from the first to the last, as paged calls that append take them).
    `one_segment`: every row and key has id 0 (no segment ids, no varlen), the same plan
    in fewer steps (`_one_segment_forward_plan`). `repeat`: each row stands for that
    many kernel rows (`_tile_summaries`)."""
    if one_segment:
        return _one_segment_forward_plan(rows, keys.shape[-1], tile_m, tile_n, repeat,
                                         ascending)
    visit, mask = _visits(rows, keys, tile_m, tile_n, repeat)
    n = jnp.arange(visit.shape[-1], dtype=jnp.int32)
    code = jnp.where(visit, (n << _MASK_BITS) | mask, -1)
    if ascending:  # unvisited blocks sort last as the largest code, then become -1
        order = jnp.sort(jnp.where(visit, code, _ID_MAX), axis=-1)
        order = jnp.where(order == _ID_MAX, -1, order)
    else:
        order = -jnp.sort(-code, axis=-1)  # unvisited (-1) last
    count = visit.sum(-1, dtype=jnp.int32)
    return jnp.concatenate([count[..., None], order], axis=-1)


def _one_segment_forward_plan(rows, sk: int, tile_m: int, tile_n: int, repeat: int,
                              ascending: bool):
    """forward_plan when all ids are 0: a tile visits the blocks its rows' key ranges
    span, a run [first, last] listed from last (or first), and masks those that some
    row sees only in part (or that hold the Sk tail). No sort and no id reductions: a
    decode step with lengths spends its time in the kernel rather than here."""
    lo, hi, _, _, all_begin, all_end = (x[..., None]
                                        for x in _tile_summaries(rows, tile_m, repeat))
    blocks = -(-sk // tile_n)
    i = jnp.arange(blocks, dtype=jnp.int32)
    last = (hi + tile_n - 1) // tile_n - 1  # lo < hi when the tile sees a key
    count = jnp.where(lo < hi, last - lo // tile_n + 1, 0)
    block = lo // tile_n + i if ascending else last - i
    start = block * tile_n
    whole = ((start + tile_n <= sk) & (all_begin <= start) & (all_end >= start + tile_n))
    code = jnp.where(i < count, (block << _MASK_BITS) | jnp.where(whole, _NO_MASK, _RANGES),
                     -1)
    return jnp.concatenate([count, code], axis=-1).astype(jnp.int32)


def backward_plan(rows, keys, tile_m: int, tile_n: int, *, repeat: int = 1):
    """(B, key blocks, 1 + 2 * query tiles) int32: per key block, the count of query
    tiles it visits, (tile << 10) | its mask for each in ascending order, then each visit's
    deterministic dQ turn: how many higher key blocks visit the same tile. `repeat` as
    for forward_plan."""
    visit, mask = _visits(rows, keys, tile_m, tile_n, repeat)  # (B, tiles, blocks)
    tiles = visit.shape[1]
    m = jnp.arange(tiles, dtype=jnp.int32)[:, None]
    code = jnp.where(visit, (m << _MASK_BITS) | mask, _ID_MAX)
    order = jnp.swapaxes(jnp.sort(code, axis=1), 1, 2)  # (B, blocks, tiles) ascending
    count = visit.sum(1, dtype=jnp.int32)
    above = jnp.flip(jnp.cumsum(jnp.flip(visit, -1), -1, dtype=jnp.int32), -1) - visit
    visited_tile = jnp.minimum(order >> _MASK_BITS, tiles - 1)
    turns = jnp.take_along_axis(jnp.swapaxes(above, 1, 2), visited_tile, axis=-1)
    return jnp.concatenate([count[..., None], order, turns], axis=-1).astype(jnp.int32)
