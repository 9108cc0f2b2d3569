"""The features of `attention` / `attention_varlen` on the reference path: GQA/MQA,
alignment, windows, segment ids, lengths, softcap, sinks, Dv != D, varlen.

Oracle: a dense implementation written here from the documented contract (a boolean mask
built with Python loops, K/V repeated per query head, the sink as an extra column), and
jax.nn.dot_product_attention(implementation="xla") where it has the same feature.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_fa4
from jax_fa4._api import _add_sinks
from jax_fa4._reference import reference_attention

TOL = dict(atol=5e-5, rtol=5e-5)
NEG = -1e30  # a finite "masked" logit for the oracle's softmax


# ---------------------------------------------------------------- the dense oracle

def visible_mask(b, sq, sk, *, causal=False, alignment="bottom_right", window=None,
                 q_segment_ids=None, kv_segment_ids=None, q_lengths=None, kv_lengths=None):
    """numpy bool (B, Sq, Sk) "query i sees key j" and (B, Sq) "row i is a query",
    straight from the docstring of jax_fa4.attention."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0
    mask = np.zeros((b, sq, sk), bool)
    valid = np.ones((b, sq), bool)
    for n in range(b):
        lq = sq if q_lengths is None else min(max(int(q_lengths[n]), 0), sq)
        lk = sk if kv_lengths is None else min(max(int(kv_lengths[n]), 0), sk)
        for i in range(sq):
            valid[n, i] = i < lq
            a = i + lk - lq if alignment == "bottom_right" else i
            for j in range(sk):
                ok = valid[n, i] and j < lk
                ok = ok and (left is None or j >= a - left)
                ok = ok and (right is None or j <= a + right)
                if q_segment_ids is not None:
                    ok = ok and q_segment_ids[n, i] == kv_segment_ids[n, j]
                mask[n, i, j] = ok
    return mask, valid


def dense_attention(q, k, v, mask, valid, *, scale, softcap=None, sinks=None):
    """out (B, Sq, Hq, Dv), lse (B, Hq, Sq) with an explicit mask; no tricks."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask[:, None], s, NEG)
    sink = jnp.full((q.shape[2],), NEG) if sinks is None else sinks
    z = jnp.concatenate([s, jnp.broadcast_to(sink[None, :, None, None], (*s.shape[:3], 1))],
                        axis=-1)
    p = jax.nn.softmax(z, axis=-1)[..., :-1]
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")
    lse = jax.nn.logsumexp(z, axis=-1)
    # Rows that are queries and see a key or a sink; the rest: out = 0, lse = -inf.
    live = valid[:, None, :] & (mask.any(-1)[:, None, :] | (sinks is not None))
    out = jnp.where(jnp.transpose(live, (0, 2, 1))[..., None], out, 0.0)
    return out, jnp.where(live, lse, -jnp.inf)


def _loss(fn, w, wl):
    """fn(q, k, v, sinks) -> (out, lse); a scalar that sends cotangents into both."""
    def loss(q, k, v, sinks):
        out, lse = fn(q, k, v, sinks)
        return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * wl)
    return loss


def _normal(rng, shape):
    # numpy, not jax.random: each new shape of jax.random.normal costs a compilation.
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _inputs(b, sq, sk, hq, hkv, d, dv, seed=0):
    """q, k, v, sinks, and weights for out and lse in a loss."""
    rng = np.random.default_rng(seed)
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv), (hq,), (b, sq, hq, dv),
              (b, hq, sq))
    return tuple(_normal(rng, shape) for shape in shapes)


def _segments(b, s, seed, num=3):
    rng = np.random.default_rng(seed)
    return np.sort(rng.integers(0, num, (b, s)), axis=1).astype(np.int32)


# ------------------------------------------------- reference vs oracle, value and grads

# (B, Sq, Sk, Hq, Hkv, D, Dv, attention kwargs; "segments" and "lengths" make arrays)
CASES = {
    "gqa_4_2_causal": (2, 5, 9, 4, 2, 8, 8, dict(causal=True)),
    "mqa_4_1_causal_blind_rows": (2, 9, 5, 4, 1, 8, 8, dict(causal=True)),
    "top_left_causal": (2, 9, 5, 4, 2, 8, 8, dict(causal=True, alignment="top_left")),
    "window_2_1": (2, 7, 11, 2, 2, 8, 8, dict(window=(2, 1))),
    "window_right_only_top_left": (1, 7, 5, 2, 1, 8, 8,
                                   dict(window=(None, 2), alignment="top_left")),
    "window_left_causal_blind_rows": (2, 9, 6, 2, 2, 8, 8, dict(window=(2, None), causal=True)),
    "window_diagonal": (1, 6, 6, 2, 2, 8, 8, dict(window=(0, 0))),
    "segments_causal": (3, 10, 10, 4, 2, 8, 8, dict(causal=True, segments=True)),
    "lengths": (3, 6, 8, 2, 2, 8, 8, dict(lengths=([6, 0, 3], [5, 8, 0]))),
    "lengths_causal": (3, 6, 8, 4, 2, 8, 8, dict(causal=True, lengths=([2, 6, 4], [7, 3, 9]))),
    "q_lengths_only_window": (2, 6, 8, 2, 2, 8, 8, dict(window=(1, 1), lengths=([4, 6], None))),
    "kv_lengths_only_sinks": (2, 6, 5, 2, 1, 8, 8,
                              dict(causal=True, sinks=True, lengths=(None, [0, 3]))),
    "softcap_causal": (2, 7, 5, 4, 2, 8, 8, dict(softcap=0.5, causal=True)),
    "sinks_causal_blind_rows": (2, 9, 4, 4, 4, 12, 8, dict(sinks=True, causal=True)),
    "all_bottom_right": (3, 11, 9, 4, 2, 12, 8,
                         dict(causal=True, window=(3, None), segments=True, softcap=1.5,
                              sinks=True, lengths=([11, 7, 0], [9, 6, 5]))),
    "all_top_left": (2, 9, 11, 4, 1, 8, 16,
                     dict(window=(2, 1), alignment="top_left", segments=True, softcap=3.0,
                          sinks=True, lengths=([9, 5], [4, 11]))),
}


def _case_arrays(name, b, sq, sk, options):
    """Splits a case's options into attention's static kwargs and its runtime arrays."""
    options = dict(options)
    with_sinks = options.pop("sinks", False)
    arrays = {}
    if options.pop("segments", False):
        seed = sum(map(ord, name))
        arrays["q_segment_ids"] = _segments(b, sq, seed)
        kv = _segments(b, sk, seed + 1)
        kv[0][kv[0] == 1] = 2  # segment 1 of batch 0 has no keys: rows that see nothing
        arrays["kv_segment_ids"] = kv
    if (lengths := options.pop("lengths", None)) is not None:
        for key, value in zip(("q_lengths", "kv_lengths"), lengths):
            if value is not None:
                arrays[key] = np.asarray(value, np.int32)
    return options, with_sinks, arrays


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_dense_oracle(name):
    b, sq, sk, hq, hkv, d, dv, options = CASES[name]
    static, with_sinks, arrays = _case_arrays(name, b, sq, sk, options)
    q, k, v, sinks, w, wl = _inputs(b, sq, sk, hq, hkv, d, dv)
    scale = 0.7
    mask, valid = visible_mask(b, sq, sk, causal=static.get("causal", False),
                               alignment=static.get("alignment", "bottom_right"),
                               window=static.get("window"), **arrays)

    def ours(q, k, v, sinks, arrays):
        return jax_fa4.attention(q, k, v, softmax_scale=scale, return_lse=True,
                                 sinks=sinks if with_sinks else None, **static, **arrays)

    def oracle(q, k, v, sinks, arrays):
        return dense_attention(q, k, v, mask, valid, scale=scale,
                               softcap=static.get("softcap"),
                               sinks=sinks if with_sinks else None)

    @jax.jit
    def value_and_grads(q, k, v, sinks, arrays):
        # Runtime arrays are jit arguments (traced, as in a model); both in one compile.
        results = {}
        for label, fn in (("ours", ours), ("oracle", oracle)):
            f = functools.partial(lambda fn, *x: fn(*x, arrays), fn)
            results[label] = f(q, k, v, sinks), jax.grad(
                _loss(f, w, wl), argnums=(0, 1, 2, 3))(q, k, v, sinks)
        return results

    results = jax.device_get(value_and_grads(q, k, v, sinks, arrays))
    (out, lse), grads = results["ours"]
    (want_out, want_lse), want_grads = results["oracle"]
    assert out.shape == (b, sq, hq, dv) and lse.shape == (b, hq, sq)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(out, want_out, err_msg="out", **TOL)
    np.testing.assert_allclose(lse, want_lse, err_msg="lse", **TOL)
    for label, g, want in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        assert np.all(np.isfinite(g)), label
        np.testing.assert_allclose(g, want, err_msg=label, **TOL)
    if not with_sinks:
        np.testing.assert_array_equal(grads[3], 0.0)
    # Most cases have rows that see no key: out = 0 there (lse = sink or -inf, checked).
    np.testing.assert_array_equal(out[~mask.any(-1)], 0.0)


def test_row_without_key_and_with_sink():
    # out = 0, lse = sink, and d lse / d sink = 1 on such a row.
    q, k, v, sinks, _, _ = _inputs(1, 3, 2, 2, 2, 8, 8)

    @jax.jit
    def run(sinks):
        (out, lse), vjp = jax.vjp(lambda sinks: jax_fa4.attention(
            q, k, v, causal=True, sinks=sinks, return_lse=True), sinks)
        return out, lse, vjp((jnp.zeros_like(out), jnp.zeros_like(lse).at[0, :, 0].set(1.0)))

    out, lse, (dsinks,) = run(sinks)
    np.testing.assert_array_equal(out[:, 0], 0.0)  # row 0 aligns with key -1
    np.testing.assert_array_equal(lse[0, :, 0], sinks)
    np.testing.assert_allclose(dsinks, 1.0)


def test_a_nan_score_or_sink_gives_nan_out_and_lse():
    # A NaN softmax denominator had counted as "no key seen": lse = -inf for a NaN query,
    # and with a NaN sink a finite, unnormalized out.
    q, k, v, sinks, _, _ = _inputs(1, 3, 4, 2, 2, 8, 8)
    out, lse = jax_fa4.attention(q.at[0, 1, 0, 0].set(jnp.nan), k, v, return_lse=True)
    assert np.isnan(out[0, 1, 0]).all() and np.isnan(lse[0, 0, 1])
    assert np.isfinite(out[0, 0]).all() and np.isfinite(lse[0, :, 0]).all()
    out, lse = jax_fa4.attention(q, k, v, sinks=sinks.at[1].set(jnp.nan), return_lse=True)
    assert np.isnan(out[:, :, 1]).all() and np.isnan(lse[:, 1]).all()
    assert np.isfinite(out[:, :, 0]).all() and np.isfinite(lse[:, 0]).all()


def test_kernel_path_sinks_keep_nan_and_empty_rows():
    # The sinks step after the kernels (_api._add_sinks): a NaN sink had given out = 0.
    out = jnp.ones((1, 2, 2, 4), jnp.bfloat16)  # (B, Sq, H, Dv)
    lse = jnp.array([[[0.0, -jnp.inf], [0.0, -jnp.inf]]])  # (B, H, Sq): row 1 saw no key
    scaled, sunk = _add_sinks(out, lse, jnp.array([jnp.nan, -jnp.inf]))
    assert np.isnan(np.asarray(scaled[0, :, 0], np.float32)).all()
    assert np.isnan(sunk[0, 0]).all()
    np.testing.assert_array_equal(np.asarray(scaled[0, :, 1], np.float32),
                                  [[1.0] * 4, [0.0] * 4])
    np.testing.assert_array_equal(sunk[0, 1], [0.0, -np.inf])


def test_sinks_gradient_by_finite_differences():
    q, k, v, sinks, w, wl = _inputs(2, 4, 6, 2, 1, 8, 8)
    segments = jnp.asarray(_segments(2, 4, 0)), jnp.asarray(_segments(2, 6, 1))

    def f(q, sinks):
        out, lse = jax_fa4.attention(q, k, v, causal=True, window=(2, None), softcap=2.0,
                                     sinks=sinks, q_segment_ids=segments[0],
                                     kv_segment_ids=segments[1], return_lse=True)
        return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * wl)

    check_grads(jax.jit(f), (q, sinks), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


# ------------------------------------------------------------------ parity with jax.nn

# (B, Sq, Sk, Hq, Hkv, our kwargs, jax.nn kwargs); only where both mean the same thing.
JAX_NN = {
    "mqa_4_1": (2, 9, 5, 4, 1, {}, {}),
    "gqa_top_left_causal_sq_lt_sk": (2, 5, 9, 4, 2, dict(causal=True, alignment="top_left"),
                                     dict(is_causal=True)),
    "top_left_causal_sq_gt_sk": (2, 9, 5, 2, 2, dict(causal=True, alignment="top_left"),
                                 dict(is_causal=True)),
    "window_top_left": (2, 9, 6, 4, 2, dict(window=(2, 1), alignment="top_left"),
                        dict(local_window_size=(2, 1))),
    "window_bottom_right_square": (1, 8, 8, 2, 1, dict(window=(3, 2)),
                                   dict(local_window_size=(3, 2))),
    "lengths_gqa_causal_window": (3, 7, 9, 4, 2,
                                  dict(causal=True, alignment="top_left", window=(3, None)),
                                  dict(is_causal=True, local_window_size=(3, 0))),
}
JAX_NN_LENGTHS = {"lengths_gqa_causal_window": ([7, 4, 1], [9, 2, 5])}


@pytest.mark.parametrize("name", list(JAX_NN))
def test_matches_jax_nn(name):
    b, sq, sk, hq, hkv, ours_kw, nn_kw = JAX_NN[name]
    q, k, v, _, w, _ = _inputs(b, sq, sk, hq, hkv, 16, 16)
    q_lengths, kv_lengths = (None if x is None else np.asarray(x, np.int32)
                             for x in JAX_NN_LENGTHS.get(name, (None, None)))
    # jax.nn averages every value on a row that sees no key (we give 0): compare only
    # rows that see a key, and keep the others out of the gradients.
    mask, _ = visible_mask(b, sq, sk, causal=ours_kw.get("causal", False),
                           alignment=ours_kw.get("alignment", "bottom_right"),
                           window=ours_kw.get("window"), q_lengths=q_lengths,
                           kv_lengths=kv_lengths)
    seen = mask.any(-1)[:, :, None, None]
    w = np.where(seen, w, 0.0)

    @jax.jit
    def value_and_grads(q, k, v, q_lengths, kv_lengths):
        ours = functools.partial(jax_fa4.attention, softmax_scale=0.3, q_lengths=q_lengths,
                                 kv_lengths=kv_lengths, **ours_kw)
        theirs = functools.partial(jax.nn.dot_product_attention, scale=0.3,
                                   implementation="xla", query_seq_lengths=q_lengths,
                                   key_value_seq_lengths=kv_lengths, **nn_kw)
        return [(jnp.where(seen, fn(q, k, v), 0.0), jax.grad(
                    lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2))(q, k, v))
                for fn in (ours, theirs)]

    (out, grads), (want, want_grads) = value_and_grads(q, k, v, q_lengths, kv_lengths)
    np.testing.assert_allclose(out, want, err_msg="out", **TOL)
    for label, a, b_ in zip(("dq", "dk", "dv"), grads, want_grads):
        np.testing.assert_allclose(a, b_, err_msg=label, **TOL)


# ------------------------------------------------------------------------- varlen

def _per_sequence(q, k, v, cu_q, cu_k, sinks=None, **kwargs):
    """attention_varlen's contract: one attention call per sequence, concatenated."""
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        qs, ks, vs = (x[None, lo:hi] for x, lo, hi in ((q, cu_q[s], cu_q[s + 1]),
                                                       (k, cu_k[s], cu_k[s + 1]),
                                                       (v, cu_k[s], cu_k[s + 1])))
        out, lse = jax_fa4.attention(qs, ks, vs, sinks=sinks, return_lse=True, **kwargs)
        outs.append(out[0])
        lses.append(lse[0])
    return jnp.concatenate(outs, axis=0), jnp.concatenate(lses, axis=-1)


# Sequence lengths (q, k): zero-length q, zero-length k, both, Sq > Sk, Sq < Sk.
VARLEN_Q = [3, 0, 4, 0, 5, 2]
VARLEN_K = [5, 2, 0, 0, 3, 6]


@pytest.mark.parametrize("kwargs", [
    dict(causal=True),
    dict(causal=True, alignment="top_left", softcap=2.0),
    dict(window=(1, 2), sinks=True),
], ids=["causal", "top_left_softcap", "window_sinks"])
def test_varlen_equals_per_sequence_calls(kwargs):
    kwargs = dict(kwargs)
    cu_q, cu_k = np.cumsum([0] + VARLEN_Q), np.cumsum([0] + VARLEN_K)
    q, k, v, sinks, _, _ = _inputs(1, cu_q[-1], cu_k[-1], 4, 2, 8, 12)
    q, k, v = q[0], k[0], v[0]
    sinks = sinks if kwargs.pop("sinks", False) else None
    w = _normal(np.random.default_rng(7), (cu_q[-1], 4, 12))

    def packed(q, k, v, sinks):
        return jax_fa4.attention_varlen(
            q, k, v, cu_seqlens_q=jnp.asarray(cu_q, jnp.int32),
            cu_seqlens_k=jnp.asarray(cu_k, jnp.int32), max_seqlen_q=max(VARLEN_Q),
            max_seqlen_k=max(VARLEN_K), softmax_scale=0.5, sinks=sinks, return_lse=True,
            **kwargs)

    def separate(q, k, v, sinks):
        return _per_sequence(q, k, v, cu_q, cu_k, sinks=sinks, softmax_scale=0.5, **kwargs)

    @jax.jit
    def value_and_grads(q, k, v, sinks):
        # Both in one compilation; the cotangent reaches out only (lse may be -inf).
        return {name: (fn(q, k, v, sinks), jax.grad(
                    lambda *a, fn=fn: jnp.sum(fn(*a)[0] * w), argnums=(0, 1, 2))(q, k, v, sinks))
                for name, fn in (("packed", packed), ("separate", separate))}

    results = value_and_grads(q, k, v, sinks)
    (out, lse), grads = results["packed"]
    (want_out, want_lse), want_grads = results["separate"]
    assert out.shape == (cu_q[-1], 4, 12) and lse.shape == (4, cu_q[-1])
    np.testing.assert_array_equal(jnp.isneginf(lse), jnp.isneginf(want_lse))
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)
    for label, g, g_want in zip(("dq", "dk", "dv"), grads, want_grads):
        assert bool(jnp.all(jnp.isfinite(g))), label
        np.testing.assert_allclose(g, g_want, err_msg=label, **TOL)


def test_varlen_equals_padded_with_lengths():
    # Bottom-right alignment uses the valid lengths, so padded rows with q_lengths /
    # kv_lengths are the same problem as the packed sequences.
    lq, lk = np.array([3, 5, 1], np.int32), np.array([4, 2, 6], np.int32)
    q, k, v, sinks, _, _ = _inputs(3, 5, 6, 2, 1, 8, 8)
    kw = dict(causal=True, window=(1, None), softcap=3.0, return_lse=True)
    pack = lambda x, lengths: jnp.concatenate([x[n, :n_len] for n, n_len in enumerate(lengths)])
    cu = lambda lengths: jnp.asarray(np.cumsum([0, *lengths]), jnp.int32)

    @jax.jit
    def both(q, k, v, sinks):
        padded = jax_fa4.attention(q, k, v, q_lengths=jnp.asarray(lq),
                                   kv_lengths=jnp.asarray(lk), sinks=sinks, **kw)
        packed = jax_fa4.attention_varlen(
            pack(q, lq), pack(k, lk), pack(v, lk), cu_seqlens_q=cu(lq), cu_seqlens_k=cu(lk),
            max_seqlen_q=5, max_seqlen_k=6, sinks=sinks, **kw)
        return padded, packed

    (out, lse), (got_out, got_lse) = both(q, k, v, sinks)
    np.testing.assert_allclose(got_out, pack(out, lq), **TOL)
    np.testing.assert_allclose(got_lse, pack(jnp.swapaxes(lse, 1, 2), lq).T, **TOL)


def test_varlen_rows_outside_every_sequence():
    q = _normal(np.random.default_rng(0), (7, 2, 8))
    run = jax.jit(functools.partial(jax_fa4.attention_varlen, causal=True, return_lse=True),
                  static_argnames=("max_seqlen_q", "max_seqlen_k"))
    out, lse = run(q, q, q, cu_seqlens_q=jnp.array([0, 2, 4], jnp.int32),
                   cu_seqlens_k=jnp.array([0, 3, 5], jnp.int32), max_seqlen_q=2,
                   max_seqlen_k=3, sinks=jnp.ones((2,)))
    np.testing.assert_array_equal(out[4:], 0.0)
    assert np.all(np.isneginf(lse[:, 4:])) and np.all(np.isfinite(lse[:, :4]))
    # No sequences at all.
    out, lse = run(q, q, q, cu_seqlens_q=jnp.zeros((1,), jnp.int32),
                   cu_seqlens_k=jnp.zeros((1,), jnp.int32), max_seqlen_q=0, max_seqlen_k=0)
    np.testing.assert_array_equal(out, 0.0)
    assert np.all(np.isneginf(lse))


# ------------------------------------------------------- transformations and precision

def test_vmap_with_runtime_feature_arrays():
    q, k, v, sinks, _, _ = _inputs(6, 5, 7, 4, 2, 8, 8)
    arrays = (jnp.array([5, 2, 0, 4, 1, 3], jnp.int32), jnp.asarray(_segments(6, 5, 0)),
              jnp.asarray(_segments(6, 7, 1)))

    def attn(q, k, v, q_lengths, q_segment_ids, kv_segment_ids):
        return jax_fa4.attention(q, k, v, causal=True, softcap=1.0, sinks=sinks,
                                 q_lengths=q_lengths, q_segment_ids=q_segment_ids,
                                 kv_segment_ids=kv_segment_ids)

    split = lambda x: x.reshape(2, 3, *x.shape[1:])
    want, got = jax.jit(lambda *a: (attn(*a), jax.vmap(attn)(*map(split, a))))(q, k, v, *arrays)
    np.testing.assert_allclose(got.reshape(want.shape), want, **TOL)


def test_low_precision_compute_with_features():
    q, k, v, sinks, _, _ = _inputs(2, 9, 13, 4, 2, 16, 8)
    kw = dict(causal=True, softmax_scale=0.25, window=(4, None), softcap=2.0)

    @jax.jit
    def both(q, k, v, sinks, q_lengths, kv_lengths):
        lp = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        arrays = dict(sinks=sinks, q_lengths=q_lengths, kv_lengths=kv_lengths)
        return (reference_attention(*(x.astype(jnp.float32) for x in lp), **kw, **arrays),
                reference_attention(*lp, compute_dtype=jnp.bfloat16, **kw, **arrays))

    (out32, lse32), (out_lp, lse_lp) = both(q, k, v, sinks, jnp.array([9, 5], jnp.int32),
                                            jnp.array([13, 0], jnp.int32))
    assert out_lp.dtype == jnp.bfloat16 and out_lp.shape == (2, 9, 4, 8)
    out_lp, lse_lp, out32, lse32 = (np.asarray(x, np.float32)
                                    for x in (out_lp, lse_lp, out32, lse32))
    np.testing.assert_array_equal(np.isneginf(lse_lp), np.isneginf(lse32))
    assert 0 < np.max(np.abs(out_lp - out32)) < 0.1
    finite = np.isfinite(lse32)
    assert 0 < np.max(np.abs(lse_lp[finite] - lse32[finite])) < 0.1
