"""Forward kernel numerics over the full matrix, with the rule of tests/README.md.

dtype x head dims (D = Dv, and D 192 / Dv 128) x causal x (Sq, Sk) x batch x heads,
every combination. Inputs and
references are computed once per (dtype, head_dim, causal, Sq, Sk) at the largest
batch and head count, and sliced: attention is independent per (batch, head), so the
slice of the reference is the reference of the slice.
"""

import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import pytest

import jax_fa4

pytestmark = pytest.mark.gpu

DTYPES = ("bfloat16", "float16")
# (D, Dv); a square one is named and seeded by D alone.
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (256, 256), (192, 128))
CAUSAL = (False, True)
SEQLENS = ((1, 1), (1, 239), (17, 113), (113, 203), (127, 128), (128, 128), (129, 1000),
           (239, 1), (799, 3), (1000, 1000), (4224, 4224))
BATCHES = (1, 3, 9)
HEADS = (1, 4)


def _case(dtype, head_dims, causal, seqlens, b, h):
    sq, sk = seqlens
    mask = "causal" if causal else "full"
    d, dv = head_dims
    dims = f"d{d}" if d == dv else f"d{d}v{dv}"
    # With pytest-xdist, `--dist loadgroup` keeps a configuration's cases on one worker,
    # in order, so the cached inputs and references below are reused.
    return pytest.param(dtype, head_dims, causal, sq, sk, b, h,
                        id=f"{dtype}-{dims}-{mask}-sq{sq}-sk{sk}-b{b}-h{h}",
                        marks=pytest.mark.xdist_group(f"{dtype}-{dims}-{mask}"))


# Batch and heads vary fastest, so one cached group serves consecutive cases.
CASES = [_case(*c) for c in itertools.product(DTYPES, HEAD_DIMS, CAUSAL, SEQLENS, BATCHES, HEADS)]


@functools.partial(jax.jit, static_argnames="causal")
def _cute(q, k, v, causal):
    return jax_fa4.attention(q, k, v, causal=causal, return_lse=True, implementation="cute")


_GROUP = {}


def _group(fa, dtype, head_dims, causal, sq, sk):
    """Inputs at (max batch, max heads) and their references; one group kept at a time."""
    d, dv = head_dims
    key = (dtype, d if d == dv else head_dims, causal, sq, sk)
    if key not in _GROUP:
        _GROUP.clear()
        seed = zlib.crc32(repr(key).encode())
        kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
        b, h = max(BATCHES), max(HEADS)
        q = fa.normal(kq, (b, sq, h, d), dtype)
        k = fa.normal(kk, (b, sk, h, d), dtype)
        v = fa.normal(kv, (b, sk, h, dv), dtype)
        _GROUP[key] = (q, k, v, *fa.references(q, k, v, causal=causal))
    return _GROUP[key]


@functools.partial(jax.jit, static_argnames=("b", "h"))
def _slice(group, b, h):
    """The (b, h) case of a group: inputs (B, S, H, D) and references, lse (B, H, Sq)."""
    q, k, v, (out_ref, lse_ref), (out_lp, lse_lp) = group
    return ((q[:b, :, :h], k[:b, :, :h], v[:b, :, :h]), (out_ref[:b, :, :h], lse_ref[:b, :h]),
            (out_lp[:b, :, :h], lse_lp[:b, :h]))


@functools.partial(jax.jit, static_argnames="blind")
def _blind_rows_exact(out, lse, blind):
    """Rows i < blind see no key: out exactly 0, lse -inf; every other lse finite."""
    return (jnp.all(out[:, :blind] == 0) & jnp.all(jnp.isneginf(lse[..., :blind]))
            & jnp.all(jnp.isfinite(lse[..., blind:])))


@pytest.mark.parametrize("dtype,head_dims,causal,sq,sk,b,h", CASES)
def test_forward_matches_reference(fa, dtype, head_dims, causal, sq, sk, b, h):
    group = _group(fa, dtype, head_dims, causal, sq, sk)
    (q, k, v), (out_ref, lse_ref), (out_lp, lse_lp) = _slice(group, b, h)
    out, lse = _cute(q, k, v, causal=causal)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == (b, h, sq) and lse.dtype == jnp.float32

    # Causal with Sq > Sk: query rows i < Sq - Sk see no key.
    blind = max(sq - sk, 0) if causal else 0
    assert bool(_blind_rows_exact(out, lse, blind)), "rows without a visible key: out 0, lse -inf"
    fa.assert_rule("out", out, out_ref, out_lp)
    fa.assert_lse("lse", lse, lse_ref, lse_lp, q, k)
