"""Runtime index values out of range on the kernel path (the contract of README's API
section): cu_seqlens past the packed length, decreasing and negative; lengths negative,
zero and past S; segment ids at the int32 extremes. Each call equals, bit for bit, the
same call with the values clipped as the contract says, and meets the rule of
tests/README.md against the float32 reference. The Python side clips offsets and
lengths before the plan and the kernels see them, so the bit-for-bit part holds the
API to its contract; the kernels meet out-of-range values themselves only as segment
ids (any int32) and page ids (tests/gpu/test_gpu_paged.py). tests/gpu/sanitize.sh runs
such calls under compute-sanitizer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _masks
from jax_fa4._reference import reference_attention_varlen

pytestmark = pytest.mark.gpu

I32 = np.iinfo(np.int32)
TOTAL_Q, TOTAL_K = 300, 260
OFFSETS = {  # (cu_seqlens_q, cu_seqlens_k) over TOTAL_Q, TOTAL_K packed rows
    "issue-17": ([0, 150, 300], [0, 130, 400]),  # the last key offset past the end
    "decreasing": ([0, 200, 100, 300], [0, 200, 90, 260]),
    "negative": ([-50, 100, 290], [-7, 60, 250]),
    "all-past": ([310, 400, 500], [300, 301, I32.max]),
    "int32-extremes": ([I32.min, 140, I32.max], [I32.min, I32.max, I32.max]),
}
KWARGS = {"causal": {"causal": True}, "window-cap": {"window": (40, 20), "softcap": 2.0}}


def _bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@functools.partial(jax.jit, static_argnames=("static",))
def _varlen_vjp(q, k, v, dout, cu_q, cu_k, static):
    attn = functools.partial(jax_fa4.attention_varlen, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             max_seqlen_q=TOTAL_Q, max_seqlen_k=TOTAL_K, return_lse=True,
                             implementation="cute", deterministic=True, **dict(static))
    (out, lse), vjp = jax.vjp(attn, q, k, v)
    return out, lse, vjp((dout, jnp.zeros_like(lse)))


@pytest.mark.parametrize("kwargs", KWARGS.values(), ids=KWARGS)
@pytest.mark.parametrize("name", OFFSETS)
def test_varlen_offsets_out_of_range(fa, name, kwargs):
    q, k, v, dout, _ = fa.problem(17, "bfloat16", 1, TOTAL_Q, TOTAL_K, 4, 2, 128)
    q, k, v, dout = (x[0] for x in (q, k, v, dout))
    cu_q, cu_k = (jnp.array(c, jnp.int32) for c in OFFSETS[name])
    clipped = (_masks.clip_offsets(cu_q, TOTAL_Q), _masks.clip_offsets(cu_k, TOTAL_K))
    static = tuple(sorted(kwargs.items()))
    got = jax.device_get(_varlen_vjp(q, k, v, dout, cu_q, cu_k, static=static))
    want = jax.device_get(_varlen_vjp(q, k, v, dout, *clipped, static=static))
    for part, a, b in zip(("out", "lse", "dq", "dk", "dv"), jax.tree.leaves(got),
                          jax.tree.leaves(want)):
        assert _bits_equal(a, b), f"{part} differs from the call with clipped offsets"

    def varlen_reference(compute_dtype, *x):
        return reference_attention_varlen(
            *x, cu_seqlens_q=clipped[0], cu_seqlens_k=clipped[1], compute_dtype=compute_dtype,
            softmax_scale=128 ** -0.5, alignment="bottom_right",
            causal=kwargs.get("causal", False), window=kwargs.get("window"),
            softcap=kwargs.get("softcap"))

    ref = varlen_reference(jnp.float32, *(x.astype(jnp.float32) for x in (q, k, v)))
    lp = varlen_reference(jnp.bfloat16, q, k, v)
    rtol = 3.0 if "softcap" in kwargs else 2.0
    out, lse = got[0], got[1]
    fa.assert_rule(f"{name} out", jnp.asarray(out), ref[0], lp[0], rtol=rtol)
    fa.assert_lse(f"{name} lse", jnp.asarray(lse), ref[1], lp[1], q, k, rtol=rtol,
                  softmax_scale=128 ** -0.5, softcap=kwargs.get("softcap"))


LENGTHS = {
    "negative-past": ([-3, 1000], [0, 5000]),
    "int32-extremes": ([I32.min, I32.max], [I32.max, I32.min]),
    "zero-keys": ([200, 17], [0, 0]),
}


@pytest.mark.parametrize("kwargs", [{"causal": True}, {"window": (30, 5)}],
                         ids=["causal", "window"])
@pytest.mark.parametrize("name", LENGTHS)
def test_lengths_out_of_range(fa, name, kwargs):
    sq, sk = 203, 300
    q, k, v, dout, dlse = fa.problem(23, "bfloat16", 2, sq, sk, 4, 2, 128)
    raw = {n: jnp.array(x, jnp.int32) for n, x in zip(("q_lengths", "kv_lengths"), LENGTHS[name])}
    clipped = {"q_lengths": jnp.clip(raw["q_lengths"], 0, sq),
               "kv_lengths": jnp.clip(raw["kv_lengths"], 0, sk)}

    @jax.jit
    def run(q, k, v, lengths):
        attn = functools.partial(jax_fa4.attention, return_lse=True, implementation="cute",
                                 deterministic=True, **kwargs, **lengths)
        (out, lse), vjp = jax.vjp(attn, q, k, v)
        return out, lse, vjp((dout, jnp.where(jnp.isfinite(lse), dlse, 0.0)))

    got = jax.device_get(run(q, k, v, raw))
    want = jax.device_get(run(q, k, v, clipped))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert _bits_equal(a, b), "differs from the call with clipped lengths"
    mask = {"causal": kwargs.get("causal", False), "window": kwargs.get("window"),
            "segments": clipped}
    out, lse, grads = got
    fa.assert_attention(f"{name}", jnp.asarray(out), jnp.asarray(lse), q, k, v, **mask)
    dlse_seen = jnp.where(jnp.isfinite(jnp.asarray(lse)), dlse, 0.0)
    fa.assert_gradients(f"{name}", [jnp.asarray(g) for g in grads], q, k, v, dout, dlse_seen,
                        **mask)


def test_segment_ids_at_the_int32_extremes(fa):
    sq = sk = 260
    q, k, v, dout, dlse = fa.problem(29, "bfloat16", 2, sq, sk, 4, 2, 64)
    ids = np.repeat(np.array([I32.min, -1, 0, I32.max], np.int32), 65)[None].repeat(2, 0)
    segments = {"q_segment_ids": jnp.asarray(ids), "kv_segment_ids": jnp.asarray(ids[:, ::-1])}

    @jax.jit
    def run(q, k, v):
        attn = functools.partial(jax_fa4.attention, return_lse=True, causal=True,
                                 implementation="cute", **segments)
        (out, lse), vjp = jax.vjp(attn, q, k, v)
        return out, lse, vjp((dout, jnp.where(jnp.isfinite(lse), dlse, 0.0)))

    out, lse, grads = run(q, k, v)
    mask = {"causal": True, "segments": segments}
    fa.assert_attention("int32 ids", out, lse, q, k, v, **mask)
    fa.assert_gradients("int32 ids", grads, q, k, v, dout,
                        jnp.where(jnp.isfinite(lse), dlse, 0.0), **mask)
