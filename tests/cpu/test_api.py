"""jax_fa4.attention on CPU: the reference path, the per-platform path's CPU branch
(custom_vjp + platform_dependent), gradients through lse, transformations, empty inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _api, _kernel_select, _registry
from jax_fa4._reference import reference_attention

TOL = dict(atol=2e-5, rtol=2e-5)


def _inputs(b, sq, sk, h, d, dtype=jnp.float32, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (b, sq, h, d), jnp.float32).astype(dtype),
            jax.random.normal(kk, (b, sk, h, d), jnp.float32).astype(dtype),
            jax.random.normal(kv, (b, sk, h, d), jnp.float32).astype(dtype))


def _loss(attn, w_out, w_lse):
    """A scalar of out and of the finite lse entries, so both cotangents flow."""
    def loss(q, k, v):
        out, lse = attn(q, k, v, return_lse=True)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(finite_lse * w_lse)
    return loss


def test_default_on_cpu_is_the_reference():
    q, k, v = _inputs(2, 9, 13, 3, 64, jnp.bfloat16)
    got = jax.jit(functools.partial(jax_fa4.attention, causal=True, return_lse=True))(q, k, v)
    want = jax.jit(functools.partial(reference_attention, causal=True,
                                     softmax_scale=64 ** -0.5))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_grad_through_lse_on_reference_path():
    q, k, v = _inputs(2, 6, 11, 2, 16)
    scale = 0.3

    def lse_sum(q, k, v):
        _, lse = jax_fa4.attention(q, k, v, softmax_scale=scale, return_lse=True,
                                   implementation="reference")
        return jnp.sum(lse)

    def explicit(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
        return jnp.sum(jax.nn.logsumexp(s, axis=-1))

    got = jax.grad(lse_sum, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(explicit, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], **TOL)
    np.testing.assert_allclose(got[1], want[1], **TOL)
    np.testing.assert_array_equal(got[2], 0.0)  # lse does not depend on v


@pytest.mark.parametrize("causal", [False, True])
def test_platform_path_grads_equal_reference_grads(built, causal):
    # On CPU the per-platform path runs the reference branch inside custom_vjp; its
    # gradients (reference VJP in _vjp._bwd) must match plain autodiff of the reference.
    q, k, v = _inputs(2, 11, 7, 2, 64, jnp.bfloat16)
    kw = jax.random.normal(jax.random.key(1), (2, 11, 2, 64))
    kl = jax.random.normal(jax.random.key(2), (2, 2, 11))
    grads = {}
    for impl in (None, "reference"):
        attn = functools.partial(jax_fa4.attention, causal=causal, implementation=impl)
        grads[impl] = jax.jit(jax.grad(_loss(attn, kw, kl), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(grads[None], grads["reference"]):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(a.astype(jnp.float32), b.astype(jnp.float32),
                                   atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("d,dv,kernel", [(80, 80, (96, 96)), (160, 96, (192, 128))])
def test_zero_padded_head_dims_equal_the_reference(built, d, dv, kernel):
    # Head dims without their own kernel run a larger one on zero-padded q, k, v (here
    # the platform path, the reference standing in for the kernel): out, lse and the
    # gradients equal the unpadded reference's, and keep D and Dv. (D 192 / Dv 128 had
    # been a case: it has kernels of its own, so nothing was padded.)
    q, k, _ = _inputs(2, 11, 7, 2, d, jnp.bfloat16)
    v = jax.random.normal(jax.random.key(3), (2, 7, 2, dv), jnp.float32).astype(jnp.bfloat16)
    spec = _api._plan(q, k, v, causal=True, softmax_scale=None, return_lse=True,
                      implementation=None)
    assert _kernel_select.kernel_head_dims(spec) == kernel
    kw = jax.random.normal(jax.random.key(1), (2, 11, 2, dv))
    kl = jax.random.normal(jax.random.key(2), (2, 2, 11))
    results = {}
    for impl in (None, "reference"):
        attn = functools.partial(jax_fa4.attention, causal=True, implementation=impl)
        results[impl] = jax.jit(jax.value_and_grad(_loss(attn, kw, kl), argnums=(0, 1, 2)))(
            q, k, v)
    (value, grads), (want_value, want_grads) = results[None], results["reference"]
    np.testing.assert_allclose(value, want_value, rtol=1e-3)
    for g, w, x in zip(grads, want_grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        np.testing.assert_allclose(g.astype(jnp.float32), w.astype(jnp.float32),
                                   atol=1e-2, rtol=1e-2)


def test_platform_path_under_vmap_and_scan(built):
    q, k, v = _inputs(6, 5, 9, 2, 64, jnp.bfloat16)
    attn = functools.partial(jax_fa4.attention, causal=True)
    want = attn(q, k, v, implementation="reference")
    groups = lambda x: x.reshape(2, 3, *x.shape[1:])
    close = functools.partial(np.testing.assert_allclose, atol=1e-2, rtol=1e-2)  # bf16
    got = jax.jit(jax.vmap(attn))(groups(q), groups(k), groups(v))
    close(got.reshape(want.shape).astype(jnp.float32), want.astype(jnp.float32))
    got = jax.jit(jax.vmap(attn, in_axes=(0, None, None)))(groups(q), k[:3], v[:3])
    want = attn(q[3:], k[:3], v[:3], implementation="reference")
    close(got[1].astype(jnp.float32), want.astype(jnp.float32))

    def scanned(qs):
        return jax.lax.scan(lambda c, q: (c, attn(q, k[:3], v[:3])), 0, qs)[1]

    got = jax.jit(scanned)(groups(q))
    want = attn(q[:3], k[:3], v[:3], implementation="reference")
    close(got[0].astype(jnp.float32), want.astype(jnp.float32))


def test_platform_path_vmap_of_grad(built):
    q, k, v = _inputs(4, 6, 9, 2, 64, jnp.bfloat16)
    split = lambda x: x.reshape(2, 2, *x.shape[1:])

    def grads(implementation):
        attn = functools.partial(jax_fa4.attention, causal=True, implementation=implementation)
        loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2)
        return jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(split(q), split(k), split(v))

    for a, b in zip(grads(None), grads("reference")):
        np.testing.assert_allclose(a.astype(jnp.float32), b.astype(jnp.float32),
                                   atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("implementation", [None, "reference"])
@pytest.mark.parametrize("b,sq,sk,h", [(0, 5, 7, 2), (2, 0, 7, 2), (2, 5, 7, 0), (2, 5, 0, 2),
                                       (0, 0, 0, 0)])
def test_zero_size(implementation, b, sq, sk, h):
    q = jnp.ones((b, sq, h, 64), jnp.bfloat16)
    k = jnp.ones((b, sk, h, 64), jnp.bfloat16)
    attn = functools.partial(jax_fa4.attention, return_lse=True, implementation=implementation)
    out, lse = jax.jit(attn)(q, k, k)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, h, sq) and lse.dtype == jnp.float32
    np.testing.assert_array_equal(out, 0.0)
    assert bool(jnp.all(jnp.isneginf(lse)))
    dq = jax.grad(lambda q: jnp.sum(attn(q, k, k)[0].astype(jnp.float32)))(q)
    np.testing.assert_array_equal(dq, 0.0)


# The keys of every kernels() entry as its docstring lists them; backward ones add dq_parts.
KERNEL_KEYS = {"name", "kind", "arch", "dtype", "kv_dtype", "head_dim", "head_dim_v", "banded",
               "softcap", "segments", "split", "paged", "keys_as_m", "long_rows", "tile_m",
               "tile_n",
               "ctas_per_sm"}


def test_kernels_lists_the_built_manifest(expected_manifest):
    kernels = jax_fa4.kernels()
    if _registry.native_reason():
        assert kernels == []
        return
    by_name = functools.partial(sorted, key=lambda entry: entry["name"])
    assert by_name(kernels) == by_name(expected_manifest)
    for entry in kernels:
        keys = KERNEL_KEYS | ({"dq_parts"} if entry["kind"] == "bwd" else set())
        assert set(entry) == keys, entry
    # kernels() returns a copy: changing the list or an entry does not reach the next call.
    kernels[0]["tile_m"] = 0
    kernels.pop()
    assert by_name(jax_fa4.kernels()) == by_name(expected_manifest)


def test_public_surface():
    assert sorted(jax_fa4.__all__) == ["attention", "attention_varlen",
                                       "dot_product_attention", "kernels", "paged_attention",
                                       "ring_attention", "supports", "unzigzag", "zigzag"]
    assert "B batch" in " ".join(jax_fa4.__doc__.split())
