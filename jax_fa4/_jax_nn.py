"""`dot_product_attention`: jax.nn.dot_product_attention's signature and semantics,
computed by jax_fa4.

jax.nn's conventions, mapped onto `attention`: inputs (B, T, N, H) or (T, N, H); scale
1/sqrt(H); `is_causal` top-left (jnp.tril); `local_window_size` (left, right) around the
query's own index (an int w is (w, w)), intersected with the causal mask when both are
given; lengths mark padding, and padded query rows give 0. `return_residual` gives the
log-sum-exp in jax.nn's layout (B, T, N) and dtype, without a gradient.

What jax_fa4 does not compute goes to jax.nn itself, with a warning (its XLA path
materializes the scores): an additive bias, a mask that is not all-visible or causal,
a traced mask (unreadable), a traced scale, a window side below 0 (keys on one side of
the query only). `implementation="xla"` or `"cudnn"` goes to jax.nn as asked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import _adapters, _fallback
from jax_fa4._api import attention

JAX_NN_IMPLEMENTATIONS = ("xla", "cudnn")


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False):
    """jax.nn.dot_product_attention, run by jax_fa4's kernels where they run (the
    `implementation=None` of `jax_fa4.attention`: the kernel on a Hopper GPU, cuDNN or
    the reference elsewhere, with a warning on a GPU).

    Differences, where jax.nn's own paths disagree too: a query row that sees no key
    (inside its query length, with a window or key length that leaves it nothing) gives
    out = 0 and residual = -inf, where jax.nn's XLA path averages every value; a padded
    query row (past its query length) gives residual = -inf, where jax.nn's XLA path
    gives a large finite negative number.
    """
    arguments = dict(bias=bias, mask=mask, scale=scale, is_causal=is_causal,
                     query_seq_lengths=query_seq_lengths,
                     key_value_seq_lengths=key_value_seq_lengths,
                     local_window_size=local_window_size, return_residual=return_residual)
    if implementation in JAX_NN_IMPLEMENTATIONS:
        return jax.nn.dot_product_attention(query, key, value, **arguments,
                                            implementation=implementation)
    if implementation is not None:
        raise ValueError(f"Unsupported implementation option: {implementation}")
    # Array-likes (lists, NumPy arrays), as jax.nn takes them.
    query, key, value, mask, query_seq_lengths, key_value_seq_lengths = (
        None if x is None else jnp.asarray(x)
        for x in (query, key, value, mask, query_seq_lengths, key_value_seq_lengths))
    _check(query, key, value, query_seq_lengths, key_value_seq_lengths, mask)
    _check_window(local_window_size)
    if scale is not None and not isinstance(scale, jax.core.Tracer) and np.size(scale) == 1:
        # a concrete jax or NumPy scalar (or one-element array), as jax.nn takes it
        scale = float(np.reshape(scale, ()))
    if not isinstance(is_causal, jax.core.Tracer):
        is_causal = bool(is_causal)  # np.bool_ / a concrete jax bool
    rank3 = len(query.shape) == 3
    q, k, v = (x[None] if rank3 else x for x in (query, key, value))
    mask_kind = _adapters.read_mask(mask, _scores(q, k))
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    # A negative side keeps a query's keys off its own index (jax.nn's XLA mask takes it);
    # jax_fa4's windows contain the diagonal.
    one_sided = local_window_size is not None and min(local_window_size) < 0
    unsupported = ("an additive bias" if bias is not None
                   else "a traced mask (unreadable under jit)"
                   if isinstance(mask, jax.core.Tracer)
                   else "a mask other than all-visible or causal" if mask_kind is None
                   else "a traced scale" if isinstance(scale, jax.core.Tracer)
                   else "a local_window_size with a negative side" if one_sided else None)
    if unsupported:
        _fallback.warn_message_once(
            f"jax_fa4.dot_product_attention: jax_fa4 does not take {unsupported}; running "
            "jax.nn.dot_product_attention instead (XLA: the scores are materialized)")
        return jax.nn.dot_product_attention(query, key, value, **arguments)
    causal = is_causal or mask_kind == "causal"
    window = None
    if local_window_size is not None:
        left, right = local_window_size
        window = (left, 0 if causal else right)
    # The lse only where it is returned: cuDNN (the path of GPUs other than Hopper)
    # does not give it.
    result = attention(
        q, k, v, causal=causal, softmax_scale=scale, return_lse=bool(return_residual),
        alignment="top_left", window=window, q_lengths=query_seq_lengths,
        kv_lengths=key_value_seq_lengths)
    if not return_residual:
        return result[0] if rank3 else result
    out, lse = (x[0] for x in result) if rank3 else result
    residual = jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2).astype(key.dtype))
    return out, residual


def _check(query, key, value, query_seq_lengths, key_value_seq_lengths, mask) -> None:
    """jax.nn's own checks, with its messages (the mask's in jax.nn's words where it
    gives some), before anything is traced."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(x.shape) not in (3, 4):
            raise ValueError(f"{name} must have rank 3 (T, N, H) or 4 (B, T, N, H); "
                             f"got shape {tuple(x.shape)}")
    if not len(query.shape) == len(key.shape) == len(value.shape):
        raise ValueError("query, key and value must have the same rank; got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    b, _, k, h = (1, *key.shape) if len(key.shape) == 3 else key.shape
    if tuple(value.shape) != tuple(key.shape) or value.dtype != key.dtype:
        raise ValueError(f"value shape should be {tuple(key.shape)} ({key.dtype}): but got "
                         f"{tuple(value.shape)} ({value.dtype})")
    q_batch = 1 if len(query.shape) == 3 else query.shape[0]
    if q_batch != b or query.shape[-1] != h or query.dtype != key.dtype:
        raise ValueError(f"query shape should be {[b, -1, -1, h]} ({key.dtype}): but got "
                         f"{tuple(query.shape)} ({query.dtype})")
    if query.shape[-2] % k:
        raise ValueError("The number of query heads must be a multiple of key/value heads, "
                         f"but got {query.shape[-2]} vs {k}")
    for name, lengths in (("query_seq_lengths", query_seq_lengths),
                          ("key_value_seq_lengths", key_value_seq_lengths)):
        if lengths is not None and (tuple(lengths.shape) != (b,)
                                    or np.dtype(lengths.dtype) != np.int32):
            raise ValueError(f"{name} shape should be {[b]} (int32): but got "
                             f"{tuple(lengths.shape)} ({lengths.dtype})")
    if mask is not None and np.dtype(mask.dtype) != np.bool_:
        raise ValueError(f"mask dtype should be bool, but got {mask.dtype}")


def _check_window(local_window_size) -> None:
    def whole(n):
        return isinstance(n, (int, np.integer)) and not isinstance(n, bool)

    if local_window_size is None or whole(local_window_size):
        return
    if not (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2
            and all(map(whole, local_window_size))):
        raise ValueError("local_window_size must be None, an int or a tuple (left, right) "
                         f"of ints; got {local_window_size!r}")


def _scores(q, k) -> tuple:
    """The scores' shape (B, N, T, S) of rank-4 q and k (rank-3 inputs with B = 1, as
    jax.nn pads them, so that a rank-4 mask applies to them too)."""
    return (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
