"""Pack-GQA: the query heads that share a key/value head run as rows of one problem.

With few query rows (decode-like shapes) a query tile of a grouped call is mostly empty,
and each of the group's query heads streams the same K/V blocks in its own CTA. Packed,
query head h * g + j at position s becomes row s * g + j of key/value head h: one
problem per key/value head, with g times the rows, so a tile holds several heads' rows
and K/V are read once per group. The kernels see a call with Hq = Hkv.

Row positions change under packing, so a band (causal, window) comes in per-row key
ranges: the segment kernel variant (`AttentionSpec.segment_kernel`), with each row's
range and id repeated g times (by _ffi_calls, which makes the tile plan from the rows
before repeating them: one row per position). Everything here runs on each device's
shard (under a ring, on each chunk pair with its band), so the sharding rules see the
unpacked call.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_fa4 import _ffi_calls, _segment_plan


def worthwhile(group_size: int, seqlen_q: int, tile_m: int) -> bool:
    """Whether packing at least halves the query tiles per key/value head, and so the
    K/V reads: 2 ceil(Sq g / m) <= g ceil(Sq / m), for Sq small next to the tile m.
    Smaller gains would not pay for the transposes (and, with a band, for the segment
    variant)."""
    if group_size == 1:
        return False
    return 2 * -(-seqlen_q * group_size // tile_m) <= group_size * -(-seqlen_q // tile_m)


def _rows(x, g):
    """(B, Sq, Hkv * g, D) -> (B, Sq * g, Hkv, D): row s * g + j of head h is query head
    h * g + j at position s."""
    b, sq, heads, d = x.shape
    x = x.reshape(b, sq, heads // g, g, d).transpose(0, 1, 3, 2, 4)
    return x.reshape(b, sq * g, heads // g, d)


def _unrows(x, g):
    """_rows' inverse, on the last three axes (split-KV partials have one more)."""
    *lead, rows, heads_kv, d = x.shape
    x = x.reshape(*lead, rows // g, g, heads_kv, d)
    x = jnp.swapaxes(x, -3, -2)
    return x.reshape(*lead, rows // g, heads_kv * g, d)


def _lse_rows(x, g):
    """(B, Hkv * g, Sq) -> (B, Hkv, Sq * g), in _rows' row order."""
    b, heads, sq = x.shape
    x = x.reshape(b, heads // g, g, sq).transpose(0, 1, 3, 2)
    return x.reshape(b, heads // g, sq * g)


def _lse_unrows(x, g):
    """_lse_rows' inverse, on the last two axes."""
    *lead, heads_kv, rows = x.shape
    x = jnp.swapaxes(x.reshape(*lead, heads_kv, rows // g, g), -2, -1)
    return x.reshape(*lead, heads_kv * g, rows // g)


def _segments(segments, spec, q, k):
    """The packed call's (rows, keys), one row per position (the FFI calls repeat each
    for its group's heads): the caller's, or the band's on this shard."""
    if not spec.segment_kernel:
        return ()
    if not segments:
        segments = _segment_plan.padded_rows(spec, q.shape[1], k.shape[1], batch=q.shape[0])
    return segments


def fwd(q, k, v, *segments, spec, pages=None, appended=None, descale=None):
    """_ffi_calls.fwd on the packed problem."""
    g = spec.group_size
    # A split's combine kernel writes the caller's layout itself; else `unpack` runs.
    # The split kernel reads a decode step's q (one position) in place, its group's heads
    # as rows through strides (ffi/attention_fwd.cc).
    in_place = spec.split_kernel and q.shape[1] == 1 and g > 1
    return _ffi_calls.fwd(q if in_place else _rows(q, g), k, v,
                          *_segments(segments, spec, q, k),
                          spec=spec, pages=pages, rows_per_position=g, appended=appended,
                          descale=descale,
                          unpack=lambda out, lse: (_unrows(out, g), _lse_unrows(lse, g)),
                          q_heads_as_rows=in_place)


def bwd(q, k, v, out, dout, lse, dlse, *segments, spec):
    """_ffi_calls.bwd on the packed problem."""
    g = spec.group_size
    dq, dk, dv = _ffi_calls.bwd(_rows(q, g), k, v, _rows(out, g), _rows(dout, g),
                                _lse_rows(lse, g), _lse_rows(dlse, g),
                                *_segments(segments, spec, q, k), spec=spec,
                                rows_per_position=g)
    return _unrows(dq, g), dk, dv
