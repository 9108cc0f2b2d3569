"""GQA / MQA through the kernels with the rule of KERNELS.md: query heads share key/value
heads in the forward, and the backward's per-query-head dk, dv partials are summed per
group. Forward and both backward modes per case, against the float32 reference."""

import functools
import itertools
import zlib

import jax
import pytest

import jax_fa4

pytestmark = pytest.mark.gpu

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 96, 128, 256)
CAUSAL = (False, True)
SEQLENS = ((17, 113), (113, 203), (1000, 1000))
GROUPS = ((6, 2), (4, 1))  # (query heads, key/value heads): GQA, MQA
BATCH = 2


def _case(dtype, head_dim, causal, seqlens, heads):
    (sq, sk), (hq, hkv) = seqlens, heads
    mask = "causal" if causal else "full"
    return pytest.param(dtype, head_dim, causal, sq, sk, hq, hkv,
                        id=f"{dtype}-d{head_dim}-{mask}-sq{sq}-sk{sk}-h{hq}-kv{hkv}",
                        marks=pytest.mark.xdist_group(f"gqa-{dtype}-d{head_dim}"))


CASES = [_case(*c) for c in itertools.product(DTYPES, HEAD_DIMS, CAUSAL, SEQLENS, GROUPS)]


@functools.partial(jax.jit, static_argnames=("causal", "deterministic"))
def _cute_vjp(q, k, v, dout, dlse, causal, deterministic):
    attn = functools.partial(jax_fa4.attention, causal=causal, return_lse=True,
                             implementation="cute", deterministic=deterministic)
    (out, lse), vjp = jax.vjp(attn, q, k, v)
    return out, lse, vjp((dout, dlse))


@pytest.mark.parametrize("dtype,head_dim,causal,sq,sk,hq,hkv", CASES)
def test_gqa_matches_reference(fa, dtype, head_dim, causal, sq, sk, hq, hkv):
    seed = zlib.crc32(repr(("gqa", dtype, head_dim, causal, sq, sk, hq, hkv)).encode())
    q, k, v, dout, dlse = fa.problem(seed, dtype, BATCH, sq, sk, hq, hkv, head_dim)
    for deterministic in (False, True):
        out, lse, grads = _cute_vjp(q, k, v, dout, dlse, causal=causal,
                                    deterministic=deterministic)
        if not deterministic:
            fa.assert_attention("gqa", out, lse, q, k, v, causal=causal)
        mode = "deterministic" if deterministic else "atomic"
        fa.assert_gradients(mode, grads, q, k, v, dout, dlse, causal=causal)
