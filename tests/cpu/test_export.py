"""jax.export round trip with symbolic batch and sequence length, for CPU and CUDA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_fa4
from jax_fa4._reference import reference_attention

pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")


@pytest.mark.parametrize("causal", [False, True])
def test_export_roundtrip_symbolic_shapes(built, causal):
    b, s = export.symbolic_shape("b, s")
    arg = jax.ShapeDtypeStruct((b, s, 4, 64), jnp.bfloat16)
    attn = jax.jit(functools.partial(jax_fa4.attention, causal=causal, return_lse=True))
    exported = export.export(
        attn, platforms=("cpu", "cuda"),
        # Our FFI target is not one of jax's stable custom calls; its ABI is ours to keep.
        disabled_checks=[export.DisabledSafetyCheck.custom_call("jax_fa4_fwd")],
    )(arg, arg, arg)
    assert "stablehlo.custom_call @jax_fa4_fwd" in exported.mlir_module()
    restored = export.deserialize(exported.serialize())

    reference = jax.jit(functools.partial(reference_attention, causal=causal,
                                          softmax_scale=64 ** -0.5))
    for seed, shape in enumerate([(2, 9, 4, 64), (1, 33, 4, 64)]):
        q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
                   for key in jax.random.split(jax.random.key(seed), 3))
        out, lse = restored.call(q, k, v)
        want_out, want_lse = reference(q, k, v)
        np.testing.assert_allclose(out.astype(jnp.float32), want_out.astype(jnp.float32),
                                   atol=1e-2, rtol=1e-2)
        np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_export_grad_roundtrip_symbolic_shapes(built):
    # The backward's workspace shapes are computed from the symbolic Sq (rounded up to
    # the kernel's query tile).
    b, s = export.symbolic_shape("b, s")
    arg = jax.ShapeDtypeStruct((b, s, 4, 64), jnp.bfloat16)

    def loss(q, k, v):
        out, lse = jax_fa4.attention(q, k, v, causal=True, return_lse=True)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    exported = export.export(
        grad, platforms=("cpu", "cuda"),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(t)
                         for t in ("jax_fa4_fwd", "jax_fa4_bwd")],
    )(arg, arg, arg)
    assert "stablehlo.custom_call @jax_fa4_bwd" in exported.mlir_module()
    restored = export.deserialize(exported.serialize())

    def reference_loss(q, k, v):
        out, lse = reference_attention(q, k, v, causal=True, softmax_scale=64 ** -0.5)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    reference = jax.jit(jax.grad(reference_loss, argnums=(0, 1, 2)))
    for seed, shape in enumerate([(2, 9, 4, 64), (1, 70, 4, 64)]):
        q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
                   for key in jax.random.split(jax.random.key(seed), 3))
        for got, want in zip(restored.call(q, k, v), reference(q, k, v)):
            np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32),
                                       atol=2e-2, rtol=2e-2)
