"""Split-KV (flash-decoding): when a forward has too few query tiles to fill the GPU, the
kernel cuts each tile's key blocks into runs, one CTA each (the split variant of the
banded kernel, kernels/sm90/fwd.py), and a combine kernel launched after it merges their
partial results (kernels/sm90/combine.py); with one run per tile the kernel writes out
and lse itself and no combine runs.

A split s over keys K_s gives out_s = softmax(scores over K_s) V (fp32) and lse_s; the
whole row is lse = log sum_s exp(lse_s) and out = sum_s exp(lse_s - lse) out_s, exact up
to fp32 rounding. A split that sees no key of a row has out_s = 0 and lse_s = -inf, and
weighs 0; a row no split sees gives out = 0 and lse = -inf, as without splits. The
backward never splits: it reads only out and lse.

The combine was three XLA kernels after the split kernel (the row's lse, then one
weighted sum of the partials with the cast fused in) and, under pack-GQA, took the
unpacking transposes with it; one kernel that also writes the caller's layout replaced
them (numbers in kernels/sm90/combine.py).
"""

from __future__ import annotations


# At most this many splits (ffi/handler_common.h kMaxSplits).
MAX_SPLITS = 128
# Each split walks at least this many key blocks: the prologue (Q load, first K/V
# loads) and the partial's store are paid once per split.
MIN_BLOCKS_PER_SPLIT = 2
# The split kernels (and their combine) address the caller's out (B, Sq, Hq, Dv) through
# a view whose strides they compute in 32 bits (kernels/sm90/combine.py `unpacked`):
# from this many elements of out its offsets would wrap, so such calls run unsplit.
OUT_VIEW_ELEMENTS = 2**31
# Split only when the unsplit grid fills less than this share of the SMs.
FILL = 0.8
# Decode-shaped calls (the query rows of a batch and head, pack-GQA's included, fit one
# split tile, over at least DECODE_MIN_BLOCKS key blocks) take the split kernel even
# with one run per tile: its tiles of 64 rows and one consumer leave no warpgroup
# computing padding, and it writes pack-GQA's layout itself in place of the
# transposes. Against the unsplit kernel (H200, 2026-11-26, alternated twice in one
# call; 32 / 8 heads, kernels/config.py's split tiles): d64 batch 32 at 1088 keys
# 1.51x, paged (pages of 64) 1.45x; d128 batch 64 at 8k 1.00x (both with the combine
# kernel then still after it).
DECODE_SHAPED = True
DECODE_MIN_BLOCKS = 4
# Split calls whose rows (pack-GQA's included) fit the keys-as-M decode tile
# (kernels/sm90/fwd_keys_m.py: the keys as the wgmma's M, at most its tile_m rows as N)
# run it where it was built, in place of the 64-row split tile.
KEYS_AS_M = True


# The float8-KV split kernels convert each block in the consumer before its GEMMs, so
# one CTA per SM leaves the loads waiting on it: they fill every CTA slot of an SM
# instead (two at d64 and d128). Decode steps, 32 / 8 heads (H100, 2026-11-27, one
# call, twice each; two slots / one slot / three): d128 batch 1 at 8k keys 16.1 / 16.7
# / 22.0 us, 32k 36.8 / 44.1 / 48.9, 128k 109.7 / 153.2 / 147.3, batch 4 at 32k 108.7
# / 153.6; d64 at 128k 72.1 / 103.2; d256 (one slot) level.
KV_FLOAT8_EVERY_SLOT = True


def slots(sm_count: int, kernel: dict, kv_float8: bool) -> int:
    """CTAs one wave of the split `kernel` holds: one per SM, or with float8 K/V
    every slot (the manifest's ctas_per_sm)."""
    if kv_float8 and KV_FLOAT8_EVERY_SLOT:
        return sm_count * kernel.get("ctas_per_sm", 1)
    return sm_count


def split_kernel_unsplit(rows: int, key_blocks: int, split_tile_rows: int) -> bool:
    """Whether a call with `rows` query rows per batch and head (as the kernel sees
    them) over `key_blocks` key blocks that needs no split runs the split kernel
    anyway (DECODE_SHAPED)."""
    return DECODE_SHAPED and rows <= split_tile_rows and key_blocks >= DECODE_MIN_BLOCKS


def num_splits(ctas: int, key_blocks: int, sm_count: int) -> int:
    """The split count of a forward whose grid has `ctas` CTAs (query tiles x heads x
    batch), each over at most `key_blocks` key blocks, on `sm_count` slots (`slots`):
    1 when the grid fills the GPU; else as many as keep all CTAs in one wave, each
    split at least MIN_BLOCKS_PER_SPLIT blocks and none of them empty. Fixed per shape,
    so jit and CUDA graphs stay valid."""
    if ctas <= 0 or key_blocks <= 0 or ctas >= FILL * sm_count:
        return 1
    splits = max(min(sm_count // ctas, key_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS), 1)
    # Splits walk ceil(key_blocks / splits) blocks each (band.split_visits): fewer of
    # them cover the same runs where that leaves the last ones empty (9 blocks in 4
    # splits of 3), an idle CTA and a partial the combine reads for nothing.
    per = -(-key_blocks // splits)
    return -(-key_blocks // per)


def out_view_fits(batch: int, heads: int, seqlen_q: int, head_dim_v: int) -> bool:
    """Whether the split kernels' out view (OUT_VIEW_ELEMENTS) addresses this out."""
    return batch * seqlen_q * heads * head_dim_v < OUT_VIEW_ELEMENTS
