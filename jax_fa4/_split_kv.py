"""Split-KV (flash-decoding): when a forward has too few query tiles to fill the GPU, the
kernel cuts each tile's key blocks into runs, one CTA each (the split variant of the
banded kernel, kernels/sm90/fwd.py), and the last run of each tile to finish merges
the tile's partial results in the same launch (kernels/sm90/split_combine.py); this
module chooses the split count.

A split s over keys K_s gives out_s = softmax(scores over K_s) V (fp32) and lse_s; the
whole row is lse = log sum_s exp(lse_s) and out = sum_s exp(lse_s - lse) out_s, exact up
to fp32 rounding. A split that sees no key of a row has out_s = 0 and lse_s = -inf, and
weighs 0; a row no split sees gives out = 0 and lse = -inf, as without splits. The
backward never splits: it reads only out and lse.
"""

from __future__ import annotations


# At most this many splits (ffi/handler_common.h kMaxSplits).
MAX_SPLITS = 128
# Each split walks at least this many key blocks: the prologue (Q load, first K/V
# loads) and the partial's store are paid once per split.
MIN_BLOCKS_PER_SPLIT = 2
# Split only when the unsplit grid fills less than this share of the SMs.
FILL = 0.8


def num_splits(ctas: int, key_blocks: int, sm_count: int) -> int:
    """The split count of a forward whose grid has `ctas` CTAs (query tiles x heads x
    batch), each over at most `key_blocks` key blocks, on `sm_count` SMs: 1 when the
    grid fills the GPU; else as many as keep all CTAs in one wave (the kernels run one
    CTA per SM), each split at least MIN_BLOCKS_PER_SPLIT blocks. Fixed per shape, so
    jit and CUDA graphs stay valid."""
    if ctas <= 0 or ctas >= FILL * sm_count:
        return 1
    splits = min(sm_count // ctas, key_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS)
    return max(splits, 1)
