"""Split-KV (flash-decoding): when a forward has too few query tiles to fill the GPU, the
kernel cuts each tile's key blocks into runs, one CTA each (the split variant of the
banded kernel, kernels/sm90/fwd.py), and `combine` merges their partial results.

A split s over keys K_s gives out_s = softmax(scores over K_s) V (fp32) and lse_s; the
whole row is lse = log sum_s exp(lse_s) and out = sum_s exp(lse_s - lse) out_s, exact up
to fp32 rounding. A split that sees no key of a row has out_s = 0 and lse_s = -inf, and
weighs 0; a row no split sees gives out = 0 and lse = -inf, as without splits. The
backward never splits: it reads only out and lse.
"""

from __future__ import annotations

import jax.numpy as jnp

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


def combine(out, lse, dtype):
    """out (..., S, Sq, H, Dv) and lse (..., S, H, Sq), fp32 partials of S splits ->
    out (..., Sq, H, Dv) in dtype and lse (..., H, Sq) fp32.

    The row's lse first (the partial lse are small), then one weighted sum of the
    partials, whose cast to dtype XLA fuses into it: three small kernels after the
    split kernel, 1.3-2.8 us less per decode step on an H100 than one variadic
    reduction carrying (max, sum of weights, weighted sum) and its separate epilogue
    (per-kernel CUPTI sums of a decode step, both alternated twice in one process,
    2026-11-25; batch 1, 32 / 8 heads of 128: 8k keys 17.6 -> 15.6 us, 32k 55.8 ->
    53.0, 128k 186.9 -> 184.7; batch 4 at 8k level). Reducing the lse with one variadic
    reduction, or with jax.nn.logsumexp, and weighting by exp(lse_s - lse) measured
    0.3-2.4 us slower at batch 1 (1 us faster at batch 4, 8k)."""
    split_axis = out.ndim - 4
    top = jnp.max(lse, axis=split_axis, keepdims=True)
    # A row no split sees has top = -inf; its weights stay 0 (no inf - inf).
    top = jnp.where(top == -jnp.inf, 0.0, top)
    weight = jnp.exp(lse - top)
    total = jnp.sum(weight, axis=split_axis, keepdims=True)
    seen = total > 0
    weight = weight / jnp.where(seen, total, 1.0)
    whole = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    summed = jnp.sum(jnp.swapaxes(weight, -1, -2)[..., None] * out, axis=split_axis)
    return summed.astype(dtype), jnp.squeeze(whole, split_axis)
