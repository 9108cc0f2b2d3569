"""What the Flax and Equinox adapters share: reading a mask they were handed, and
refusing what jax_fa4 cannot compute, with the alternative."""

from __future__ import annotations

import jax
import numpy as np

USE_CAUSAL = (
    "pass causal attention as a flag instead (nnx: mha(x, is_causal=True); linen: "
    "attention_fn=functools.partial(jax_fa4.flax.attention, causal=True); equinox: "
    "jax_fa4.equinox.MultiheadAttention(..., causal=True)); for padding or packed "
    "documents call jax_fa4.attention with q_lengths / kv_lengths or segment ids")


def read_mask(mask, q_len: int, kv_len: int) -> str | None:
    """'none' (absent or all visible) or 'causal' (top-left, jnp.tril) for a mask
    broadcastable to (..., q_len, kv_len); None for a mask that is neither, or that is
    traced (its values are unknown under jit)."""
    if mask is None:
        return "none"
    if isinstance(mask, jax.core.Tracer):
        return None
    visible = np.asarray(mask).astype(bool)
    if visible.all():
        return "none"
    tril = np.tril(np.ones((q_len, kv_len), bool))
    shape = np.broadcast_shapes(visible.shape, tril.shape)
    if np.array_equal(np.broadcast_to(visible, shape), np.broadcast_to(tril, shape)):
        return "causal"
    return None


def mask_kind(mask, q_len: int, kv_len: int) -> str:
    """`read_mask`'s answer; a mask it cannot read is refused, with the alternative."""
    kind = read_mask(mask, q_len, kv_len)
    if kind is not None:
        return kind
    if isinstance(mask, jax.core.Tracer):
        raise NotImplementedError(
            "jax_fa4 cannot read a mask computed under jit (a traced array): " + USE_CAUSAL)
    raise NotImplementedError(
        "jax_fa4 takes no dense attention mask other than causal: " + USE_CAUSAL)


def refuse(what: str, instead: str):
    raise NotImplementedError(f"jax_fa4 does not support {what}; {instead}")
