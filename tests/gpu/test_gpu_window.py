"""The banded kernels (sliding windows, one-sided windows, top-left alignment, and their
softcap variant) with the rule of tests/README.md: out, lse, and dq, dk, dv in both backward
modes, against the float32 reference with the same band and cap. Sizes put band edges
across tile boundaries, leave rows that see no key, and make key blocks that every row
of a tile sees whole; the GPU test of the block ranges whose arithmetic
tests/cpu/test_band_ranges.py checks exhaustively. Softcap cases (rtol 3) run over GQA
heads with queries scaled so that scores reach several times a small cap (tanh
saturates) and stay in the linear range of a large one."""

import functools
import itertools
import zlib

import jax
import pytest

import jax_fa4

pytestmark = pytest.mark.gpu

# (name, attention keyword arguments): the band.
BANDS = (
    ("sliding", {"causal": True, "window": (100, None)}),
    ("two-sided", {"window": (64, 32)}),
    ("right-only", {"window": (None, 40)}),
    ("left-only", {"window": (300, None)}),
    ("diagonal", {"window": (0, 0)}),
    ("top-left-causal", {"causal": True, "alignment": "top_left"}),
    ("top-left-window", {"window": (17, 3), "alignment": "top_left"}),
    ("none-cap30", {"softcap": 30.0}),
    ("causal-cap5", {"causal": True, "softcap": 5.0}),
    ("sliding-cap20", {"causal": True, "window": (100, None), "softcap": 20.0}),
)
SEQLENS = ((113, 203), (203, 113), (1000, 1000))
BATCH, HEADS = 2, 3
CAP_HEADS, CAP_Q_GAIN = (4, 2), 4.0  # softcap cases: GQA, scores ~ N(0, 16)


# (D, Dv); a square one is named and seeded by D alone.
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (256, 256), (192, 128))


def _case(dtype, head_dims, band, seqlens):
    (name, kwargs), (sq, sk) = band, seqlens
    d, dv = head_dims
    dims = f"d{d}" if d == dv else f"d{d}v{dv}"
    return pytest.param(dtype, head_dims, kwargs, sq, sk,
                        id=f"{dtype}-{dims}-{name}-sq{sq}-sk{sk}",
                        marks=pytest.mark.xdist_group(f"window-{dtype}-{dims}"))


CASES = [_case(*c) for c in itertools.product(("bfloat16", "float16"), HEAD_DIMS,
                                              BANDS, SEQLENS)]


@functools.partial(jax.jit, static_argnames=("band", "deterministic"))
def _cute_vjp(q, k, v, dout, dlse, band, deterministic):
    attn = functools.partial(jax_fa4.attention, return_lse=True, implementation="cute",
                             deterministic=deterministic, **dict(band))
    (out, lse), vjp = jax.vjp(attn, q, k, v)
    return out, lse, vjp((dout, dlse))


@pytest.mark.parametrize("dtype,head_dims,band,sq,sk", CASES)
def test_band_matches_reference(fa, dtype, head_dims, band, sq, sk):
    key = head_dims[0] if head_dims[0] == head_dims[1] else head_dims
    seed = zlib.crc32(repr(("window", dtype, key, sorted(band.items()), sq, sk)).encode())
    softcap = band.get("softcap")
    heads = CAP_HEADS if softcap else (HEADS, HEADS)
    q, k, v, dout, dlse = fa.problem(seed, dtype, BATCH, sq, sk, *heads, *head_dims)
    if softcap:
        q = q * CAP_Q_GAIN
    mask = {"causal": band.get("causal", False), "window": band.get("window"),
            "alignment": band.get("alignment", "bottom_right"), "softcap": softcap}
    frozen = tuple(sorted(band.items()))
    for deterministic in (False, True):
        out, lse, grads = _cute_vjp(q, k, v, dout, dlse, band=frozen,
                                    deterministic=deterministic)
        if not deterministic:
            fa.assert_attention("band", out, lse, q, k, v, **mask)
        mode = "deterministic" if deterministic else "atomic"
        fa.assert_gradients(mode, grads, q, k, v, dout, dlse, **mask)
