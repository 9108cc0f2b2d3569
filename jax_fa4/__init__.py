"""jax_fa4: FlashAttention-4-style attention for JAX, with ahead-of-time CuTe-DSL kernels.

Axis legend, used by every shape in this package:
    B        batch
    Sq       query sequence length
    Sk       key / value sequence length
    Hq       query heads
    Hkv      key / value heads (Hkv divides Hq: GQA / MQA when smaller)
    D        head_dim of q and k
    Dv       head_dim of v and out (usually D)
    total_q  packed query rows of all sequences (attention_varlen)
    total_k  packed key / value rows of all sequences (attention_varlen)

    q (B, Sq, Hq, D); k (B, Sk, Hkv, D); v (B, Sk, Hkv, Dv); out (B, Sq, Hq, Dv);
    lse (B, Hq, Sq) float32. Varlen: q (total_q, Hq, D), k / v (total_k, Hkv, D / Dv),
    out (total_q, Hq, Dv), lse (Hq, total_q).

This is the layout of `jax.nn.dot_product_attention`. Causal masking and windows are
bottom-right aligned by default: query i sees key j iff j <= i + Sk - Sq.

The kernels run on Hopper GPUs through XLA FFI custom calls. On CPUs a pure-JAX
reference runs; on a GPU the kernels cannot serve (another GPU, a configuration without
a kernel) cuDNN through jax.nn.dot_product_attention or the reference, with a warning
(`_fallback`). `supports` says why the kernel would not run and what runs instead,
`kernels` lists the compiled kernels.
`dot_product_attention` is jax.nn.dot_product_attention's signature and semantics on
jax_fa4; `paged_attention` attends over a paged KV cache (inference). `ring_attention` (with `zigzag` / `unzigzag`) splits sequences across devices inside
`shard_map`. Framework adapters live in `jax_fa4.flax` and `jax_fa4.equinox` (imported
on demand).
"""

from jax_fa4._api import attention, attention_varlen, kernels, supports
from jax_fa4._context_parallel import ring_attention, unzigzag, zigzag
from jax_fa4._jax_nn import dot_product_attention
from jax_fa4._paged import paged_attention

__all__ = ["attention", "attention_varlen", "dot_product_attention", "kernels",
           "paged_attention", "ring_attention", "supports", "unzigzag", "zigzag"]
