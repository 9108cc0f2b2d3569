"""Registry of attention backends the benchmark times side by side.

Each entry maps a name (as in ../shared/anchors) to a factory: (causal) -> f(q, k, v)
returning the attention output for (B, S, H, D) inputs. Backends in DETERMINISTIC also
take deterministic=True: a backward that is bitwise reproducible (the bwd_det pass).
"""

import jax

import jax_fa4


def _jax_fa4(causal, deterministic=False):
    return lambda q, k, v: jax_fa4.attention(q, k, v, causal=causal, implementation="cute",
                                             deterministic=deterministic)


def _jax_nn(implementation):
    def factory(causal):
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=implementation
        )

    return factory


BACKENDS = {
    "jax_fa4": _jax_fa4,
    "jax_cudnn": _jax_nn("cudnn"),
    "jax_xla": _jax_nn("xla"),
}
DETERMINISTIC = ("jax_fa4",)
