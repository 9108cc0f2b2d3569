"""float8_e4m3fn K and V with a bfloat16 q (a float8 KV cache): forward only.

attention(q, k, v, k_descale=, v_descale=) with q in bfloat16 and k, v in float8_e4m3fn
stands for attention over q, k * k_descale, v * v_descale (descales as in `_float8`: None
or float32 of shape () or (Hkv,)); out is bfloat16, lse float32. paged_attention takes
float8 caches the same way.

On the kernel paths the split kernels' float8-KV variants run it (kernels/config.py
KV_FP8_*: head dims 64, 128 and 256, smaller ones zero-padded; no softcap): they read K
and V in e4m3, half a bf16 cache's bytes, and convert each block in shared memory
(kernels/sm90/dequant.py), exactly: K into bf16 for Q K^T, V into fp16 for P V (P
rounded to fp16, not bf16); k's descale joins the softmax scale and v's scales out, in
float32. Any Sq runs them (64-row tiles, one consumer warpgroup, or at head_dim 128
the keys-as-M decode tile for up to 8 rows a K/V head; split-KV where the grid leaves
SMs idle), with pack-GQA, windows, lengths, segment ids and sinks.
Every other call (softcap, head dims above 256, no Hopper GPU, implementation=
"reference") dequantizes K and V into bfloat16 first, k * k_descale rounded once, and
takes the bfloat16 paths (`kernel_spec` None), with a warning on a GPU.

A K/V head with a negative k_descale or a descale that is not finite gives NaN out
and lse on every path, as in `_float8` (a negative v_descale is a plain scale). A
gradient through q, k, v or a descale raises NotImplementedError.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_fa4 import (_fallback, _ffi_calls, _forward_only, _kernel_select, _pack_gqa, _path,
                     _sharding, _split_kv, _validate, _vjp)
from jax_fa4._float8 import descale_table
from jax_fa4._spec import AttentionSpec
from jax_fa4._varying import vary_like

DESCALES = ("k_descale", "v_descale")
FORWARD_ONLY = ("jax_fa4 attention over float8_e4m3fn k and v is forward only: it has no "
                "gradient or other derivative with respect to q, k, v or their descales")
DEQUANTIZE_WARNING = (
    "jax_fa4: float8 K/V dequantized into bfloat16 by XLA before attention (the float8-KV "
    "kernels take head dims up to 256 without softcap on Hopper): {}")


def applies(q, k, v) -> bool:
    """Whether a call has 16-bit q with float8 k or v: this module's, which checks it."""
    def name(x):
        return jnp.dtype(x.dtype).name if _validate.is_array(x) else ""

    return not name(q).startswith("float8") and any(
        name(x).startswith("float8") for x in (k, v))


def check(q, k, v, descales: dict, out_dtype) -> None:
    """q bfloat16, k and v float8_e4m3fn, descales of k and v only (None, () or (Hkv,)
    float32), no out_dtype (out is q's bfloat16)."""
    names = tuple(jnp.dtype(x.dtype).name for x in (q, k, v))
    if names[0] != "bfloat16" or names[1:] != (_validate.FLOAT8,) * 2:
        raise ValueError(
            f"float8 K/V: q must be bfloat16 and k, v both {_validate.FLOAT8}; got "
            f"{', '.join(names)}")
    if descales.get("q_descale") is not None:
        raise ValueError("q_descale: q is bfloat16 (float8 K/V take k_descale and v_descale)")
    if out_dtype is not None:
        raise ValueError("out_dtype: with float8 K/V out is bfloat16, q's dtype")
    _validate.check_float8(_validate.FLOAT8, k.shape[-2],
                           {name: descales.get(name) for name in DESCALES}, None)


def table(descales: dict, heads_kv: int):
    """(3, Hkv) float32: 1, the k and the v descale of each K/V head."""
    return descale_table({name: descales.get(name) for name in DESCALES}, heads_kv,
                         FORWARD_ONLY)


def as_bfloat16(x):
    """The shape and dtype that plan a call: its K/V as the bf16 they stand for."""
    return jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)


def kernel_spec(spec: AttentionSpec, sizes: tuple) -> AttentionSpec | None:
    """spec, planned for bfloat16 K/V by `_path.plan`, as a float8-KV kernel runs it:
    the split kernel (one split where the grid fills the GPU), packed where that pays;
    None where no float8-KV kernel takes it (the call then dequantizes)."""
    if spec.path not in ("cute", "platform") or not all(isinstance(n, int) for n in sizes):
        return None
    if too_large(spec, sizes):
        return None
    kv = dataclasses.replace(spec, kv_float8=True, pack_gqa=False, split_kernel=True,
                             num_splits=1, long_rows=False)
    if _kernel_select.kernel_head_dims(kv) is None:
        return None
    return _path.with_split(_path.with_packing(kv, *sizes[2:]), sizes, always=True)


def too_large(spec: AttentionSpec, sizes: tuple) -> str:
    """Why no float8-KV kernel can write this call's out ('' where one can, or where
    sizes are symbolic: jax.export): every one is a split kernel, whose out view has
    32-bit offsets (_split_kv.OUT_VIEW_ELEMENTS)."""
    if (not all(isinstance(n, int) for n in sizes[:3])
            or _split_kv.out_view_fits(*sizes[:3], spec.head_dim_v)):
        return ""
    return ("out has 2^31 elements or more, past the 32-bit out view of the float8-KV "
            "kernels (split kernels)")


def dequantized(k, v, descales):
    """k * k_descale and v * v_descale in bfloat16, from `table`'s (the caller has made
    k and v forward only)."""
    def scaled(x, descale):
        return (x.astype(jnp.float32) * descale[:, None]).astype(jnp.bfloat16)

    return scaled(k, descales[1]), scaled(v, descales[2])


def warn_dequantized(spec: AttentionSpec, sizes: tuple) -> None:
    """The warning of a call `kernel_spec` gave no kernel, where a GPU is (elsewhere
    every call dequantizes)."""
    if not _path.gpu_devices():
        return
    reason = (too_large(spec, sizes)
              or _kernel_select.kernel_support(dataclasses.replace(
                  spec, kv_float8=True, split_kernel=True, long_rows=False))[1]
              or "no Hopper GPU for the kernels")
    _fallback.warn_message_once(DEQUANTIZE_WARNING.format(reason))


def forward(spec: AttentionSpec, q, k, v, descales, segments=()):
    """(out bf16 (B, Sq, H, Dv), lse (B, H, Sq)) of the float8-KV kernel (spec from
    kernel_spec; "platform": the kernel where lowered for CUDA, the reference on the
    dequantized inputs elsewhere), partitioned over batch and heads under a sharded jit
    and batched by vmap (_sharding.KV_FLOAT8); descales from `table`; segments: () or
    the segment kernels' (rows, keys)."""
    run = _sharded_segments(spec) if segments else _sharded(spec)
    return _forward_only.call(FORWARD_ONLY, run, q, k, v, descales, *segments)


def _kernel(q, k, v, descales, *segments, spec: AttentionSpec):
    call = _pack_gqa.fwd if spec.pack_gqa else _ffi_calls.fwd
    return call(q, k, v, *segments, spec=spec, descale=descales)


def _reference(q, k, v, descales, *segments, spec: AttentionSpec):
    """The kernel paths' reference (`_vjp`) on the dequantized inputs, in float32."""
    k, v = (x.astype(jnp.float32) * d[:, None] for x, d in ((k, descales[1]), (v, descales[2])))
    out, lse = _vjp.reference(spec, q.astype(jnp.float32), k, v, *segments)
    return vary_like((q, k, v), (out.astype(jnp.bfloat16), lse))


def _on_shard(spec: AttentionSpec, *operands):
    kernel = functools.partial(_kernel, spec=spec)
    if spec.path == "platform":
        return jax.lax.platform_dependent(
            *operands, cuda=kernel, default=functools.partial(_reference, spec=spec))
    return kernel(*operands)


_sharded = _sharding.sharded(_on_shard, _sharding.KV_FLOAT8, None)
_sharded_segments = _sharding.sharded(_on_shard, _sharding.KV_FLOAT8_SEGMENTS, None)
