"""Which compiled kernel runs an `AttentionSpec`, and whether one can.

The spec names the variant it needs (dtype, head dims, `banded`, softcap,
`segment_kernel`, `split_kernel`, `paged`, `kv_float8`, `keys_as_m`, `long_rows`);
this module looks it up in the manifest of the kernels that were built
(`_registry`): the head dims the kernels run it at, the forward and backward
kernels' manifest entries (name, tiles), and the reason when no kernel takes it. The
manifest is read at every call, never cached into a spec. Whether a device can run the
kernel is `_path`'s concern.
"""

from __future__ import annotations

import dataclasses

from jax_fa4 import _registry, _split_kv
from jax_fa4._spec import AttentionSpec

# Numpy dtype names of the inputs the kernels take -> the manifest's dtype names.
KERNEL_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "e4m3"}

# The manifest's kv_dtype of the kernels for float8 K/V with 16-bit q (AttentionSpec.kv_float8).
KV_FLOAT8 = "e4m3"

# The kernels' grids are (tiles, heads, batch): y and z stop at 65535 (ffi/handler_common.h).
GRID_YZ_LIMIT = 65535


def kernel_dtype(spec: AttentionSpec) -> str | None:
    """The manifest's name for the spec's dtype ("bf16", "fp16"); None if no kernel
    takes it."""
    return KERNEL_DTYPES.get(spec.dtype)


def kernel_head_dims(spec: AttentionSpec) -> tuple[int, int] | None:
    """(D, Dv) of the kernels the spec runs: of those built (for its dtype and variant)
    that hold D and Dv, the one with the least D + Dv (the work per score), then the
    least D. Smaller inputs are zero-padded to it (exact: zero columns add nothing to
    q.k, and out's extra columns are dropped). None if none holds them."""
    if kernel_dtype(spec) is None:
        return None
    built = {_registry.head_dims(e) for e in _registry.manifest()}
    # The keys-as-M and long-row tiles stand in for the split and dense tiles at
    # those tiles' head dims.
    variant = dataclasses.replace(spec, keys_as_m=False, long_rows=False)
    fits = [(d + dv, d, dv) for d, dv in built
            if d >= spec.head_dim and dv >= spec.head_dim_v
            and _find(variant, "fwd", (d, dv)) is not None]
    return min(fits)[1:] if fits else None


def for_kernel(spec: AttentionSpec) -> AttentionSpec:
    """The spec at kernel_head_dims, the shapes the kernel calls see."""
    d, dv = kernel_head_dims(spec)
    return dataclasses.replace(spec, head_dim=d, head_dim_v=dv)


def fwd_kernel(spec: AttentionSpec) -> dict | None:
    """The manifest entry of the forward kernel for (dtype, kernel_head_dims, variant);
    None if none was built."""
    return _find(spec, "fwd")


def bwd_kernel(spec: AttentionSpec) -> dict | None:
    """The manifest entry of the backward kernel for (dtype, kernel_head_dims, variant);
    None if none was built (the kernel paths then differentiate with the reference)."""
    return _find(spec, "bwd")


def kernel_support(spec: AttentionSpec) -> tuple[bool, str]:
    """Whether a compiled kernel covers the spec (devices are `_path`'s concern)."""
    if kernel_dtype(spec) is None:
        return False, (
            f"dtype {spec.dtype} has no kernel; the kernels take bfloat16 or float16 "
            "(float8_e4m3fn with descales)"
        )
    if spec.softmax_scale <= 0:
        return False, f"the kernels need softmax_scale > 0; got {spec.softmax_scale}"
    if reason := _registry.native_reason():
        return False, reason
    if fwd_kernel(spec) is None:
        dtype = kernel_dtype(spec)
        built = ", ".join(str(d) if d == dv else f"{d}/{dv}" for d, dv in sorted(
            {_registry.head_dims(e) for e in _registry.manifest()
             if (e["kind"], e["dtype"]) == ("fwd", dtype)}))
        masked = spec.causal or spec.window != (None, None)
        dims = (f"head_dim={spec.head_dim}" if spec.head_dim_v == spec.head_dim
                else f"head_dims D={spec.head_dim}, Dv={spec.head_dim_v}")
        return False, (
            f"no compiled kernel for dtype={dtype} {dims} "
            f"mask={'causal/window' if masked else 'none'}"
            f"{' softcap' if spec.softcap is not None else ''}"
            f"{' segments' if spec.segment_kernel else ''}; head_dims built for "
            f"{dtype} (D or D/Dv): [{built}] (smaller ones run zero-padded)"
        )
    return True, ""


def grid_support(batch, heads) -> tuple[bool, str]:
    """Whether the kernels' grids hold `batch` and `heads` (query heads: pack-GQA would
    need fewer, but the plain layout must fit too). Symbolic sizes (jax.export) are
    checked by the handler at run time."""
    for name, size in (("batch", batch), ("heads Hq", heads)):
        if isinstance(size, int) and size > GRID_YZ_LIMIT:
            return False, (f"the kernels take {name} <= {GRID_YZ_LIMIT} (a grid "
                           f"dimension); got {size}")
    return True, ""


def batch_limit(spec: AttentionSpec, seqlen_q, heads) -> int | None:
    """The largest batch one kernel call of `spec` takes (None: no bound it can check,
    symbolic sizes): the grids' batch dimension, and a split kernel's out view
    (`_split_kv.out_view_fits`, 32-bit), which a vmapped axis folded into the batch
    can outgrow after the per-call checks passed."""
    limit = GRID_YZ_LIMIT
    if spec.split_kernel:
        if not isinstance(seqlen_q, int) or not isinstance(heads, int):
            return None
        row = seqlen_q * heads * spec.head_dim_v
        limit = min(limit, (_split_kv.OUT_VIEW_ELEMENTS - 1) // max(row, 1))
    return limit


def _find(spec: AttentionSpec, kind: str, dims: tuple[int, int] | None = None) -> dict | None:
    """The manifest entry of the spec's variant at head dims (D, Dv) (default:
    kernel_head_dims); None if none was built. A split forward is a variant of the
    banded kernel (an unbounded band stands for no mask); the backward never splits."""
    dims = kernel_head_dims(spec) if dims is None else dims
    if dims is None:
        return None
    split = kind == "fwd" and spec.split_kernel
    paged = kind == "fwd" and spec.paged
    return _registry.find_kernel(kind, kernel_dtype(spec), dims, spec.banded or split,
                                 spec.softcap is not None, spec.segment_kernel, split, paged,
                                 KV_FLOAT8 if spec.kv_float8 else None,
                                 split and spec.keys_as_m, kind == "fwd" and spec.long_rows)
