"""Attention sinks on the kernel path (the kernels' out and lse, then the sinks) with the
rule of KERNELS.md: out, lse, dq, dk, dv and dsinks against the float32 reference with
sinks, forward and both backward modes. Includes causal rows that see no key (Sq > Sk),
whose lse is the sink and out 0."""

import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import pytest

import jax_fa4
from jax_fa4._reference import reference_attention

pytestmark = pytest.mark.gpu

SEQLENS = ((113, 203), (1000, 1000), (200, 17))
BATCH, HEADS = 2, 4


def _case(dtype, head_dim, causal, seqlens):
    sq, sk = seqlens
    mask = "causal" if causal else "full"
    return pytest.param(dtype, head_dim, causal, sq, sk,
                        id=f"{dtype}-d{head_dim}-{mask}-sq{sq}-sk{sk}",
                        marks=pytest.mark.xdist_group(f"sinks-{dtype}-d{head_dim}"))


CASES = [_case(*c) for c in itertools.product(("bfloat16", "float16"), (64, 96, 128, 256),
                                              (False, True), SEQLENS)]


@functools.partial(jax.jit, static_argnames=("causal", "deterministic"))
def _cute_vjp(q, k, v, sinks, dout, dlse, causal, deterministic):
    attn = functools.partial(jax_fa4.attention, causal=causal, return_lse=True,
                             implementation="cute", deterministic=deterministic)
    (out, lse), vjp = jax.vjp(lambda q, k, v, s: attn(q, k, v, sinks=s), q, k, v, sinks)
    return out, lse, vjp((dout, dlse))


@functools.partial(jax.jit, static_argnames=("causal", "compute_dtype"))
def _dsinks(q, k, v, sinks, dout, dlse, causal, compute_dtype):
    scale = q.shape[-1] ** -0.5

    def attn(sinks):
        return reference_attention(q, k, v, causal=causal, softmax_scale=scale,
                                   compute_dtype=compute_dtype, sinks=sinks)

    _, vjp = jax.vjp(attn, sinks)
    return vjp((dout.astype(q.dtype), dlse))[0]


@pytest.mark.parametrize("dtype,head_dim,causal,sq,sk", CASES)
def test_sinks_match_reference(fa, dtype, head_dim, causal, sq, sk):
    seed = zlib.crc32(repr(("sinks", dtype, head_dim, causal, sq, sk)).encode())
    kq, kk, kv, ks, kdo, kdl = jax.random.split(jax.random.key(seed), 6)
    q = fa.normal(kq, (BATCH, sq, HEADS, head_dim), dtype)
    k = fa.normal(kk, (BATCH, sk, HEADS, head_dim), dtype)
    v = fa.normal(kv, (BATCH, sk, HEADS, head_dim), dtype)
    # Sinks near the rows' lse (about log Sk), so they take a real share of each row.
    sinks = jnp.log(jnp.float32(sk)) + jax.random.normal(ks, (HEADS,), jnp.float32)
    dout = fa.normal(kdo, q.shape, dtype)
    dlse = jax.random.normal(kdl, (BATCH, HEADS, sq), jnp.float32)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    ds_ref = _dsinks(*f32[:3], sinks, f32[3], dlse, causal=causal, compute_dtype="float32")
    ds_lp = _dsinks(q, k, v, sinks, dout, dlse, causal=causal, compute_dtype=dtype)
    for deterministic in (False, True):
        out, lse, (*grads, dsinks) = _cute_vjp(q, k, v, sinks, dout, dlse, causal=causal,
                                               deterministic=deterministic)
        if not deterministic:
            fa.assert_attention("sinks", out, lse, q, k, v, causal=causal, sinks=sinks)
        mode = "deterministic" if deterministic else "atomic"
        fa.assert_gradients(mode, grads, q, k, v, dout, dlse, causal=causal, sinks=sinks)
        fa.assert_rule(f"{mode} dsinks", dsinks, ds_ref, ds_lp)
