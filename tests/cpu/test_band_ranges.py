"""The kernels' block ranges for a band lo <= j - i <= hi (kernels/band.py, the arithmetic
kernels/sm90/mask.py runs on the GPU) against brute force over every (row, key) pair:
nothing visible is skipped, nothing left unmasked is invisible, and the deterministic
backward's dQ turns of each query tile are 0 .. k-1 exactly once."""

import importlib.util
import itertools
import pathlib
import random

import pytest

# kernels/ is not installed with the package: load the repository's file.
_SPEC = importlib.util.spec_from_file_location(
    "band", pathlib.Path(__file__).resolve().parents[2] / "kernels" / "band.py")
band = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(band)

LIMIT = 1 << 30  # kernels/sm90/mask.py BAND_LIMIT: an unbounded side
TILES = [(64, 128), (128, 128), (128, 64), (64, 64), (128, 176)]  # (tile_m, tile_n)


def _bands(sq, sk, rng):
    """(lo, hi): no mask aside, causal both alignments, windows, one-sided, off-diagonal."""
    offsets = (sk - sq, 0)
    out = [(-LIMIT, off) for off in offsets]  # causal, bottom-right / top-left
    def side():  # unbounded, small, any, or next to a multiple of the tiles
        near_tile = max(0, 64 * rng.randrange(0, 5) + rng.choice([-2, -1, 0, 1, 2]))
        return rng.choice([None, 0, 1, rng.randrange(0, 300), near_tile, near_tile])

    for _ in range(8):
        off = rng.choice(offsets)
        left, right = side(), side()
        out.append((-LIMIT if left is None else off - left,
                    LIMIT if right is None else off + right))
    return out


def _cases():
    rng = random.Random(0)
    sizes = [1, 2, 17, 63, 64, 65, 113, 128, 129, 203, 257, 511, 1000]
    for sq, sk in itertools.product(sizes, sizes):
        if rng.random() < 0.5:
            continue
        for lo, hi in _bands(sq, sk, rng):
            yield sq, sk, lo, hi, rng.choice(TILES)


CASES = list(_cases())


def _visible(i, j, sk, lo, hi):
    return j < sk and lo <= j - i <= hi


@pytest.mark.parametrize("chunk", range(8))
def test_block_ranges_cover_the_band(chunk):
    for sq, sk, lo, hi, (tm, tn) in CASES[chunk::8]:
        where = f"sq={sq} sk={sk} lo={lo} hi={hi} tile=({tm}, {tn})"
        n_blocks, m_tiles = band.ceil_div(sk, tn), band.ceil_div(sq, tm)
        # Visible pairs per (tile, block), rows < Sq only (padding rows never count).
        seen = {}
        for i in range(sq):
            # Keys of row i in the band: [i + lo, i + hi] within [0, Sk).
            for j in range(max(i + lo, 0), min(i + hi + 1, sk)):
                seen.setdefault((i // tm, j // tn), set()).add((i, j))
        visits = {}
        for m in range(m_tiles):
            n_begin, n_end, masked_end, masked_begin = band.kv_blocks(m * tm, tm, sk, lo, hi, tn)
            assert n_begin <= n_end and masked_end >= 0 and masked_begin >= 0, where
            if n_end > n_begin:
                assert masked_end >= 1 and masked_end + masked_begin <= n_end - n_begin, where
            visited = set(range(n_begin, n_end))
            assert {n for (mm, n) in seen if mm == m} <= visited, where
            for n in range(n_begin + masked_begin, n_end - masked_end):  # unmasked
                rows = range(m * tm, min((m + 1) * tm, sq))
                assert all(_visible(i, j, sk, lo, hi)
                           for i in rows for j in range(n * tn, (n + 1) * tn)), where
        for n in range(n_blocks):
            m_begin, m_end, front, back = band.q_tiles(n * tn, tn, sq, lo, hi, tm)
            if (n + 1) * tn > sk:  # the Sk tail: every tile masked (mask.q_block_range)
                front, back = m_end - m_begin, 0
            assert m_begin <= m_end and front >= 0 and back >= 0, where
            assert front + back <= m_end - m_begin, where
            assert {mm for (mm, nn) in seen if nn == n} <= set(range(m_begin, m_end)), where
            for m in range(m_begin + front, m_end - back):  # unmasked
                rows = range(m * tm, min((m + 1) * tm, sq))
                assert all(_visible(i, j, sk, lo, hi)
                           for i in rows for j in range(n * tn, (n + 1) * tn)), where
            for m in range(m_begin, m_end):
                visits.setdefault(m, []).append(n)
        # Deterministic order: descending from the tile's last visiting block.
        for m, blocks in visits.items():
            last = band.last_block(m, tm, hi, tn, n_blocks)
            turns = sorted(last - n for n in blocks)
            assert turns == list(range(len(blocks))), f"{where} tile {m}: {turns}"


def test_cases_exercise_every_shape_of_band():
    # Both edges cut some tiles, some tiles see nothing, some blocks are whole.
    kinds = set()
    for sq, sk, lo, hi, (tm, tn) in CASES:
        for m in range(band.ceil_div(sq, tm)):
            n_begin, n_end, masked_end, masked_begin = band.kv_blocks(m * tm, tm, sk, lo, hi, tn)
            kinds.add("empty" if n_end == n_begin else "visited")
            if masked_begin:
                kinds.add("left edge")
            if n_end - n_begin > masked_end + masked_begin:
                kinds.add("whole")
    assert kinds == {"empty", "visited", "left edge", "whole"}


@pytest.mark.parametrize("splits", [1, 2, 3, 5, 16])
def test_split_blocks_partition_each_tile(splits):
    """Split-KV: a tile's splits visit its blocks once each, in runs of consecutive
    visits, and a split leaves unmasked only blocks the whole tile leaves unmasked."""
    for sq, sk, lo, hi, (tm, tn) in CASES:
        for m in range(band.ceil_div(sq, tm)):
            where = f"sq={sq} sk={sk} lo={lo} hi={hi} tile=({tm}, {tn}) m={m} splits={splits}"
            n_begin, n_end, masked_end, masked_begin = band.kv_blocks(m * tm, tm, sk, lo, hi, tn)
            whole = set(range(n_begin + masked_begin, n_end - masked_end))
            visits = n_end - n_begin
            covered, previous_end = [], 0
            for split in range(splits):
                first, end = band.split_visits(visits, split, splits)
                assert previous_end == first <= end <= visits, where
                previous_end = end
                b, e, top, bottom = band.split_blocks(n_begin, n_end, masked_end, masked_begin,
                                                      first, end)
                assert (b, e) == (n_end - end, n_end - first), where
                if e > b:
                    assert top >= 1 and top + bottom <= e - b, where
                else:
                    assert top == bottom == 0, where
                assert set(range(b + bottom, e - top)) <= whole, where
                covered += range(b, e)
            assert previous_end == visits, where
            assert sorted(covered) == list(range(n_begin, n_end)), where


@pytest.mark.parametrize("chunk", range(4))
def test_pair_walks_cover_both_blocks_in_step(chunk):
    """2-CTA pairs of key blocks (kernels/sm90/bwd_pair.py): both blocks of a pair walk
    the same query tiles, every tile either block sees; a block leaves unmasked only
    tiles it sees whole; a grid with an odd block count gets a block past Sk, which
    masks every tile; the pairs' deterministic turns (blocks of 2 * tile_n) at every
    tile are 0 .. k-1 exactly once."""
    def pick(c, a, b):
        return a if c else b

    for sq, sk, lo, hi, (tm, tn) in CASES[chunk::4]:
        where = f"sq={sq} sk={sk} lo={lo} hi={hi} tile=({tm}, {tn})"
        pairs = band.ceil_div(band.ceil_div(sk, tn), 2)

        def own(n):  # mask.q_block_range
            b, e, front, back = band.q_tiles(n * tn, tn, sq, lo, hi, tm)
            if (n + 1) * tn > sk:
                front, back = e - b, 0
            return b, e, front, back

        visits = {}
        for p in range(pairs):
            blocks = (2 * p, 2 * p + 1)
            walks = [band.pair_q_tiles(own(n), own(n ^ 1), pick) for n in blocks]
            assert walks[0][:2] == walks[1][:2], where
            begin, end = walks[0][:2]
            for n, (b, e, front, back) in zip(blocks, walks):
                assert front >= 0 and back >= 0 and front + back <= e - b, where
                ob, oe, of, ok = own(n)
                if oe > ob:
                    assert b <= ob and oe <= e, where
                assert set(range(b + front, e - back)) <= set(range(ob + of, oe - ok)), where
            for m in range(begin, end):
                visits.setdefault(m, []).append(p)
        for m, visitors in visits.items():
            last = band.last_block(m, tm, hi, 2 * tn, pairs)
            turns = sorted(last - p for p in visitors)
            assert turns == list(range(len(visitors))), f"{where} tile {m}: {turns}"


@pytest.mark.parametrize("tiles", [1, 2, 3, 5, 8, 13])
def test_shifted_turns_follow_the_visits(tiles):
    # Deterministic walks without a band (kernels/sm90/bwd.py _q_tile, _dq_turn): at
    # every tile the turns are 0 .. blocks - 1, in the order of the blocks' visits, so
    # that every block's turn at the tile of its visit i waits only for blocks that
    # visited that tile at earlier visits.
    for blocks in range(1, tiles + 1):
        walks = [band.shifted_walk(n, blocks, tiles, 1) for n in range(blocks)]
        assert walks == [(n, blocks) for n in range(blocks)]
        first = [f for f, _ in walks]
        for m in range(tiles):
            visit = {n: (m - first[n]) % tiles for n in range(blocks)}
            turns = {n: band.shifted_turn(n, m, blocks, tiles) for n in range(blocks)}
            assert sorted(turns.values()) == list(range(blocks)), (blocks, m, turns)
            for n in range(blocks):
                assert turns[n] == sum(visit[q] < visit[n] for q in range(blocks))
    assert band.shifted_walk(3, tiles + 1, tiles, 1) == (0, 0)
    assert band.shifted_walk(0, 1, tiles, 0) == (0, 0)
