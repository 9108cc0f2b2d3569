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


def broadcasts_to(shape, target) -> bool:
    """Whether `shape` broadcasts to `target` without changing it; symbolic dims
    (jax.export) compare equal only to themselves."""
    return len(shape) <= len(target) and all(
        d == 1 or d == t for d, t in zip(reversed(shape), reversed(target)))


def read_mask(mask, scores: tuple) -> str | None:
    """'none' (absent or all visible) or 'causal' (top-left, jnp.tril) for a mask over
    the scores of shape `scores` (..., q_len, kv_len); None for a mask that is neither,
    or that is traced (its values are unknown under jit or vmap). A mask that does not
    broadcast to the scores raises ValueError, as the frameworks' own attention does."""
    if mask is None:
        return "none"
    if not broadcasts_to(tuple(mask.shape), tuple(scores)):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not broadcast to the "
                         f"attention scores' shape {tuple(scores)}")
    if isinstance(mask, jax.core.Tracer):
        return None
    visible = np.asarray(mask).astype(bool)
    if visible.all():
        return "none"
    tril = np.tril(np.ones(scores[-2:], bool))
    shape = np.broadcast_shapes(visible.shape, tril.shape)  # concrete, unlike the scores'
    if np.array_equal(np.broadcast_to(visible, shape), np.broadcast_to(tril, shape)):
        return "causal"
    return None


def mask_kind(mask, scores: tuple) -> str:
    """`read_mask`'s answer; a mask it cannot read is refused, with the alternative."""
    kind = read_mask(mask, scores)
    if kind is not None:
        return kind
    if isinstance(mask, jax.core.Tracer):
        raise NotImplementedError(
            "jax_fa4 cannot read a traced mask (built under jit, or mapped by vmap: pass "
            "a mask shared by every example with in_axes=None): " + USE_CAUSAL)
    raise NotImplementedError(
        "jax_fa4 takes no dense attention mask other than causal: " + USE_CAUSAL)


def refuse(what: str, instead: str):
    raise NotImplementedError(f"jax_fa4 does not support {what}; {instead}")
