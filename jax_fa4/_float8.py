"""float8_e4m3fn attention inputs: dequantized by their descales, forward only.

A descale is one float32 per tensor (shape ()) or per K/V head (Hkv,); the query heads
of a group share their K/V head's q descale. The call stands for attention over q *
q_descale, k * k_descale, v * v_descale. Forward only: a gradient through q, k, v or a
descale raises when it is traced. A K/V head whose q and k descales multiply to a
negative number, or with a descale that is not finite, gives NaN out and lse on every
path (the kernel's online softmax needs a scale >= 0).

Where an e4m3 kernel covers the call (`_kernel_select`: no mask or a causal / window
band, head dims 64, 128, 256 or below them, no softcap or segments) it runs on q, k
and V^T in e4m3 (`forward`); elsewhere the reference runs on the dequantized inputs in
float32. Both give out in bf16 before the caller's out_dtype.

The kernel's V operand: fp8 wgmma reads B only K-major, so V goes in transposed, (B,
Hkv, Dv, Skp), keys padded with zeros to Skp (a multiple of 32), and within each 32
keys in the order its P registers take them (kernels/sm90/fragments.py: A column k
meets key 16 h + 8 q + 2 t + p for k = 16 h + 4 t + 2 q + p, a swap of two index
digits). One XLA transpose makes it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_fa4 import _forward_only, _sharding
from jax_fa4._reference import reference_attention
from jax_fa4._spec import AttentionSpec
from jax_fa4._varying import vary_like

TARGET = "jax_fa4_fwd_fp8"
DESCALES = ("q_descale", "k_descale", "v_descale")
KEYS_ALIGN = 32  # V^T's keys are padded to whole 32-key k-steps of the PV product


FORWARD_ONLY = (
    "jax_fa4.attention with float8_e4m3fn q, k, v is forward only: it has no gradient or "
    "other derivative with respect to q, k, v or their descales (train in bfloat16 or "
    "float16)")


def descale_table(descales: dict, heads_kv: int, message: str = FORWARD_ONLY):
    """(3, Hkv) float32: the q, k and v descale of each K/V head (1 where None); a
    gradient through one raises NotImplementedError(message)."""
    rows = []
    for name in DESCALES:
        x = descales.get(name)
        x = (jnp.ones((), jnp.float32) if x is None
             else _forward_only.values(x, message).astype(jnp.float32))
        rows.append(jnp.broadcast_to(x, (heads_kv,)))
    return jnp.stack(rows)


def dequantize(q, k, v, table):
    """float32 q * q_descale, k * k_descale, v * v_descale from descale_table's."""
    group = q.shape[-2] // max(k.shape[-2], 1)

    q, k, v = _forward_only.values((q, k, v), FORWARD_ONLY)

    def scaled(x, descale):
        return x.astype(jnp.float32) * descale[:, None]

    return scaled(q, jnp.repeat(table[0], group)), scaled(k, table[1]), scaled(v, table[2])


def undefined_heads(out, lse, table):
    """NaN out and lse for the query heads whose K/V head has a negative q * k descale
    or a descale that is not finite (both paths)."""
    bad = (table[0] * table[1] < 0) | ~jnp.all(jnp.isfinite(table), axis=0)
    bad = jnp.repeat(bad, out.shape[-2] // max(table.shape[1], 1))  # no heads: none
    return jnp.where(bad[:, None], jnp.nan, out), jnp.where(bad[:, None], jnp.nan, lse)


def v_view_support(spec: AttentionSpec, sizes: tuple) -> tuple[bool, str]:
    """Whether the kernel's V^T (`transposed_v`) fits its 32-bit offsets per batch
    element, Hkv * Dv * Skp < 2^31 (ffi/attention_fwd_fp8.cc); sizes as
    `_path.sizes`'s, symbolic ones (jax.export) left to the handler."""
    _, heads, _, seqlen_k = sizes
    if spec.out_dtype is None or not all(isinstance(n, int) for n in (heads, seqlen_k)):
        return True, ""
    padded = -(-seqlen_k // KEYS_ALIGN) * KEYS_ALIGN
    heads_kv = heads // spec.group_size
    if heads_kv * spec.head_dim_v * padded < 1 << 31:
        return True, ""
    return False, (f"the float8 kernels address V^T per batch element in 32 bits: Hkv * "
                   f"Dv * Sk (rounded up to {KEYS_ALIGN}) < 2^31; got {heads_kv} * "
                   f"{spec.head_dim_v} * {padded}")


def transposed_v(v):
    """V^T for the kernel: (B, Sk, Hkv, Dv) -> (B, Hkv, Dv, Skp), Skp the keys rounded
    up to KEYS_ALIGN (zeros past Sk), each 32 keys in the kernel's order."""
    batch, seqlen_k, heads_kv, dv = v.shape
    padded = -(-seqlen_k // KEYS_ALIGN) * KEYS_ALIGN
    v = jnp.pad(v, ((0, 0), (0, padded - seqlen_k), (0, 0), (0, 0)))
    # Key 16 h + 8 q + 2 t + p of each 32 goes to place 16 h + 4 t + 2 q + p.
    v = v.reshape(batch, padded // KEYS_ALIGN, 2, 2, 4, 2, heads_kv, dv)
    v = v.transpose(0, 6, 7, 1, 2, 4, 3, 5)
    return v.reshape(batch, heads_kv, dv, padded)


def forward(spec: AttentionSpec, q, k, v, table):
    """(out bf16 (B, Sq, H, Dv), lse (B, H, Sq)) of the float8 call on the kernel paths
    ("platform": the kernel where lowered for CUDA, the reference elsewhere), partitioned
    over batch and heads under a sharded jit (_sharding.FLOAT8); `table` from
    descale_table. Forward only as a whole: autodiff must not reach the partitioned and
    batched call inside, which has no derivative rules of its own."""
    return _forward_only.call(FORWARD_ONLY, _sharded(spec), q, k, v, table)


def _on_shard(spec: AttentionSpec, q, k, v, table):
    kernel = functools.partial(_kernel, spec=spec)
    if spec.path == "platform":
        reference = functools.partial(_reference, spec=spec)
        return jax.lax.platform_dependent(q, k, v, table, cuda=kernel, default=reference)
    return kernel(q, k, v, table)


# Under vmap, q, k and v fold into the batch while the table is shared, or the call
# runs once per element when the table varies (_sharding.sharded).
_sharded = _sharding.sharded(_on_shard, _sharding.FLOAT8, None)


def _kernel(q, k, v, table, *, spec: AttentionSpec):
    *lead, seqlen_q, heads, _ = q.shape
    dv = v.shape[-1]
    results = (jax.ShapeDtypeStruct((*lead, seqlen_q, heads, dv), jnp.bfloat16),
               jax.ShapeDtypeStruct((*lead, heads, seqlen_q), jnp.float32),
               jax.ShapeDtypeStruct((1,), jnp.int32))  # a "dynamic" kernel's tile counter
    attributes = {name: value for name, value in spec.ffi_attributes().items()
                  if name in ("banded", "softmax_scale", "window_left", "window_right",
                              "top_left")}
    call = jax.ffi.ffi_call(TARGET, results)
    out, lse, _counter = call(q, k, transposed_v(v), table, **attributes)
    return vary_like((q, k, v), (out, lse))


def _reference(q, k, v, table, *, spec: AttentionSpec):
    q, k, v = dequantize(q, k, v, table)
    out, lse = reference_attention(q, k, v, **spec.reference_options())
    return out.astype(jnp.bfloat16), lse
