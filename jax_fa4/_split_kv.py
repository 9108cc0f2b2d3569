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

import jax
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


def _merge(a, b):
    """Two partial results of one output element, each (m, s, o): sum_k exp(lse_k - m)
    over its splits is s, and the same sum of their out_k is o. A side without keys has
    m = -inf and weighs 0 (no inf - inf)."""
    (m_a, s_a, o_a), (m_b, s_b, o_b) = a, b
    m = jnp.maximum(m_a, m_b)
    w_a = jnp.where(m_a == -jnp.inf, 0.0, jnp.exp(m_a - m))
    w_b = jnp.where(m_b == -jnp.inf, 0.0, jnp.exp(m_b - m))
    return m, s_a * w_a + s_b * w_b, o_a * w_a + o_b * w_b


def combine(out, lse, dtype):
    """out (..., S, Sq, H, Dv) and lse (..., S, H, Sq), fp32 partials of S splits ->
    out (..., Sq, H, Dv) in dtype and lse (..., H, Sq) fp32.

    One reduction over the splits, as the online softmax merges blocks: each element
    carries (running max, sum of weights, weighted sum of outs), so XLA reads every
    partial once in a single reduce (a decode step launches it next to the kernel)."""
    split_axis = out.ndim - 4
    m = jnp.broadcast_to(jnp.swapaxes(lse, -1, -2)[..., None], out.shape)
    init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.float32(0.0))
    top, total, summed = jax.lax.reduce((m, jnp.ones_like(out), out), init,
                                        lambda a, b: _merge(a, b), (split_axis,))
    seen = total > 0
    out = jnp.where(seen, summed / jnp.where(seen, total, 1.0), 0.0)
    whole = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return out.astype(dtype), jnp.swapaxes(whole[..., 0], -1, -2)
