"""The kernel under JAX transformations on the GPU: jit over many shapes, scan, vmap,
grad (kernel forward + reference backward), determinism, default path selection."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4

pytestmark = pytest.mark.gpu

cute = functools.partial(jax_fa4.attention, return_lse=True, implementation="cute")


def _qkv(fa, b, sq, sk, h=4, d=128, dtype=jnp.bfloat16, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (fa.normal(kq, (b, sq, h, d), dtype), fa.normal(kk, (b, sk, h, d), dtype),
            fa.normal(kv, (b, sk, h, d), dtype))


def _bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("causal", [False, True])
def test_bitwise_deterministic(fa, causal):
    q, k, v = _qkv(fa, 3, 1000, 1000)
    f = jax.jit(functools.partial(cute, causal=causal))
    first = f(q, k, v)
    for _ in range(2):
        again = f(q, k, v)
        assert _bits_equal(again[0], first[0]) and _bits_equal(again[1], first[1])


def test_one_kernel_many_shapes_under_jit(fa):
    f = jax.jit(functools.partial(cute, causal=True))
    for seed, (b, sq, sk) in enumerate([(1, 1, 1), (2, 17, 113), (3, 128, 128), (1, 1000, 239),
                                        (2, 300, 4224)]):
        q, k, v = _qkv(fa, b, sq, sk, seed=seed)
        out, lse = f(q, k, v)
        fa.assert_attention(f"b{b} sq{sq} sk{sk}", out, lse, q, k, v, causal=True)


def test_scan_over_queries(fa):
    steps, (q, k, v) = 4, _qkv(fa, 2, 500, 700)
    qs = jnp.stack([fa.normal(jax.random.key(10 + t), q.shape, q.dtype) for t in range(steps)])

    @jax.jit
    def scanned(qs, k, v):
        def step(acc, q):
            out, lse = cute(q, k, v, causal=True)
            return acc + lse, out
        return jax.lax.scan(step, jnp.zeros((2, 4, 500), jnp.float32), qs)

    acc, outs = scanned(qs, k, v)
    direct = jax.jit(functools.partial(cute, causal=True))
    lse_sum = 0
    for t in range(steps):
        out, lse = direct(qs[t], k, v)
        assert _bits_equal(outs[t], out), f"step {t}: scan differs from a direct call"
        fa.assert_attention(f"step {t}", outs[t], lse, qs[t], k, v, causal=True)
        lse_sum = lse_sum + lse
    np.testing.assert_allclose(acc, lse_sum, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kv_batched", [True, False])
def test_vmap_matches_per_slice_calls(fa, kv_batched):
    groups = 2
    q, k, v = _qkv(fa, 3 * groups, 129, 1000)
    split = lambda x: x.reshape(groups, 3, *x.shape[1:])
    qg = split(q)
    if kv_batched:
        kg, vg, in_axes = split(k), split(v), 0
    else:
        kg, vg, in_axes = k[:3], v[:3], (0, None, None)
    f = functools.partial(cute, causal=True)
    outs, lses = jax.jit(jax.vmap(f, in_axes=in_axes))(qg, kg, vg)
    single = jax.jit(f)
    for g in range(groups):
        kk, vv = (kg[g], vg[g]) if kv_batched else (kg, vg)
        out, lse = single(qg[g], kk, vv)
        # Leading axes fold into the batch: each (batch, head) is the same computation.
        assert _bits_equal(outs[g], out) and _bits_equal(lses[g], lse), f"group {g}"
        fa.assert_attention(f"group {g}", outs[g], lses[g], qg[g], kk, vv, causal=True)


def _loss(attn, w_out, w_lse):
    def loss(q, k, v):
        out, lse = attn(q, k, v)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(finite_lse * w_lse)
    return loss


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_grads_follow_the_rule(fa, dtype, causal):
    from jax_fa4._reference import reference_attention

    q, k, v = _qkv(fa, 2, 239, 113, d=64, dtype=dtype)
    w_out = jax.random.normal(jax.random.key(7), q.shape)
    w_lse = jax.random.normal(jax.random.key(8), (2, 4, 239))
    scale = 64 ** -0.5

    def grads(attn, *args):
        return jax.jit(jax.grad(_loss(attn, w_out, w_lse), argnums=(0, 1, 2)))(*args)

    got = grads(functools.partial(cute, causal=causal), q, k, v)
    ref = grads(functools.partial(reference_attention, causal=causal, softmax_scale=scale),
                *(x.astype(jnp.float32) for x in (q, k, v)))
    lp = grads(functools.partial(reference_attention, causal=causal, softmax_scale=scale,
                                 compute_dtype=dtype), q, k, v)
    for name, g, r, l in zip(("dq", "dk", "dv"), got, ref, lp):
        assert g.dtype == q.dtype
        fa.assert_rule(name, g, r, l)


def test_vmap_of_grad(fa):
    q, k, v = _qkv(fa, 4, 65, 77, d=64)
    w = jax.random.normal(jax.random.key(3), (2, 2, 65, 4, 64))
    loss = lambda q, k, v, w: jnp.sum(cute(q, k, v, causal=True)[0].astype(jnp.float32) * w)
    split = lambda x: x.reshape(2, 2, *x.shape[1:])
    batched = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(split(q), split(k), split(v), w)
    single = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for g in range(2):
        for b, s in zip(batched, single(split(q)[g], split(k)[g], split(v)[g], w[g])):
            np.testing.assert_allclose(b[g].astype(jnp.float32), s.astype(jnp.float32),
                                       atol=1e-2, rtol=1e-2)


def test_default_picks_the_kernel(fa):
    q, k, v = _qkv(fa, 2, 300, 400)
    f = jax.jit(functools.partial(jax_fa4.attention, causal=True, return_lse=True))
    lowered = f.lower(q, k, v)
    assert "stablehlo.custom_call @jax_fa4_fwd" in lowered.as_text()
    assert "jax_fa4_fwd" in lowered.compile().as_text()
    out, lse = f(q, k, v)
    out_cute, lse_cute = jax.jit(functools.partial(cute, causal=True))(q, k, v)
    assert _bits_equal(out, out_cute) and _bits_equal(lse, lse_cute)
    ok, reason = jax_fa4.supports(q, k, v, causal=True)
    assert ok and reason == ""
