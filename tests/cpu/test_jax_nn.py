"""jax_fa4.dot_product_attention against jax.nn.dot_product_attention's XLA path on the
CPU: the same arguments give the same out, residual and gradients (rank 3 and 4, GQA,
causal, windows with and without causal, lengths, a given scale), except rows that see
no key, where jax_fa4 gives 0 / -inf (documented). What jax_fa4 does not compute runs
jax.nn itself, with a warning. tests/gpu/test_gpu_jax_nn.py compares with cuDNN."""

import functools
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _masks

B, T, S, N, K, H = 2, 24, 40, 4, 2, 64
LENGTHS = {"query_seq_lengths": [T, 11], "key_value_seq_lengths": [S - 3, 17]}


def _inputs(rank, t=T, s=S, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 4)
    lead = (B,) if rank == 4 else ()
    q = jax.random.normal(keys[0], (*lead, t, N, H), dtype)
    k, v = (jax.random.normal(key, (*lead, s, K, H), dtype) for key in keys[1:3])
    dout = jax.random.normal(keys[3], (*lead, t, N, H), jnp.float32)
    return q, k, v, dout


def _sees_a_key(t, s, *, is_causal, local_window_size, query_seq_lengths=None,
                key_value_seq_lengths=None):
    """bool (B, T): query rows inside their length that see at least one key."""
    window = local_window_size
    if isinstance(window, int):
        window = (window, window)
    visible = _masks.padded(t, s, causal=is_causal, alignment="top_left",
                            window=None if window is None else
                            (window[0], None if is_causal else window[1]),
                            q_lengths=query_seq_lengths, kv_lengths=key_value_seq_lengths)
    mask = visible.mask if visible.mask is not None else jnp.ones((t, s), bool)
    return jnp.broadcast_to(mask.any(-1), (B, t))


# rank, is_causal, local_window_size, lengths (which need a batch axis: rank 4 only).
CASES = [c for c in itertools.product((4, 3), (False, True), (None, 5, (3, 2), (6, 1)),
                                      (False, True)) if c[0] == 4 or not c[3]]


@pytest.mark.parametrize("rank,is_causal,window,lengths", CASES)
def test_equals_jax_nn(rank, is_causal, window, lengths):
    q, k, v, dout = _inputs(rank)
    kwargs = dict(is_causal=is_causal, local_window_size=window, scale=0.2)
    if lengths:
        kwargs.update({n: jnp.array(x, jnp.int32) for n, x in LENGTHS.items()})
    sees = _sees_a_key(T, S, is_causal=is_causal, local_window_size=window,
                       **{n: kwargs.get(n) for n in LENGTHS})
    sees = sees[0] if rank == 3 else sees
    rows = np.asarray(sees)[..., None, None]
    # No cotangent on rows that see no key: jax.nn gives them the values' average (and
    # a gradient through it), jax_fa4 zeros. Elsewhere the gradients must agree.
    dout = jnp.where(rows, dout, 0)

    def run(fn):
        def loss(q, k, v):
            out, residual = fn(q, k, v, **kwargs, return_residual=True)
            return jnp.sum(out * dout), (out, residual)

        (_, (out, residual)), grads = jax.jit(jax.value_and_grad(
            loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return out, residual, grads

    out, residual, grads = run(jax_fa4.dot_product_attention)
    ref_out, ref_residual, ref_grads = run(functools.partial(jax.nn.dot_product_attention,
                                                             implementation="xla"))
    assert out.shape == ref_out.shape and residual.shape == ref_residual.shape
    assert residual.dtype == ref_residual.dtype
    np.testing.assert_allclose(np.where(rows, out, 0), np.where(rows, ref_out, 0), atol=2e-5)
    if lengths:  # padded query rows are 0 on both
        np.testing.assert_array_equal(np.where(rows, 0, out), np.zeros_like(out))
    np.testing.assert_allclose(np.where(rows[..., 0], residual, 0),
                               np.where(rows[..., 0], ref_residual, 0), atol=2e-5)
    assert np.isneginf(np.where(rows[..., 0], -np.inf, residual)).all()
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=5e-5)


def test_bf16_residual_in_the_input_dtype():
    q, k, v, _ = _inputs(4, dtype=jnp.bfloat16)
    out, residual = jax_fa4.dot_product_attention(q, k, v, is_causal=True,
                                                  return_residual=True)
    ref_out, ref_residual = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                         return_residual=True)
    assert residual.dtype == ref_residual.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               atol=2e-2)
    np.testing.assert_allclose(np.asarray(residual, np.float32),
                               np.asarray(ref_residual, np.float32), rtol=1e-2)


def test_a_concrete_causal_mask_is_read():
    q, k, v, _ = _inputs(4, s=T)
    mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = jax_fa4.dot_product_attention(q, k, v, mask=mask)
    want = jax_fa4.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("what,kwargs", [
    ("an additive bias", dict(bias=jnp.full((1, 1, T, S), 0.5))),
    ("a mask other than", dict(mask=jnp.arange(S)[None, None, None, :] % 3 > 0)),
    # Keys only after the query, or (with causal) only some way before it: the causal
    # call's right side had been replaced by 0, a silently wider band.
    ("a local_window_size with a negative side", dict(local_window_size=(-1, 3))),
    ("a local_window_size with a negative side",
     dict(is_causal=True, local_window_size=(4, -2))),
])
def test_what_jax_fa4_lacks_runs_jax_nn_with_a_warning(what, kwargs):
    q, k, v, _ = _inputs(4)
    with pytest.warns(RuntimeWarning, match=f"jax_fa4 does not take {what}"):
        got = jax_fa4.dot_product_attention(q, k, v, **kwargs)
    np.testing.assert_array_equal(got, jax.nn.dot_product_attention(q, k, v, **kwargs))


def test_a_traced_mask_runs_jax_nn():
    q, k, v, _ = _inputs(4)
    mask = jnp.arange(S)[None, None, None, :] % 3 > 0
    with pytest.warns(RuntimeWarning, match="a traced mask"):
        got = jax.jit(lambda m: jax_fa4.dot_product_attention(q, k, v, mask=m))(mask)
    np.testing.assert_allclose(got, jax.nn.dot_product_attention(q, k, v, mask=mask),
                               atol=1e-6)


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_jax_nn_implementations_pass_through(monkeypatch, implementation):
    calls = []
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, **kw: calls.append(kw["implementation"]) or "jax.nn")
    q, k, v, _ = _inputs(4)
    assert jax_fa4.dot_product_attention(q, k, v, implementation=implementation) == "jax.nn"
    assert calls == [implementation]


@pytest.mark.parametrize("args,kwargs,match", [
    ((jnp.zeros((B, T, N, H)), jnp.zeros((B, S, K, H)), jnp.zeros((B, S, K, 32))), {},
     r"value shape should be \(2, 40, 2, 64\)"),
    ((jnp.zeros((B, T, 3, H)), jnp.zeros((B, S, K, H)), jnp.zeros((B, S, K, H))), {},
     "must be a multiple of key/value heads"),
    ((jnp.zeros((B, T, N, H)), jnp.zeros((B, S, K, H)), jnp.zeros((B, S, K, H))),
     dict(query_seq_lengths=jnp.zeros((3,), jnp.int32)),
     r"query_seq_lengths shape should be \[2\]"),
    ((jnp.zeros((T, N, H)), jnp.zeros((B, S, K, H)), jnp.zeros((B, S, K, H))), {},
     "same rank"),
    ((jnp.zeros((B, T, N, H)),) * 3, dict(implementation="flash"),
     "Unsupported implementation option: flash"),
    # An all-visible mask had been read without its dtype or shape checked.
    ((jnp.zeros((B, T, N, H)),) * 3, dict(mask=jnp.ones((T, T), jnp.float32)),
     "mask dtype should be bool, but got float32"),
    ((jnp.zeros((B, T, N, H)),) * 3, dict(mask=jnp.ones((T - 1, T), bool)),
     rf"mask shape \({T - 1}, {T}\) does not broadcast to the attention scores' shape"),
    # It had been "too many values to unpack", naming no argument.
    ((jnp.zeros((B, T, N, H)),) * 3, dict(local_window_size=(1, 2, 3)),
     r"local_window_size must be None, an int or a tuple \(left, right\) of ints; "
     r"got \(1, 2, 3\)"),
    ((jnp.zeros((B, T, N, H)),) * 3, dict(local_window_size=2.5), "local_window_size"),
])
def test_malformed_input_is_refused_like_jax_nn(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        jax_fa4.dot_product_attention(*args, **kwargs)


def test_rank3_inputs_take_a_rank4_mask_like_jax_nn():
    # jax.nn pads rank-3 inputs and their mask to rank 4: a (1, 1, T, S) mask applies (it
    # had been checked against the rank-3 scores' shape and refused).
    q, k, v, _ = _inputs(3)
    mask = jnp.tril(jnp.ones((T, S), bool))[None, None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = jax_fa4.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(got, jax.nn.dot_product_attention(q, k, v, mask=mask),
                               atol=1e-5)


def test_a_concrete_jax_scalar_scale_is_taken_like_jax_nn():
    q, k, v, _ = _inputs(4)
    want = jax_fa4.dot_product_attention(q, k, v, scale=0.25)
    for scale in (jnp.float32(0.25), jnp.array(0.25)):
        np.testing.assert_array_equal(jax_fa4.dot_product_attention(q, k, v, scale=scale), want)


def test_array_likes_and_concrete_flags_are_taken_like_jax_nn():
    q, k, v, _ = _inputs(4, t=4, s=4)
    want = jax_fa4.dot_product_attention(q, k, v, scale=0.25, is_causal=True)
    got = jax_fa4.dot_product_attention(
        np.asarray(q).tolist(), np.asarray(k), v, scale=jnp.array([0.25]),
        is_causal=jnp.bool_(True))
    np.testing.assert_array_equal(got, want)
    mask = np.tril(np.ones((4, 4), bool)).tolist()
    np.testing.assert_array_equal(jax_fa4.dot_product_attention(q, k, v, scale=0.25,
                                                                mask=mask), want)


@pytest.mark.parametrize("mask", [jnp.ones((T, S), bool), jnp.tril(jnp.ones((T, S), bool))])
def test_exports_with_a_symbolic_batch_and_a_mask(mask):
    # The mask's shape check had run NumPy's broadcast on the symbolic batch (TypeError).
    (b,) = jax.export.symbolic_shape("b")
    q, k, v, _ = _inputs(4)

    def fn(q, k, v):
        return jax_fa4.dot_product_attention(q, k, v, mask=mask)

    args = [jax.ShapeDtypeStruct((b, *x.shape[1:]), x.dtype) for x in (q, k, v)]
    exported = jax.export.export(jax.jit(fn))(*args)
    np.testing.assert_allclose(exported.call(q, k, v), fn(q, k, v), rtol=1e-6, atol=1e-6)
