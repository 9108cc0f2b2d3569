"""jax_fa4: FlashAttention-4-style attention for JAX, with ahead-of-time CuTe-DSL kernels.

Axis legend, used by every shape in this package:
    B   batch
    Sq  query sequence length
    Sk  key / value sequence length
    H   heads (query and key/value heads are equal for now)
    D   head_dim

    q (B, Sq, H, D); k, v (B, Sk, H, D); out (B, Sq, H, D); lse (B, H, Sq) float32.

This is the layout of `jax.nn.dot_product_attention`. Causal masking is bottom-right
aligned: query i sees key j iff j <= i + Sk - Sq.

The kernels run on Hopper GPUs through XLA FFI custom calls; everywhere else (CPU,
other GPUs, unsupported configurations) a pure-JAX reference runs. `supports` says why
the kernel would not run, `kernels` lists the compiled kernels.
"""

from jax_fa4._api import attention, kernels, supports

__all__ = ["attention", "kernels", "supports"]
