"""Public entry points: `attention`, `supports`, `kernels`; picks kernel or reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_fa4 import _registry, _vjp
from jax_fa4._reference import reference_attention
from jax_fa4._spec import AttentionSpec

IMPLEMENTATIONS = (None, "cute", "reference")


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False,
              implementation=None):
    """Softmax attention, FlashAttention-style.

    q (B, Sq, H, D), k and v (B, Sk, H, D) -> out (B, Sq, H, D), plus lse (B, H, Sq)
    float32 (natural log) when `return_lse`.

    causal: bottom-right aligned, query i sees key j iff j <= i + Sk - Sq (the
        FlashAttention convention; equals jax.nn's top-left mask when Sq == Sk). A query
        row that sees no key gives out = 0 and lse = -inf.
    softmax_scale: static Python number, default 1 / sqrt(D).
    implementation: None picks the kernel where it runs (Hopper GPU, supported
        configuration; decided per platform at lowering, so the same jitted function
        also runs on CPU) and the pure-JAX reference elsewhere; "cute" forces the kernel
        and raises NotImplementedError with the reason when it cannot run here;
        "reference" forces the reference.

    Differentiable in reverse mode: the backward is the reference's VJP for now (exact,
    slow), and the cotangent of a returned lse flows into dq, dk, dv. Forward mode (jvp)
    works on the reference path only (the kernel paths are a custom_vjp).
    """
    spec = _plan(q, k, v, causal=causal, softmax_scale=softmax_scale,
                 return_lse=return_lse, implementation=implementation)
    out, lse = _run(spec, q, k, v)
    return (out, lse) if spec.return_lse else out


def supports(q, k, v, *, causal=False, softmax_scale=None, return_lse=False,
             implementation=None) -> tuple[bool, str]:
    """Whether `attention(q, k, v, ..., implementation="cute")` would run here.

    Takes arrays or jax.ShapeDtypeStruct and the keyword arguments of `attention`.
    Returns (True, "") or (False, reason). Malformed input raises ValueError.
    """
    _check_implementation(implementation)
    spec = AttentionSpec.from_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                     return_lse=return_lse)
    return _kernel_runs_here(spec)


def kernels() -> list[dict]:
    """The compiled kernels (name, kind, arch, dtype, head_dim, causal, tile_m, tile_n);
    [] when the native module is not built."""
    return _registry.manifest()


def _plan(q, k, v, *, causal, softmax_scale, return_lse, implementation) -> AttentionSpec:
    """Validates everything and fixes the path, before anything is traced."""
    _check_implementation(implementation)
    spec = AttentionSpec.from_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                     return_lse=return_lse)
    if implementation == "reference":
        return spec.with_path("reference")
    if implementation == "cute":
        if spec.kernel_dtype is None:
            raise ValueError(
                f"implementation='cute' takes bfloat16 or float16 inputs; got {spec.dtype}")
        ok, reason = _kernel_runs_here(spec)
        if not ok:
            raise NotImplementedError(reason)
        return spec.with_path("cute")
    ok, _ = spec.kernel_support()
    if not ok or _non_hopper_gpus():
        # Decided statically: a per-platform switch would send these GPUs to the kernel.
        return spec.with_path("reference")
    return spec.with_path("platform")


def _run(spec: AttentionSpec, q, k, v):
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    if 0 in (batch, heads, seqlen_q, seqlen_k):
        # Shapes are static, so empty problems never reach a kernel: no visible key
        # means out = 0 and lse = -inf (empty arrays when B, H or Sq is 0).
        out = jnp.zeros(q.shape, q.dtype)
        return out, jnp.full((batch, heads, seqlen_q), -jnp.inf, jnp.float32)
    if spec.path == "reference":
        return reference_attention(q, k, v, causal=spec.causal,
                                   softmax_scale=spec.softmax_scale)
    return _vjp.attention(spec, q, k, v)


def _check_implementation(implementation) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}")


def _kernel_runs_here(spec: AttentionSpec) -> tuple[bool, str]:
    ok, reason = spec.kernel_support()
    if not ok:
        return ok, reason
    if not any(_is_hopper(d) for d in _gpu_devices()):
        return False, f"no Hopper (sm_90) GPU visible to JAX; devices: {jax.devices()}"
    return True, ""


@functools.cache
def _gpu_devices() -> tuple:
    # Cached: backends do not change within a process, and probing a missing backend
    # raises on every call.
    try:
        return tuple(jax.devices("gpu"))
    except RuntimeError:
        return ()


def _is_hopper(device) -> bool:
    return str(getattr(device, "compute_capability", "")).startswith("9.")


def _non_hopper_gpus() -> bool:
    return any(not _is_hopper(d) for d in _gpu_devices())
