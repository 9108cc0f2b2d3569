"""Every refusal, with its message, raised before anything is traced.

Inputs are jax.ShapeDtypeStruct: they carry shape and dtype only, so any tracing or
computation would fail with a TypeError instead of the expected refusal.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _path, _registry


def sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


Q = sds(2, 16, 4, 64)
KV = sds(2, 24, 4, 64)


@pytest.mark.parametrize("q,k,v,match", [
    (sds(16, 4, 64), KV, KV, r"q must have rank 4 \(B, S, H, D\); got shape \(16, 4, 64\)"),
    (Q, sds(1, 2, 24, 4, 64), KV, r"k must have rank 4"),
    (Q, KV, sds(24, 4, 64), r"v must have rank 4"),
    ([[1.0]], KV, KV, r"q must be an array or jax.ShapeDtypeStruct; got list"),
    (Q, sds(3, 24, 4, 64), sds(3, 24, 4, 64), r"same batch size B"),
    (Q, sds(2, 24, 3, 64), sds(2, 24, 3, 64), r"Hq must be a multiple of .* Hkv"),
    (Q, KV, sds(2, 24, 2, 64), r"same number of heads"),
    (Q, sds(2, 24, 4, 128), sds(2, 24, 4, 128), r"same head_dim D"),
    (Q, KV, sds(2, 23, 4, 64), r"k and v must have the same sequence length Sk"),
    (Q, sds(2, 24, 4, 64, dtype=jnp.float16), KV, r"same dtype; got bfloat16, float16"),
    (sds(2, 16, 4, 64, dtype=jnp.int32), sds(2, 24, 4, 64, dtype=jnp.int32),
     sds(2, 24, 4, 64, dtype=jnp.int32), r"floating-point dtype; got int32"),
    (sds(2, 16, 4, 0), sds(2, 24, 4, 0), sds(2, 24, 4, 0), r"static positive integer"),
])
@pytest.mark.parametrize("entry", [jax_fa4.attention, jax_fa4.supports])
def test_malformed_operands(entry, q, k, v, match):
    with pytest.raises(ValueError, match=match):
        entry(q, k, v)


@pytest.mark.parametrize("kwargs,match", [
    (dict(implementation="flash"), r"implementation must be one of \(None, 'cute', 'reference'\)"),
    (dict(causal=1), r"causal must be a static Python bool"),
    (dict(causal=None), r"causal must be a static Python bool"),
    (dict(return_lse="yes"), r"return_lse must be a static Python bool"),
    (dict(deterministic=1), r"deterministic must be a static Python bool"),
    (dict(deterministic="true"), r"deterministic must be a static Python bool"),
    (dict(softmax_scale="0.1"), r"softmax_scale must be a static Python number; got str"),
    (dict(softmax_scale=True), r"softmax_scale must be a static Python number; got bool"),
    (dict(softmax_scale=jnp.float32(0.1)), r"static Python number; got ArrayImpl"),
    (dict(softmax_scale=float("nan")), r"softmax_scale must be finite"),
    (dict(softmax_scale=float("inf")), r"softmax_scale must be finite"),
    # float32 is what every path computes with: these had passed as nonzero and finite
    (dict(softmax_scale=1e-40), r"softmax_scale must be a normal float32"),
    (dict(softmax_scale=-1e39), r"softmax_scale must be a normal float32"),
])
@pytest.mark.parametrize("entry", [jax_fa4.attention, jax_fa4.supports])
def test_malformed_arguments(entry, kwargs, match):
    with pytest.raises(ValueError, match=match):
        entry(Q, KV, KV, **kwargs)


def test_traced_softmax_scale():
    q = jnp.zeros((1, 4, 1, 8), jnp.float32)

    @jax.jit
    def f(q, scale):
        return jax_fa4.attention(q, q, q, softmax_scale=scale)

    with pytest.raises(ValueError, match="not a traced value"):
        f(q, 0.5)


def test_static_numbers_are_accepted():
    q = jnp.ones((1, 3, 1, 8), jnp.float32)
    ref = jax_fa4.attention(q, q, q, softmax_scale=0.5)
    for scale in (np.float32(0.5), np.float64(0.5)):
        np.testing.assert_array_equal(jax_fa4.attention(q, q, q, softmax_scale=scale), ref)
    jax_fa4.attention(q, q, q, softmax_scale=2, causal=np.bool_(True))


def test_cute_needs_half_precision():
    # A capability gap (the reference computes it), not malformed input.
    with pytest.raises(NotImplementedError, match="implementation='cute' takes bfloat16, float16 or "
                                         "float8_e4m3fn inputs; got float32"):
        jax_fa4.attention(sds(2, 16, 4, 64, dtype=jnp.float32), sds(2, 24, 4, 64, dtype=jnp.float32),
                          sds(2, 24, 4, 64, dtype=jnp.float32), implementation="cute")


def test_cute_without_native_module(monkeypatch):
    monkeypatch.setattr(_registry, "_ffi", None)
    with pytest.raises(NotImplementedError, match=r"jax_fa4._ffi is not built \(pip install .\)"):
        jax_fa4.attention(Q, KV, KV, implementation="cute")
    assert jax_fa4.supports(Q, KV, KV)[1].startswith(_registry.NOT_BUILT + ";")


@pytest.mark.parametrize("q,k,v,kwargs,match", [
    (sds(2, 16, 4, 320), sds(2, 24, 4, 320), sds(2, 24, 4, 320), {},
     r"no compiled kernel for dtype=bf16 head_dim=320 mask=none; "
     r"head_dims built for bf16 \(D or D/Dv\): \[64, 96, 128, 192/128, 256\] "
     r"\(smaller ones run zero-padded\)"),
    (Q, KV, KV, dict(softmax_scale=-0.1), r"the kernels need softmax_scale > 0; got -0.1"),
    (Q, KV, KV, dict(softmax_scale=0), r"the kernels need softmax_scale > 0; got 0.0"),
    (Q, KV, KV, dict(causal=True), r"no Hopper \(sm_90\) GPU visible to JAX"),
])
def test_cute_capability_gaps(built, monkeypatch, q, k, v, kwargs, match):
    monkeypatch.setattr(_path, "gpu_devices", lambda: ())
    with pytest.raises(NotImplementedError, match=match):
        jax_fa4.attention(q, k, v, implementation="cute", **kwargs)
    ok, reason = jax_fa4.supports(q, k, v, **kwargs)
    assert not ok and re.search(match, reason)


def test_supports_reasons(built, monkeypatch):
    monkeypatch.setattr(_path, "gpu_devices", lambda: ())
    f32 = sds(2, 16, 4, 64, dtype=jnp.float32)
    support = jax_fa4.supports(f32, f32, f32)
    assert support == (False, "dtype float32 has no kernel; the kernels take bfloat16 or "
                       "float16 (float8_e4m3fn with descales); implementation=None runs the pure-JAX reference (O(Sq * "
                       "Sk) memory per head)")
    assert support.path == "reference"

    class Hopper:
        compute_capability = "9.0"

    monkeypatch.setattr(_path, "gpu_devices", lambda: (Hopper(),))
    assert jax_fa4.supports(Q, KV, KV, causal=True) == (True, "")
    assert jax_fa4.supports(Q, KV, KV, causal=True).path == "kernel"
    # implementation="reference" names its own path (it had been ignored: "kernel")
    reference = jax_fa4.supports(Q, KV, KV, implementation="reference")
    assert reference == (True, "") and reference.path == "reference"


def test_supports_names_unknown_and_missing_arguments_in_the_entry_points_terms():
    # It had been the spec constructor's TypeError ("AttentionSpec.from_inputs() got ...").
    with pytest.raises(TypeError, match="'casual'; it takes the arguments of "
                                        "jax_fa4.attention$"):
        jax_fa4.supports(Q, KV, KV, casual=True)
    lengths = jnp.zeros((3,), jnp.int32)
    with pytest.raises(TypeError, match="'window_size'; .* of jax_fa4.attention_varlen$"):
        jax_fa4.supports(Q, KV, KV, cu_seqlens_q=lengths, cu_seqlens_k=lengths,
                         max_seqlen_q=16, max_seqlen_k=24, window_size=(1, 1))
    # A missing one too ("AttentionSpec.from_varlen_inputs() missing 2 required ...").
    with pytest.raises(TypeError, match="'max_seqlen_q'; .* of jax_fa4.attention_varlen$"):
        jax_fa4.supports(Q, KV, KV, cu_seqlens_q=lengths, cu_seqlens_k=lengths)


def test_zero_size_with_cute_still_refuses_before_anything_else(monkeypatch):
    monkeypatch.setattr(_registry, "_ffi", None)
    with pytest.raises(NotImplementedError, match="not built"):
        jax_fa4.attention(sds(0, 16, 4, 64), sds(0, 24, 4, 64), sds(0, 24, 4, 64),
                          implementation="cute")
