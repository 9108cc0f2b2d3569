"""Registry of attention backends the benchmark times side by side.

Each entry maps a name (as in ../shared/anchors) to a factory: (causal, window_left=None,
softcap=None, documents=None) -> f(q, k, v) returning the attention output for
(B, S, H, D) inputs; window_left makes causal attention a sliding window over the last
window_left + 1 keys, softcap caps the scores, documents packs each row with that many
equal documents given as segment ids (a backend without a feature raises
NotImplementedError). Backends in
DETERMINISTIC also take deterministic=True: a backward that is bitwise reproducible (the
bwd_det pass).
"""

import jax
import jax.numpy as jnp

import jax_fa4


def _jax_fa4(causal, window_left=None, softcap=None, documents=None, deterministic=False):
    window = None if window_left is None else (window_left, None)

    def attend(q, k, v):
        ids = {}
        if documents:
            b, s = q.shape[:2]
            row = jnp.arange(s, dtype=jnp.int32) * documents // s
            ids = dict(q_segment_ids=jnp.broadcast_to(row, (b, s)),
                       kv_segment_ids=jnp.broadcast_to(row, (b, s)))
        return jax_fa4.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                 implementation="cute", deterministic=deterministic, **ids)

    return attend


def _jax_nn(implementation):
    def factory(causal, window_left=None, softcap=None, documents=None):
        if softcap is not None:
            raise NotImplementedError("jax.nn.dot_product_attention has no softcap")
        if documents:
            raise NotImplementedError("jax.nn.dot_product_attention has no segment ids")
        window = None if window_left is None else (window_left, 0)
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, local_window_size=window, implementation=implementation
        )

    return factory


BACKENDS = {
    "jax_fa4": _jax_fa4,
    "jax_cudnn": _jax_nn("cudnn"),
    "jax_xla": _jax_nn("xla"),
}
DETERMINISTIC = ("jax_fa4",)
