"""GQA / MQA through the kernels with the rule of tests/README.md: query heads share key/value
heads in the forward, and the backward's per-query-head dk, dv partials are summed per
group. Forward and both backward modes per case, against the float32 reference; with
head dims that run zero-padded to a built one (80 -> 96), D 192 / Dv 128, and
short query sequences that run pack-GQA (jax_fa4/_pack_gqa.py)."""

import functools
import itertools
import zlib

import jax
import pytest

import jax_fa4

pytestmark = pytest.mark.gpu

DTYPES = ("bfloat16", "float16")
# (D, Dv): the built head dims, and 80, which runs zero-padded to 96.
HEAD_DIMS = ((64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 256))
CAUSAL = (False, True)
# Sq 1, 17 and (at 4 query heads per key/value head) 64 run pack-GQA: the group's query
# heads as rows of one problem; a band there takes the segment variant (Sq 1 causal is
# no band: its one query sees every key).
SEQLENS = ((1, 300), (17, 113), (64, 1000), (113, 203), (1000, 1000))
GROUPS = ((6, 2), (4, 1))  # (query heads, key/value heads): GQA, MQA
BATCH = 2


def _case(dtype, head_dims, causal, seqlens, heads):
    (sq, sk), (hq, hkv), (d, dv) = seqlens, heads, head_dims
    mask = "causal" if causal else "full"
    dims = f"d{d}" if d == dv else f"d{d}v{dv}"
    return pytest.param(dtype, head_dims, causal, sq, sk, hq, hkv,
                        id=f"{dtype}-{dims}-{mask}-sq{sq}-sk{sk}-h{hq}-kv{hkv}",
                        marks=pytest.mark.xdist_group(f"gqa-{dtype}-{dims}"))


CASES = [_case(*c) for c in itertools.product(DTYPES, HEAD_DIMS, CAUSAL, SEQLENS, GROUPS)]


@functools.partial(jax.jit, static_argnames=("causal", "deterministic"))
def _cute_vjp(q, k, v, dout, dlse, causal, deterministic):
    attn = functools.partial(jax_fa4.attention, causal=causal, return_lse=True,
                             implementation="cute", deterministic=deterministic)
    (out, lse), vjp = jax.vjp(attn, q, k, v)
    return out, lse, vjp((dout, dlse))


@pytest.mark.parametrize("dtype,head_dims,causal,sq,sk,hq,hkv", CASES)
def test_gqa_matches_reference(fa, dtype, head_dims, causal, sq, sk, hq, hkv):
    # The seed of a built head_dim is the one it had before (D, Dv) pairs.
    key = head_dims[0] if head_dims[0] == head_dims[1] else head_dims
    seed = zlib.crc32(repr(("gqa", dtype, key, causal, sq, sk, hq, hkv)).encode())
    q, k, v, dout, dlse = fa.problem(seed, dtype, BATCH, sq, sk, hq, hkv, *head_dims)
    for deterministic in (False, True):
        out, lse, grads = _cute_vjp(q, k, v, dout, dlse, causal=causal,
                                    deterministic=deterministic)
        if not deterministic:
            fa.assert_attention("gqa", out, lse, q, k, v, causal=causal)
        mode = "deterministic" if deterministic else "atomic"
        fa.assert_gradients(mode, grads, q, k, v, dout, dlse, causal=causal)
