"""The segment kernels' inputs (jax_fa4/_segment_plan.py) against the reference's
visibility (`_masks.padded`), for random segment ids (sorted and not), lengths, bands and
both alignments, at the kernels' tile shapes:

- rows and keys give exactly the reference's visibility, and for attention_varlen's
  packed sequences (`_masks.varlen`) too;
- every (tile, block) pair holding a visible pair is in both plans, with the same
  mask; an unmasked pair is seen whole (no Sq / Sk tail), one masked by the key
  ranges alone (RANGES) has the visibility of those ranges, and one masked by runs
  (RUNS) the visibility the kernels give it: each row's key range cut to its id's run
  of the block, the block's first id up to the split and the id at the split from
  there (kernels/sm90/segments.py mask_block);
- the forward lists key blocks in descending order, the backward query tiles in
  ascending order, and the deterministic turns of a tile's key blocks count 0, 1, ...
  from the highest block down.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _api, _masks, _path, _segment_plan, _spec

TILES = ((64, 128), (128, 128), (192, 128), (128, 80), (64, 64))
# A plan entry: the tile or block above BITS, its mask below (kernels/sm90/segments.py).
BITS = _segment_plan._MASK_BITS
LOW = (1 << BITS) - 1


def _lengths(rng, s, b):
    return jnp.asarray(rng.integers(0, s + 2, b), jnp.int32)


def _draw(seed):
    rng = np.random.default_rng(seed)
    b, sq, sk = 2, int(rng.integers(1, 300)), int(rng.integers(1, 300))
    causal = bool(rng.integers(2))
    left = None if rng.integers(2) else int(rng.integers(0, 50))
    right = None if causal or rng.integers(2) else int(rng.integers(0, 50))
    spec = types.SimpleNamespace(alignment=("bottom_right", "top_left")[rng.integers(2)],
                                 causal=causal, window_left=left, window_right=right)
    n = int(rng.integers(1, 5))
    q_ids, k_ids = rng.integers(0, n, (b, sq)), rng.integers(0, n, (b, sk))
    if seed % 3:  # packed documents: sorted ids
        q_ids, k_ids = np.sort(q_ids, -1), np.sort(k_ids, -1)
    arrays = dict(q_segment_ids=jnp.asarray(q_ids, jnp.int32),
                  kv_segment_ids=jnp.asarray(k_ids, jnp.int32),
                  q_lengths=_lengths(rng, sq, b) if seed % 2 else None,
                  kv_lengths=_lengths(rng, sk, b) if seed % 4 == 1 else None)
    return spec, b, sq, sk, arrays


@pytest.mark.parametrize("seed", range(60))
def test_plans_cover_exactly_the_visible_blocks(seed):
    spec, b, sq, sk, arrays = _draw(seed)
    tile_m, tile_n = TILES[seed % len(TILES)]
    rows, keys = _segment_plan.padded_rows(spec, sq, sk, batch=b, **arrays)
    window = None if (spec.window_left, spec.window_right) == (None, None) else (
        spec.window_left, spec.window_right)
    ref = _masks.padded(sq, sk, causal=spec.causal, alignment=spec.alignment, window=window,
                        **arrays).mask
    visible = np.asarray(_segment_plan.visibility(rows, keys))
    np.testing.assert_array_equal(visible, np.broadcast_to(np.asarray(ref), (b, sq, sk)))
    _check_plans(rows, keys, visible, tile_m, tile_n)


def _draw_varlen(seed):
    """cu_seqlens with empty sequences and rows outside every sequence, and a band."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 6))
    lq, lk = rng.integers(0, 90, n), rng.integers(0, 90, n)
    if seed % 2:  # self-attention lengths
        lk = lq
    cu_q = np.cumsum([int(rng.integers(0, 3)), *lq]).astype(np.int32)
    cu_k = np.cumsum([int(rng.integers(0, 3)), *lk]).astype(np.int32)
    total_q, total_k = int(cu_q[-1] + rng.integers(1, 20)), int(cu_k[-1] + rng.integers(1, 20))
    causal = bool(rng.integers(2))
    left = None if rng.integers(2) else int(rng.integers(0, 40))
    right = None if causal or rng.integers(2) else int(rng.integers(0, 40))
    spec = types.SimpleNamespace(alignment=("bottom_right", "top_left")[rng.integers(2)],
                                 causal=causal, window_left=left, window_right=right)
    return spec, jnp.asarray(cu_q), jnp.asarray(cu_k), total_q, total_k


@pytest.mark.parametrize("seed", range(30))
def test_varlen_rows_give_the_reference_visibility(seed):
    spec, cu_q, cu_k, total_q, total_k = _draw_varlen(seed)
    rows, keys = _segment_plan.varlen_rows(spec, cu_q, cu_k, total_q, total_k)
    assert rows.shape == (1, 3, total_q) and keys.shape == (1, total_k)
    window = None if (spec.window_left, spec.window_right) == (None, None) else (
        spec.window_left, spec.window_right)
    ref = _masks.varlen(cu_q, cu_k, total_q, total_k, causal=spec.causal,
                        alignment=spec.alignment, window=window).mask
    visible = np.asarray(_segment_plan.visibility(rows, keys))
    np.testing.assert_array_equal(visible[0], np.asarray(ref))
    tile_m, tile_n = TILES[seed % len(TILES)]
    _check_plans(rows, keys, visible, tile_m, tile_n)


def _check_plans(rows, keys, visible, tile_m, tile_n):
    b, sq, sk = visible.shape
    j = np.arange(sk)
    rows_np, keys_np = np.asarray(rows), np.asarray(keys)
    in_range = (rows_np[:, 0, :, None] <= j) & (j < rows_np[:, 1, :, None])
    fwd = np.asarray(_segment_plan.forward_plan(rows, keys, tile_m, tile_n))
    bwd = np.asarray(_segment_plan.backward_plan(rows, keys, tile_m, tile_n))
    tiles, blocks = -(-sq // tile_m), -(-sk // tile_n)
    assert fwd.shape == (b, tiles, 1 + blocks) and bwd.shape == (b, blocks, 1 + 2 * tiles)
    for batch in range(b):
        fwd_visits, bwd_visits = {}, {}
        for m in range(tiles):
            entries = fwd[batch, m, 1:1 + fwd[batch, m, 0]]
            assert (np.diff(entries >> BITS) < 0).all()
            fwd_visits.update({(m, e >> BITS): e & LOW for e in entries})
        for n in range(blocks):
            count = bwd[batch, n, 0]
            entries = bwd[batch, n, 1:1 + count]
            turns = bwd[batch, n, 1 + tiles:1 + tiles + count]
            assert (np.diff(entries >> BITS) > 0).all()
            bwd_visits.update({(e >> BITS, n): (e & LOW, t) for e, t in zip(entries, turns)})
        assert fwd_visits.keys() == bwd_visits.keys()
        for m in range(tiles):
            for n in range(blocks):
                block = visible[batch, m * tile_m:(m + 1) * tile_m,
                                n * tile_n:(n + 1) * tile_n]
                if block.any():
                    assert (m, n) in fwd_visits
                masked = fwd_visits.get((m, n), 0)
                assert masked in (0, 1, 3) or masked & 3 == 2
                if (m, n) in fwd_visits and masked == 0:
                    rows_in_tile = min(tile_m, sq - m * tile_m)
                    assert block.all() and block.shape == (rows_in_tile, tile_n)
                if masked == 1:
                    ranges = in_range[batch, m * tile_m:(m + 1) * tile_m,
                                      n * tile_n:(n + 1) * tile_n]
                    np.testing.assert_array_equal(ranges, block)
                if masked & 3 == 2:
                    np.testing.assert_array_equal(
                        _by_runs(rows_np[batch], keys_np[batch], m * tile_m, n * tile_n,
                                 masked >> 2, block.shape), block)
                if (m, n) in fwd_visits:
                    assert bwd_visits[(m, n)][0] == fwd_visits[(m, n)]
            down = sorted((n for (t, n) in bwd_visits if t == m), reverse=True)
            assert [bwd_visits[(m, n)][1] for n in down] == list(range(len(down)))
    _check_ascending(fwd, _segment_plan.forward_plan(rows, keys, tile_m, tile_n,
                                                     ascending=True))


def _by_runs(rows, keys, q0, key0, split, shape):
    """The visibility the kernels give a block the plan masks by runs: each row's
    range cut to the first run [key0, key0 + split) if it has the block's first id, to
    the second run from there if it has the id at the split, else empty."""
    sq, sk = rows.shape[-1], keys.shape[-1]
    first_id, split_id = keys[min(key0, sk - 1)], keys[min(key0 + split, sk - 1)]
    out = np.zeros(shape, bool)
    for r in range(shape[0]):
        begin, end, segment = rows[:, min(q0 + r, sq - 1)]
        if segment == first_id:
            end = min(end, key0 + split)
        elif segment == split_id:
            begin = max(begin, key0 + split)
        else:
            end = begin
        j = key0 + np.arange(shape[1])
        out[r] = (begin <= j) & (j < end)
    return out


def _check_ascending(plan, ascending):
    """The ascending plan (paged calls that append) lists the same visits in reverse, with the
    same count and the same -1 fill after them."""
    plan, ascending = np.asarray(plan), np.asarray(ascending)
    assert ascending.shape == plan.shape
    np.testing.assert_array_equal(ascending[..., 0], plan[..., 0])
    for row, up in zip(plan.reshape(-1, plan.shape[-1]),
                       ascending.reshape(-1, plan.shape[-1])):
        count = row[0]
        np.testing.assert_array_equal(up[1:1 + count], row[1:1 + count][::-1])
        assert (up[1 + count:] == -1).all()


@pytest.mark.parametrize("kwargs", [
    dict(causal=True, window=(5, None)),
    dict(alignment="top_left", causal=True),
    dict(sinks=True),
    dict(softcap=2.0, causal=True),
])
def test_segment_kernel_path_equals_the_reference_path(built, paths, kwargs):
    """On CPU the segment kernel path runs the reference from rows and keys: its out,
    lse and gradients equal the reference path's (lengths and sinks: padding rows keep
    lse = -inf)."""
    b, sq, sk, h, d = 2, 40, 56, 4, 64
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, sq, h, d), jnp.bfloat16)
    k, v = (jax.random.normal(x, (b, sk, 2, d), jnp.bfloat16) for x in keys[1:3])
    def two_documents(s, starts):  # ids 0, then 1 from each row's start on
        return (jnp.arange(s)[None] >= jnp.array(starts)[:, None]).astype(jnp.int32)

    arrays = dict(q_segment_ids=two_documents(sq, [10, 30]),
                  kv_segment_ids=two_documents(sk, [20, 40]),
                  q_lengths=jnp.array([35, 0], jnp.int32),
                  kv_lengths=jnp.array([50, 56], jnp.int32))
    if kwargs.pop("sinks", False):
        arrays["sinks"] = jax.random.normal(keys[3], (h,), jnp.float32)
    spec = _api._plan(q, k, v, causal=kwargs.get("causal", False), softmax_scale=None,
                      return_lse=True, implementation=None,
                      **{n: x for n, x in kwargs.items() if n != "causal"}, **arrays)
    assert spec.path == "platform" and spec.segments

    paths.assert_agree(lambda implementation, q, k, v: jax_fa4.attention(
        q, k, v, return_lse=True, **kwargs, **arrays, implementation=implementation),
        q, k, v)


@pytest.mark.parametrize("kwargs", [
    dict(causal=True, sinks=True),
    dict(window=(3, 7), alignment="top_left", softcap=2.0),
])
def test_varlen_kernel_path_equals_the_reference_path(built, paths, kwargs):
    """attention_varlen's kernel path (on CPU: the reference from varlen rows and keys)
    against its reference path, with empty sequences and rows outside every sequence."""
    cu_q = jnp.array([2, 20, 20, 51, 60], jnp.int32)
    cu_k = jnp.array([0, 30, 33, 33, 70], jnp.int32)
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (64, 4, 64), jnp.bfloat16)
    k, v = (jax.random.normal(x, (72, 2, 64), jnp.bfloat16) for x in keys[1:3])
    kwargs = dict(kwargs)
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = jax.random.normal(keys[3], (4,), jnp.float32)
    call = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=31, max_seqlen_k=37,
                return_lse=True, **kwargs)
    spec = _path.choose(_spec.AttentionSpec.from_varlen_inputs(
        q, k, v, softmax_scale=None, **{"causal": False, **call}), None,
        _path.sizes(q, k, varlen=True))
    assert spec.path == "platform" and spec.segments

    out, lse = paths.assert_agree(
        lambda implementation, q, k, v: jax_fa4.attention_varlen(
            q, k, v, **call, implementation=implementation), q, k, v)
    assert out.shape == (64, 4, 64) and lse.shape == (4, 64)
    assert np.isinf(lse[:, :2]).all() and np.isinf(lse[:, 60:]).all()


@pytest.mark.parametrize("seed", range(60))
def test_one_segment_forward_plan_is_the_plan(seed):
    """Without segment ids (lengths, bands, pack-GQA's repeated rows) the forward plan's
    short form is the general plan, entry for entry."""
    spec, b, sq, sk, arrays = _draw(seed)
    tile_m, tile_n = TILES[seed % len(TILES)]
    arrays.update(q_segment_ids=None, kv_segment_ids=None)
    if seed % 5 == 0:
        arrays.update(q_lengths=jnp.asarray([0, -4], jnp.int32),
                      kv_lengths=jnp.asarray([sk + 9, 0], jnp.int32))
    rows, keys = _segment_plan.padded_rows(spec, sq, sk, batch=b, **arrays)
    if seed % 3 == 0:  # pack-GQA: each row repeated per query head of a group
        rows = jnp.repeat(rows, 4, axis=-1)
    for ascending in (False, True):
        np.testing.assert_array_equal(
            _segment_plan.forward_plan(rows, keys, tile_m, tile_n, one_segment=True,
                                       ascending=ascending),
            _segment_plan.forward_plan(rows, keys, tile_m, tile_n, ascending=ascending))


@pytest.mark.parametrize("seed", range(48))
def test_plans_of_repeated_rows_need_no_repetition(seed):
    """pack-GQA: the plans made from one row per position with `repeat` g equal those
    of the rows repeated g times, forward (both forms) and backward, whether or not g
    divides the tile."""
    spec, b, sq, sk, arrays = _draw(seed)
    tile_m, tile_n = TILES[seed % len(TILES)]
    g = (2, 3, 4, 8, 16, 7)[seed % 6]
    if seed % 2:
        arrays.update(q_segment_ids=None, kv_segment_ids=None)
    rows, keys = _segment_plan.padded_rows(spec, sq, sk, batch=b, **arrays)
    repeated = jnp.repeat(rows, g, axis=-1)
    for plan, kwargs in ((_segment_plan.forward_plan, {}),
                         (_segment_plan.forward_plan, {"one_segment": True}),
                         (_segment_plan.backward_plan, {})):
        if kwargs and not seed % 2:
            continue  # the short form needs one segment
        np.testing.assert_array_equal(
            plan(rows, keys, tile_m, tile_n, repeat=g, **kwargs),
            plan(repeated, keys, tile_m, tile_n, **kwargs))


def test_segment_kernels_take_blocks_of_at_least_the_plans_smallest(expected_manifest):
    """positions_support's key limit assumes no segment kernel has smaller key blocks."""
    tiles = {e["tile_n"] for e in expected_manifest if e["segments"] or e["paged"]}
    assert tiles and min(tiles) >= _segment_plan.MIN_TILE_N, tiles


def test_plan_entries_hold_the_last_block_below_the_key_limit():
    """The largest block a call below MAX_KEYS has keeps its number in a plan entry."""
    block = (_segment_plan.MAX_KEYS - 1) // _segment_plan.MIN_TILE_N
    entry = np.int32(block) << np.int32(_segment_plan._MASK_BITS) | np.int32(3)
    assert entry > 0 and entry >> _segment_plan._MASK_BITS == block
