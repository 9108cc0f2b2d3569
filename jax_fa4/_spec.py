"""AttentionSpec: every static choice of one attention call, validated at construction.

The spec is the custom_vjp static argument, the key into the kernel manifest and the
source of the FFI attributes. Only dtype and head_dim are read from the operands: batch,
sequence lengths and heads stay runtime values (one kernel serves every size).

Refusals: `ValueError` for malformed input, `NotImplementedError(reason)` (raised by the
caller with `kernel_support()`'s reason) for a capability gap, both before tracing.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import _registry

# Numpy dtype names of the inputs the kernels take -> the manifest's dtype names.
KERNEL_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}

# How the forward runs (set by `_api` after it checked the platform):
#   "cute": the kernel, unconditionally.
#   "platform": the kernel when lowered for CUDA, the reference for any other platform.
#   "reference": the pure-JAX reference.
PATHS = ("cute", "platform", "reference")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    dtype: str  # numpy name of the q/k/v dtype, e.g. "bfloat16"
    head_dim: int  # D
    causal: bool  # bottom-right aligned: query i sees key j iff j <= i + Sk - Sq
    softmax_scale: float
    return_lse: bool
    path: str = "reference"  # one of PATHS, set by _api once it checked the platform

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}; got {self.path!r}")

    @classmethod
    def from_inputs(cls, q, k, v, *, causal, softmax_scale, return_lse) -> AttentionSpec:
        """Validates q, k, v (arrays or ShapeDtypeStructs) and the static arguments."""
        dtype, head_dim = _check_operands(q, k, v)
        return cls(
            dtype=dtype,
            head_dim=head_dim,
            causal=_static_bool("causal", causal),
            softmax_scale=_static_scale(softmax_scale, head_dim),
            return_lse=_static_bool("return_lse", return_lse),
        )

    def with_path(self, path: str) -> AttentionSpec:
        return dataclasses.replace(self, path=path)

    @property
    def kernel_dtype(self) -> str | None:
        """The manifest's name for this dtype ("bf16", "fp16"); None if no kernel takes it."""
        return KERNEL_DTYPES.get(self.dtype)

    @property
    def kernel_name(self) -> str | None:
        """The forward kernel for (dtype, head_dim, causal); None if none was built."""
        if self.kernel_dtype is None:
            return None
        return _registry.find_kernel("fwd", self.kernel_dtype, self.head_dim, self.causal)

    def kernel_support(self) -> tuple[bool, str]:
        """Whether a compiled kernel covers this spec (devices are `_api`'s concern)."""
        if self.kernel_dtype is None:
            return False, (
                f"dtype {self.dtype} has no kernel; the kernels take bfloat16 or float16"
            )
        if self.softmax_scale <= 0:
            return False, f"the kernels need softmax_scale > 0; got {self.softmax_scale}"
        if reason := _registry.native_reason():
            return False, reason
        if self.kernel_name is None:
            built = sorted({e["head_dim"] for e in _registry.manifest()
                            if (e["kind"], e["dtype"]) == ("fwd", self.kernel_dtype)})
            return False, (
                f"no compiled kernel for dtype={self.kernel_dtype} head_dim={self.head_dim} "
                f"causal={self.causal}; head_dims built for {self.kernel_dtype}: {built}"
            )
        return True, ""

    def ffi_attributes(self) -> dict:
        """Attributes of the `jax_fa4_fwd` custom call: causal -> i1, softmax_scale -> f32."""
        return {"causal": self.causal, "softmax_scale": np.float32(self.softmax_scale)}


def _check_operands(q, k, v) -> tuple[str, int]:
    """Checks shapes and dtypes of q (B, Sq, H, D), k/v (B, Sk, H, D); -> (dtype, D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise ValueError(
                f"{name} must be an array or jax.ShapeDtypeStruct; got {type(x).__name__}"
            )
        if len(x.shape) != 4:
            raise ValueError(
                f"{name} must have rank 4 (B, S, H, D); got shape {tuple(x.shape)}"
            )
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k, v must have the same batch size B; got {shapes}")
    if not q.shape[2] == k.shape[2] == v.shape[2]:
        raise ValueError(
            f"q, k, v must have the same number of heads (Hq must equal Hkv for now); "
            f"got {shapes}"
        )
    if not q.shape[3] == k.shape[3] == v.shape[3]:
        raise ValueError(f"q, k, v must have the same head_dim D; got {shapes}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same sequence length Sk; got {shapes}")
    head_dim = q.shape[3]
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim D must be a static positive integer; got {head_dim!r}")
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1:
        raise ValueError(
            f"q, k, v must have the same dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    (dtype,) = dtypes
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"q, k, v must have a floating-point dtype; got {dtype}")
    return dtype.name, head_dim


def _static_bool(name: str, value) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be a static Python bool; got {value!r}")


def _static_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, jax.core.Tracer):
        raise ValueError(
            "softmax_scale must be a static Python number, not a traced value: it is "
            "compiled into the call (pass it as a constant or mark it static in jit)"
        )
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(
        softmax_scale, numbers.Real
    ):
        raise ValueError(
            f"softmax_scale must be a static Python number; got {type(softmax_scale).__name__}"
        )
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite; got {scale}")
    return scale
