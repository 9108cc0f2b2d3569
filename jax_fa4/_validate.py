"""Checks of one attention call's inputs, run by `AttentionSpec`'s constructors.

Each check reads only what is static: shapes, dtypes and Python values (operands may be
arrays or jax.ShapeDtypeStructs, and their values are never read). It returns what the
spec keeps of its input, in canonical form (the operands' dims, the band, a static
number), or nothing, and raises ValueError naming the argument and what it got, before
anything is traced (`ring_attention` checks its band with `band` too). Whether a
kernel takes a valid call is `_kernel_select`'s question.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


FLOAT8 = "float8_e4m3fn"
OUT_DTYPES = ("bfloat16", "float16", "float32")


def check_operands(q, k, v, *, varlen: bool, float8: bool = False
                   ) -> tuple[str, int, int, int, int]:
    """Checks q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) (no B in varlen);
    -> (dtype, D, Dv, Hq, Hkv). float8_e4m3fn inputs only where the caller takes them
    (`float8`: `attention`, with descales), no other float8 format anywhere."""
    rank, legend = (3, "(total, H, D)") if varlen else (4, "(B, S, H, D)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not is_array(x):
            raise ValueError(
                f"{name} must be an array or jax.ShapeDtypeStruct; got {type(x).__name__}"
            )
        if len(x.shape) != rank:
            raise ValueError(
                f"{name} must have rank {rank} {legend}; got shape {tuple(x.shape)}"
            )
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not varlen and not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k, v must have the same batch size B; got {shapes}")
    (heads_q, head_dim), (heads_kv, _), head_dim_v = q.shape[-2:], k.shape[-2:], v.shape[-1]
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of heads Hkv; got {shapes}")
    if heads_kv == 0 and heads_q != 0 or heads_kv and heads_q % heads_kv:
        raise ValueError(
            f"the query heads Hq must be a multiple of the key/value heads Hkv (GQA/MQA); "
            f"got {shapes}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim D; got {shapes}")
    if k.shape[-3] != v.shape[-3]:
        raise ValueError(f"k and v must have the same sequence length Sk; got {shapes}")
    for name, dim in (("head_dim D", head_dim), ("head_dim Dv of v", head_dim_v)):
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"{name} must be a static positive integer; got {dim!r}")
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1:
        raise ValueError(
            f"q, k, v must have the same dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    (dtype,) = dtypes
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"q, k, v must have a floating-point dtype; got {dtype}")
    if dtype.name.startswith("float8"):
        if dtype.name != FLOAT8:
            raise ValueError(f"float8 q, k, v must be {FLOAT8}; got {dtype}")
        if not float8:
            raise ValueError(f"{FLOAT8} q, k, v: only jax_fa4.attention takes them "
                             "(forward only, with q_descale, k_descale, v_descale)")
    return dtype.name, head_dim, head_dim_v, heads_q, heads_kv


def check_float8(dtype: str, heads_kv: int, descales: dict, out_dtype) -> str | None:
    """float8_e4m3fn q, k, v: descales (name -> None or a float32 array of shape () or
    (Hkv,), per K/V head) and out_dtype (None: bfloat16; or one of OUT_DTYPES); other
    dtypes take neither. -> the out dtype's name, None for q's dtype."""
    if dtype != FLOAT8:
        given = [name for name, x in (*descales.items(), ("out_dtype", out_dtype))
                 if x is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: for {FLOAT8} q, k, v only; got {dtype}")
        return None
    for name, x in descales.items():
        if x is not None and not (is_array(x) and tuple(x.shape) in ((), (heads_kv,))
                                  and jnp.dtype(x.dtype) == jnp.float32):
            raise ValueError(f"{name} must be None or a float32 array of shape () or "
                             f"(Hkv,) = ({heads_kv},); got {describe(x)}")
    out = "bfloat16" if out_dtype is None else _dtype_name(out_dtype)
    if out not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}; got {out_dtype!r}")
    return out


def _dtype_name(x) -> str | None:
    try:
        return jnp.dtype(x).name
    except TypeError:
        return None


def check_segments_and_lengths(batch, seqlen_q, seqlen_k, *, q_segment_ids,
                               kv_segment_ids, q_lengths, kv_lengths) -> None:
    """Segment ids (B, Sq) / (B, Sk), given together, and lengths (B,): int32 or None."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    check_int_array("q_segment_ids", q_segment_ids, (batch, seqlen_q), "(B, Sq)")
    check_int_array("kv_segment_ids", kv_segment_ids, (batch, seqlen_k), "(B, Sk)")
    check_int_array("q_lengths", q_lengths, (batch,), "(B,)")
    check_int_array("kv_lengths", kv_lengths, (batch,), "(B,)")


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k) -> None:
    """cu_seqlens_q and cu_seqlens_k: int32 arrays of one shape (num_seqs + 1,)."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None or not is_array(cu) or len(cu.shape) != 1 or not cu.shape[0]:
            raise ValueError(f"{name} must be an int32 array of shape (num_seqs + 1,); "
                             f"got {describe(cu)}")
        check_int_array(name, cu, tuple(cu.shape), "(num_seqs + 1,)")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must have the same shape (num_seqs + 1,); "
            f"got {tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")


def check_sinks(sinks, heads_q: int) -> None:
    """None, or a floating-point array of shape (Hq,)."""
    if sinks is not None and not (is_array(sinks) and tuple(sinks.shape) == (heads_q,)
                                  and jnp.issubdtype(sinks.dtype, jnp.floating)):
        raise ValueError(f"sinks must be a floating-point array of shape (Hq,) = "
                         f"({heads_q},); got {describe(sinks)}")


def band(causal: bool, window) -> tuple[bool, int | None, int | None]:
    """(causal, left, right) in canonical form: right is None when causal, and a window
    whose right side is 0 is causal."""
    if window is None:
        return causal, None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"window must be a (left, right) pair of non-negative ints or None; got {window!r}")
    # A side at least 2^31 reaches past any sequence (sizes are int32): unbounded.
    left, right = (None if side is not None and side >= 1 << 31 else side
                   for side in (static_int("window left side", window[0], allow_none=True),
                                static_int("window right side", window[1], allow_none=True)))
    if causal and right:
        raise ValueError(
            f"causal=True means a window right side of 0; got window={tuple(window)} "
            "(pass causal=False for a window that sees keys after the aligned one)")
    return causal or right == 0, left, None if right == 0 else right


def static_int(name: str, value, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{name} must be a static Python int, not a traced value")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        kind = "int or None" if allow_none else "int"
        raise ValueError(f"{name} must be a static Python {kind}; got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}")
    return int(value)


def static_bool(name: str, value) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be a static Python bool; got {value!r}")


def static_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return _static_number("softmax_scale", softmax_scale)


def static_softcap(softcap) -> float | None:
    if softcap is None:
        return None
    softcap = _static_number("softcap", softcap)
    if softcap <= 0:
        raise ValueError(f"softcap must be > 0 (or None for no softcap); got {softcap}")
    return softcap


def _static_number(name: str, value) -> float:
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"{name} must be a static Python number, not a traced value: it is "
            "compiled into the call (pass it as a constant or mark it static in jit)"
        )
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{name} must be a static Python number; got {type(value).__name__}"
        )
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite; got {number}")
    # Every path computes with it in float32: past its range it would be inf, and a
    # subnormal (or 0 for a nonzero number) would blow up a division or drop out.
    # (Compared as Python floats: against float32 scalars, numpy would cast the number
    # to float32 first, with an overflow warning.)
    limits = np.finfo(np.float32)
    if number and not float(limits.tiny) <= abs(number) <= float(limits.max):
        raise ValueError(f"{name} must be a normal float32 (the kernels and the "
                         f"reference take it in float32); got {number}")
    return number


def check_int_array(name: str, x, shape: tuple, legend: str) -> None:
    """None, or an int32 array (or ShapeDtypeStruct) of exactly `shape`."""
    if x is None:
        return
    if not (is_array(x) and tuple(x.shape) == shape and jnp.dtype(x.dtype) == jnp.int32):
        raise ValueError(
            f"{name} must be an int32 array of shape {legend} = {shape}; got {describe(x)}")


def is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def describe(x) -> str:
    if is_array(x):
        return f"{jnp.dtype(x.dtype).name} array of shape {tuple(x.shape)}"
    return repr(x) if x is None else type(x).__name__
