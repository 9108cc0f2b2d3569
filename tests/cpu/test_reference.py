"""The pure-JAX reference against jax.nn.dot_product_attention and against its contract."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fa4._reference import reference_attention

TOL = dict(atol=2e-5, rtol=2e-5)


def _inputs(b, sq, sk, h, d, dtype=jnp.float32, seed=0):
    kq, kk, kv, kw = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, sk, h, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, sk, h, d), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (b, sq, h, d), jnp.float32)
    return q, k, v, w


def _jax_nn(q, k, v, *, causal, softmax_scale):
    # jax.nn's causal mask is top-left aligned: it equals ours only when Sq == Sk.
    return jax.nn.dot_product_attention(q, k, v, scale=softmax_scale, is_causal=causal,
                                        implementation="xla")


def _ours(q, k, v, *, causal, softmax_scale):
    return reference_attention(q, k, v, causal=causal, softmax_scale=softmax_scale)[0]


# (B, Sq, Sk, H, D, causal, softmax_scale)
CASES = [
    (1, 1, 1, 1, 8, False, None),
    (2, 17, 113, 3, 32, False, None),
    (3, 128, 64, 2, 64, False, 0.3),
    (1, 5, 239, 4, 16, False, None),
    (2, 129, 1, 1, 128, False, None),
    (1, 1, 1, 2, 8, True, None),
    (2, 33, 33, 1, 128, True, None),
    (1, 127, 127, 3, 64, True, 0.05),
]


@pytest.mark.parametrize("b,sq,sk,h,d,causal,scale", CASES)
def test_matches_jax_nn_value_and_grads(b, sq, sk, h, d, causal, scale):
    q, k, v, w = _inputs(b, sq, sk, h, d)
    scale = d ** -0.5 if scale is None else scale
    results = {}
    for name, fn in (("ours", _ours), ("jax_nn", _jax_nn)):
        f = functools.partial(fn, causal=causal, softmax_scale=scale)
        loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v) * w)
        out = jax.jit(f)(q, k, v)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        results[name] = (out, *grads)
    for label, a, b_ in zip(("out", "dq", "dk", "dv"), results["ours"], results["jax_nn"]):
        np.testing.assert_allclose(a, b_, err_msg=label, **TOL)


@pytest.mark.parametrize("sq,sk", [(7, 3), (239, 1), (5, 5), (3, 17)])
def test_lse_is_logsumexp_of_visible_scores(sq, sk):
    q, k, v, _ = _inputs(2, sq, sk, 3, 16)
    scale = 0.7
    _, lse = reference_attention(q, k, v, causal=True, softmax_scale=scale)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    visible = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
    expected = jax.nn.logsumexp(jnp.where(visible, s, -jnp.inf), axis=-1)
    assert lse.shape == (2, 3, sq) and lse.dtype == jnp.float32
    np.testing.assert_array_equal(jnp.isneginf(lse), jnp.isneginf(expected))
    np.testing.assert_allclose(lse, expected, **TOL)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16", "float16"])
def test_rows_without_visible_key(compute_dtype):
    # Causal with Sq > Sk: query rows i < Sq - Sk see no key.
    sq, sk = 7, 3
    q, k, v, w = _inputs(2, sq, sk, 2, 16)
    f = functools.partial(reference_attention, causal=True, softmax_scale=0.25,
                          compute_dtype=compute_dtype)
    out, lse = f(q, k, v)
    blind = sq - sk
    np.testing.assert_array_equal(out[:, :blind], 0.0)
    assert bool(jnp.all(jnp.isneginf(lse[..., :blind])))
    assert bool(jnp.all(jnp.isfinite(lse[..., blind:])))
    assert bool(jnp.all(jnp.isfinite(out)))

    def loss(q, k, v):
        out, lse = f(q, k, v)
        return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert bool(jnp.all(jnp.isfinite(g))), name
    # Blind rows do not depend on q at all.
    np.testing.assert_array_equal(grads[0][:, :blind], 0.0)


def test_low_precision_compute_is_close_but_not_exact():
    # The GPU numerics rule needs the reference run in the input dtype: it must differ
    # from the float32 reference, but only by low-precision rounding.
    q, k, v, _ = _inputs(2, 65, 97, 2, 64, dtype=jnp.bfloat16)
    kw = dict(causal=True, softmax_scale=0.125)
    out32, lse32 = reference_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                       v.astype(jnp.float32), **kw)
    out_lp, lse_lp = reference_attention(q, k, v, compute_dtype=q.dtype, **kw)
    assert out_lp.dtype == jnp.bfloat16 and lse_lp.dtype == jnp.float32
    err = float(jnp.max(jnp.abs(out_lp.astype(jnp.float32) - out32)))
    assert 0 < err < 0.1
    assert 0 < float(jnp.max(jnp.abs(lse_lp - lse32))) < 0.1


def test_out_dtype_follows_input():
    q, k, v, _ = _inputs(1, 4, 6, 1, 8, dtype=jnp.float16)
    out, lse = reference_attention(q, k, v, causal=False, softmax_scale=0.3)
    assert out.dtype == jnp.float16 and lse.dtype == jnp.float32


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(17, 17), (23, 9), (9, 23)])
@pytest.mark.parametrize("heads,heads_kv", [(3, 3), (6, 2), (4, 1)])
def test_reference_backward_matches_autodiff(causal, sq, sk, heads, heads_kv, softcap):
    # The explicit FlashAttention backward (the backward kernels' contract) equals
    # autodiff of the reference, with an lse cotangent, rows that see no key, GQA/MQA
    # and softcap (cap 1.5 against scores of a few units: tanh saturates).
    from jax_fa4._reference import reference_backward

    keys = jax.random.split(jax.random.key(7), 5)
    q = jax.random.normal(keys[0], (2, sq, heads, 16), jnp.float32)
    k = jax.random.normal(keys[1], (2, sk, heads_kv, 16), jnp.float32)
    v = jax.random.normal(keys[2], (2, sk, heads_kv, 16), jnp.float32)
    dout = jax.random.normal(keys[3], (2, sq, heads, 16), jnp.float32)
    dlse = jax.random.normal(keys[4], (2, heads, sq), jnp.float32)
    fwd = functools.partial(reference_attention, causal=causal, softmax_scale=0.3,
                            softcap=softcap)
    (out, lse), vjp = jax.vjp(fwd, q, k, v)
    want = vjp((dout, dlse))
    got = reference_backward(q, k, v, out, lse, dout, dlse, causal=causal, softmax_scale=0.3,
                             softcap=softcap)
    for g, w in zip(got, want):
        assert bool(jnp.all(jnp.isfinite(g)))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
