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


def _export(fn, *args, targets=("jax_fa4_fwd", "jax_fa4_bwd")):
    """fn exported for CPU and CUDA. Our FFI targets are not among jax's stable custom
    calls; their ABI is ours to keep."""
    return export.export(
        fn, platforms=("cpu", "cuda"),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(t) for t in targets],
    )(*args)


@pytest.mark.parametrize("causal", [False, True])
def test_export_roundtrip_symbolic_shapes(built, causal):
    b, s = export.symbolic_shape("b, s")
    arg = jax.ShapeDtypeStruct((b, s, 4, 64), jnp.bfloat16)
    attn = jax.jit(functools.partial(jax_fa4.attention, causal=causal, return_lse=True))
    exported = _export(attn, arg, arg, arg, targets=("jax_fa4_fwd",))
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
    exported = _export(grad, arg, arg, arg)
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


@pytest.mark.parametrize("features", ["lengths", "segments"])
def test_export_segment_kernels_with_symbolic_shapes(built, features):
    """Lengths and segment ids take the segment kernels, whose per-tile plan is built
    from Sq: a symbolic one pads its rows to whole tiles (it had failed to compare)."""
    b, s = export.symbolic_shape("b, s")
    arg = jax.ShapeDtypeStruct((b, s, 4, 64), jnp.bfloat16)
    ints = {"lengths": (jax.ShapeDtypeStruct((b,), jnp.int32),),
            "segments": (jax.ShapeDtypeStruct((b, s), jnp.int32),) * 2}[features]

    def attend(q, k, v, *ints):
        names = {"lengths": ("kv_lengths",),
                 "segments": ("q_segment_ids", "kv_segment_ids")}[features]
        return jax_fa4.attention(q, k, v, causal=True, return_lse=True,
                                 **dict(zip(names, ints)))

    def loss(q, k, v, *ints):
        out, lse = attend(q, k, v, *ints)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for fn in (jax.jit(attend), grad):
        exported = _export(fn, arg, arg, arg, *ints)
        assert "stablehlo.custom_call @jax_fa4_fwd" in exported.mlir_module()
        restored = export.deserialize(exported.serialize())
        q, k, v = (jax.random.normal(key, (2, 70, 4, 64), jnp.float32).astype(jnp.bfloat16)
                   for key in jax.random.split(jax.random.key(0), 3))
        values = {"lengths": (jnp.array([70, 23], jnp.int32),),
                  "segments": (jnp.repeat(jnp.arange(2 * 5, dtype=jnp.int32).reshape(2, 5),
                                          14, axis=1),) * 2}[features]
        for got, want in zip(jax.tree.leaves(restored.call(q, k, v, *values)),
                             jax.tree.leaves(fn(q, k, v, *values))):
            np.testing.assert_array_equal(got, want)


def test_export_of_a_shard_map_roundtrip(built):
    # Sharded functions export through shard_map: the per-device body holds plain FFI
    # calls. (A jit whose inputs are sharded partitions attention with
    # custom_partitioning, whose partitioner is a Python callback that jax.export cannot
    # serialize.)
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("needs 8 CPU devices (tests/conftest.py sets jax_num_cpu_devices)")
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(2, 4), ("data", "model"))
    spec = jax.sharding.PartitionSpec("data", None, "model", None)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    attn = jax.shard_map(functools.partial(jax_fa4.attention, causal=True), mesh=mesh,
                         in_specs=(spec,) * 3, out_specs=spec)

    def loss(q, k, v):
        return jnp.sum(attn(q, k, v).astype(jnp.float32))

    arg = jax.ShapeDtypeStruct((4, 24, 8, 64), jnp.bfloat16, sharding=sharding)
    q, k, v = (jax.device_put(jax.random.normal(key, arg.shape, jnp.float32)
                              .astype(jnp.bfloat16), sharding)
               for key in jax.random.split(jax.random.key(0), 3))
    for fn in (attn, jax.grad(loss, argnums=(0, 1, 2))):
        exported = _export(jax.jit(fn), arg, arg, arg)
        assert "stablehlo.custom_call @jax_fa4_fwd" in exported.mlir_module()
        restored = export.deserialize(exported.serialize())
        for got, want in zip(jax.tree.leaves(restored.call(q, k, v)),
                             jax.tree.leaves(jax.jit(fn)(q, k, v))):
            assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
            np.testing.assert_array_equal(np.asarray(got, np.float32),
                                          np.asarray(want, np.float32))


def test_export_grouped_symbolic_shapes(built):
    # GQA with a symbolic Sq: pack-GQA is decided from Sq, so a symbolic one keeps the
    # plain layout rather than fail to compare.
    b, s = export.symbolic_shape("b, s")
    q = jax.ShapeDtypeStruct((b, s, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, 2, 64), jnp.bfloat16)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax_fa4.attention(
        q, k, v, causal=True).astype(jnp.float32)), argnums=(0, 1, 2)))
    exported = _export(grad, q, kv, kv)
    assert "stablehlo.custom_call @jax_fa4_bwd" in exported.mlir_module()


def test_export_float8_kv_with_symbolic_shapes(built):
    # Float8 K/V with symbolic sizes dequantize (the float8-KV kernels need static ones):
    # their size check had compared a symbolic out size with 2^31 and raised.
    b, s = export.symbolic_shape("b, s")
    q_arg = jax.ShapeDtypeStruct((b, s, 4, 64), jnp.bfloat16)
    kv_arg = jax.ShapeDtypeStruct((b, s, 4, 64), jnp.float8_e4m3fn)
    attn = jax.jit(functools.partial(jax_fa4.attention, causal=True))
    restored = export.deserialize(_export(attn, q_arg, kv_arg, kv_arg).serialize())
    q = jax.random.normal(jax.random.key(0), (2, 9, 4, 64), jnp.float32)
    kv = q[:, ::-1].astype(jnp.float8_e4m3fn)
    np.testing.assert_array_equal(restored.call(q.astype(jnp.bfloat16), kv, kv),
                                  attn(q.astype(jnp.bfloat16), kv, kv))

    cache = jax.ShapeDtypeStruct((16, 16, 4, 64), jnp.float8_e4m3fn)
    paged = jax.jit(jax_fa4.paged_attention)
    restored = export.deserialize(_export(
        paged, jax.ShapeDtypeStruct((b, 1, 4, 64), jnp.bfloat16), cache, cache,
        jax.ShapeDtypeStruct((b, 4), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
    ).serialize())
    caches = jax.random.normal(jax.random.key(1), (16, 16, 4, 64)).astype(jnp.float8_e4m3fn)
    args = (q[:, :1].astype(jnp.bfloat16), caches, caches,
            jnp.array([[3, 1, 0, 2], [5, 6, 7, 8]], jnp.int32), jnp.array([40, 17], jnp.int32))
    np.testing.assert_array_equal(restored.call(*args), paged(*args))
