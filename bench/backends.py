"""Registry of attention backends the benchmark times side by side.

Each entry maps a name (as in ../shared/anchors) to a factory: (causal, window_left=None,
softcap=None) -> f(q, k, v) returning the attention output for (B, S, H, D) inputs;
window_left makes causal attention a sliding window over the last window_left + 1 keys,
softcap caps the scores (a backend without it raises NotImplementedError). Backends in
DETERMINISTIC also take deterministic=True: a backward that is bitwise reproducible (the
bwd_det pass).
"""

import jax

import jax_fa4


def _jax_fa4(causal, window_left=None, softcap=None, deterministic=False):
    window = None if window_left is None else (window_left, None)
    return lambda q, k, v: jax_fa4.attention(q, k, v, causal=causal, window=window,
                                             softcap=softcap, implementation="cute",
                                             deterministic=deterministic)


def _jax_nn(implementation):
    def factory(causal, window_left=None, softcap=None):
        if softcap is not None:
            raise NotImplementedError("jax.nn.dot_product_attention has no softcap")
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
