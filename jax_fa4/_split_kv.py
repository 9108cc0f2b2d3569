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
    out (..., Sq, H, Dv) in dtype and lse (..., H, Sq) fp32."""
    top = jnp.max(lse, axis=-3, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # every split empty: all weights 0
    total = jnp.sum(jnp.exp(lse - top), axis=-3, keepdims=True)
    seen = total > 0
    whole = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    # Split s weighs exp(lse_s - lse): 0 for an empty split and for a row no split sees.
    # Only the sum below reads it, so XLA computes it inside that one pass over out.
    weight = jnp.exp(lse - jnp.where(seen, whole, 0.0))
    out = jnp.sum(out * jnp.swapaxes(weight, -1, -2)[..., None], axis=-4)
    return out.astype(dtype), whole[..., 0, :, :]
