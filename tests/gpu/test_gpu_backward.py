"""Backward kernel numerics with the rule of tests/README.md: dq, dk, dv against the
gradients of the float32 reference, with atomic and with deterministic dq accumulation.

dtype x head dims (D = Dv, and D 192 / Dv 128) x causal x (Sq, Sk) x mode, every
combination, at one batch and head count (the forward suite covers those; the backward
grid is the same per (batch, head)). The cotangents of out and of the returned lse are
both random, so the lse term of the backward is always exercised. Inputs, cotangents and
the two reference backwards (float32, and the same math in the input dtype) are computed
once per (dtype, head dims, causal, Sq, Sk) and serve both modes.
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
# Odd sizes around the tiles (64 query rows, 128 keys), Sq < Sk and Sq > Sk (causal rows
# that see no key), several key blocks per query tile and query tiles per key block;
# 65 key blocks of 128, past the heads-fastest bounds of the deterministic and the
# banded atomic launch (BwdConfig.det_heads_fastest_blocks, banded_heads_fastest_blocks),
# so their other orders run too.
SEQLENS = ((1, 1), (1, 239), (17, 113), (113, 203), (128, 128), (129, 1000), (239, 1),
           (799, 3), (1000, 1000), (65, 8300))
DETERMINISTIC = (False, True)
# With one query row every dk and dv element is a single product (dS_j q, P_j dO) and dq
# is one row per head: the errors of kernel and baseline are both a rounding or two of
# the input dtype, and the baseline's max over so few independent terms swings widely.
# An emulation of the kernel's math on CPU (6 seeds, Sq=1, Sk=239, d128) stayed within
# 0.3-1.2x of the baseline for dv; on the H100 three draws of the (Sq=1, Sk=239) grid
# exceeded 2x: dv bf16 d128 2.27x (1.0e-3 vs 4.5e-4), dk fp16 d64 2.07x (1.00e-4 vs
# 4.84e-5), dq fp16 d256 2.02x (2.56e-4 vs 1.27e-4), each about one output ulp. The
# rule's other rtol (3, softcap's) applies to Sq = 1 only.
SINGLE_ROW_RTOL = 3.0
BATCH, HEADS = 2, 3


def _case(dtype, head_dims, causal, seqlens, deterministic):
    sq, sk = seqlens
    mask = "causal" if causal else "full"
    mode = "deterministic" if deterministic else "atomic"
    d, dv = head_dims
    dims = f"d{d}" if d == dv else f"d{d}v{dv}"
    # As in the forward suite: `--dist loadgroup` keeps a configuration on one worker.
    return pytest.param(dtype, head_dims, causal, sq, sk, deterministic,
                        id=f"{dtype}-{dims}-{mask}-sq{sq}-sk{sk}-{mode}",
                        marks=pytest.mark.xdist_group(f"bwd-{dtype}-{dims}-{mask}"))


# The mode varies fastest, so one cached group serves consecutive cases.
CASES = [_case(*c) for c in itertools.product(DTYPES, HEAD_DIMS, CAUSAL, SEQLENS,
                                              DETERMINISTIC)]


@functools.partial(jax.jit, static_argnames=("causal", "deterministic"))
def _cute_vjp(q, k, v, dout, dlse, causal, deterministic):
    attn = functools.partial(jax_fa4.attention, causal=causal, return_lse=True,
                             implementation="cute", deterministic=deterministic)
    _, vjp = jax.vjp(attn, q, k, v)
    return vjp((dout, dlse))


@functools.partial(jax.jit, static_argnames="blind")
def _blind_rows_zero(dq, blind):
    return jnp.all(dq[:, :blind] == 0)


_GROUP = {}


def _group(fa, dtype, head_dims, causal, sq, sk):
    """Inputs, cotangents and their reference gradients; one group kept at a time."""
    d, dv = head_dims
    key = (dtype, d if d == dv else head_dims, causal, sq, sk)
    if key not in _GROUP:
        _GROUP.clear()
        seed = zlib.crc32(repr(("bwd", *key)).encode())
        q, k, v, dout, dlse = fa.problem(seed, dtype, BATCH, sq, sk, HEADS, HEADS, d, dv)
        _GROUP[key] = ((q, k, v, dout, dlse),
                       fa.backward_references(q, k, v, dout, dlse, causal=causal))
    return _GROUP[key]


@pytest.mark.parametrize("dtype,head_dims,causal,sq,sk,deterministic", CASES)
def test_backward_matches_reference(fa, dtype, head_dims, causal, sq, sk, deterministic):
    (q, k, v, dout, dlse), (ref, lp) = _group(fa, dtype, head_dims, causal, sq, sk)
    grads = _cute_vjp(q, k, v, dout, dlse, causal=causal, deterministic=deterministic)
    # Causal with Sq > Sk: query rows i < Sq - Sk see no key; their dq is exactly 0.
    blind = max(sq - sk, 0) if causal else 0
    assert bool(_blind_rows_zero(grads[0], blind)), "dq of rows without a visible key"
    for name, got, x, r, l in zip(("dq", "dk", "dv"), grads, (q, k, v), ref, lp):
        assert got.shape == x.shape and got.dtype == x.dtype, name
        fa.assert_rule(name, got, r, l, rtol=SINGLE_ROW_RTOL if sq == 1 else fa.RTOL)
