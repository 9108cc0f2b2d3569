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
