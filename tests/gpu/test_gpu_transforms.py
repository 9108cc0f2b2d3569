"""The kernels under JAX transformations on the GPU: jit over many shapes, scan, vmap,
grad (kernel forward and backward) in jit and in scan, vmap of grad, determinism of forward and deterministic backward, default path
selection."""

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
@pytest.mark.parametrize("head_dim,deterministic",
                         [(64, False), (128, True), (256, False), (256, True)])
def test_grads_follow_the_rule(fa, dtype, causal, head_dim, deterministic):
    # jax.grad in jit of a loss of out and lse.
    q, k, v = _qkv(fa, 2, 239, 113, d=head_dim, dtype=dtype)
    w_out = jax.random.normal(jax.random.key(7), q.shape)
    w_lse = jax.random.normal(jax.random.key(8), (2, 4, 239))
    attn = functools.partial(cute, causal=causal, deterministic=deterministic)
    got = jax.jit(jax.grad(_loss(attn, w_out, w_lse), argnums=(0, 1, 2)))(q, k, v)
    # The loss's cotangents: dout = w_out rounded to the dtype of out, dlse = w_lse where
    # lse is finite.
    _, lse = jax.jit(attn)(q, k, v)
    dlse = jnp.where(jnp.isfinite(lse), w_lse, 0.0)
    fa.assert_gradients("grad", got, q, k, v, w_out.astype(q.dtype), dlse, causal=causal)


@pytest.mark.parametrize("head_dim", [128, 256])  # bulk adds from staging; adds from registers
def test_backward_bitwise_deterministic(fa, head_dim):
    # Several key blocks per query tile, so several CTAs add into each dq tile.
    q, k, v = _qkv(fa, 2, 1000, 1000, h=3, d=head_dim)
    dout = fa.normal(jax.random.key(5), q.shape, q.dtype)
    dlse = jax.random.normal(jax.random.key(6), (2, 3, 1000))
    attn = functools.partial(cute, causal=True, deterministic=True)

    @jax.jit
    def backward(q, k, v, dout, dlse):
        return jax.vjp(attn, q, k, v)[1]((dout, dlse))

    first = jax.device_get(backward(q, k, v, dout, dlse))
    fa.assert_gradients("deterministic", first, q, k, v, dout, dlse, causal=True)
    for run in range(100):
        again = backward(q, k, v, dout, dlse)
        for name, a, b in zip(("dq", "dk", "dv"), again, first):
            assert _bits_equal(a, b), f"run {run}: {name} differs from the first run"


def test_grad_in_scan(fa):
    steps, (q, k, v) = 3, _qkv(fa, 2, 300, 500, d=64)
    qs = jnp.stack([fa.normal(jax.random.key(20 + t), q.shape, q.dtype) for t in range(steps)])
    w_out = jax.random.normal(jax.random.key(9), q.shape)
    w_lse = jax.random.normal(jax.random.key(10), (2, 4, 300))
    attn = functools.partial(cute, causal=True, deterministic=True)
    grad = jax.grad(_loss(attn, w_out, w_lse), argnums=(0, 1, 2))

    @jax.jit
    def scanned(qs, k, v):
        def step(dk_sum, q):
            dq, dk, _ = grad(q, k, v)
            return dk_sum + dk.astype(jnp.float32), dq
        return jax.lax.scan(step, jnp.zeros(k.shape, jnp.float32), qs)

    dk_sum, dqs = scanned(qs, k, v)
    direct = jax.jit(grad)
    want = jnp.zeros(k.shape, jnp.float32)
    for t in range(steps):
        dq, dk, _ = direct(qs[t], k, v)
        # Deterministic mode: the same bits in the loop as in a direct call.
        assert _bits_equal(dqs[t], dq), f"step {t}: scan differs from a direct call"
        want = want + dk.astype(jnp.float32)
    np.testing.assert_allclose(dk_sum, want, rtol=1e-6, atol=1e-6)


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
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[1]), argnums=(0, 1, 2)))
    assert "jax_fa4_bwd" in grad.lower(q, k, v).compile().as_text()
    ok, reason = jax_fa4.supports(q, k, v, causal=True)
    assert ok and reason == ""
