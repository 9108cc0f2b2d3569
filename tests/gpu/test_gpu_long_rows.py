"""The long-row tiles (jax_fa4/_path.py with_long_rows): the banded kernels that dense
banded calls take where rows may see LONG_BAND_KEYS keys or more (head_dim 64 with
192-row tiles, 256 with 80-key blocks), and the kernel without a mask that calls of
LONG_FULL_ROWS queries and keys or more take (head_dim 128, 192 rows, 80-key blocks),
with the rule of tests/README.md: out and lse against the float32 reference, and dq,
dk, dv of one case per dtype and mask (the backward is the plain one; its inputs, out
and lse, come from the long-row forward). Each case first checks that the call takes
that tile, so no case can pass on the other tile. Sizes put band edges inside 192-row
tiles and 128- and 80-key blocks, leave rows that see no key, end queries and keys
inside the last 192-row tile and 80-key block, and cross the tile orders with GQA and
sinks."""

import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import pytest

import jax_fa4
from jax_fa4 import _api, _path

pytestmark = pytest.mark.gpu

LONG = _path.LONG_BAND_KEYS
# (name, attention keyword arguments, Sq, Sk).
BANDS = (
    ("causal", {"causal": True}, LONG + 100, LONG + 100),
    # Queries at the end of the keys; with fewer query rows the grid would not fill the
    # GPU and the call would split (jax_fa4/_split_kv.py), which the long band is not.
    ("causal-chunk", {"causal": True}, 3500, LONG + 700),
    ("causal-more-queries", {"causal": True}, LONG + 300, LONG + 40),  # rows see none
    ("top-left-causal", {"causal": True, "alignment": "top_left"}, LONG + 64, LONG + 200),
    ("window", {"causal": True, "window": (LONG + 7, None)}, LONG + 900, LONG + 900),
    ("two-sided", {"window": (LONG - 500, 600)}, LONG + 333, LONG + 333),
    ("left-only", {"window": (700, None)}, LONG + 17, LONG + 17),
)
FULL = _path.LONG_FULL_ROWS
# Without a mask: Sq and Sk off the 192-row tiles and 80-key blocks.
NO_MASK = (
    ("full", {}, FULL + 52, FULL + 52),
    ("full-more-keys", {}, FULL + 1, 2 * FULL + 907),
    ("full-more-queries", {}, 2 * FULL + 905, FULL + 1),
)
HEADS = ((2, 2), (4, 2))  # (Hq, Hkv): plain and GQA (not packed at these rows)
# Without a mask, 2 heads of 2k rows leave SMs idle and the call splits (its 64-row
# tiles, jax_fa4/_split_kv.py); 4 query heads fill an H100's and H200's 132.
HEADS_FULL = ((4, 4), (8, 2))
BATCH = 1


def _case(dtype, head_dim, band, heads, sinks):
    name, kwargs, sq, sk = band
    return pytest.param(dtype, head_dim, kwargs, sq, sk, heads, sinks,
                        id=f"{dtype}-d{head_dim}-{name}-h{heads[0]}x{heads[1]}"
                           + ("-sinks" if sinks else ""),
                        marks=pytest.mark.xdist_group(f"long-rows-{dtype}"))


CASES = [_case(dtype, 64, band, heads, False)
         for dtype, band, heads in itertools.product(("bfloat16", "float16"), BANDS, HEADS)]
CASES += [_case(dtype, d, BANDS[0], (4, 2), sinks)
          for dtype, d, sinks in (("bfloat16", 64, True), ("float16", 64, True),
                                  ("bfloat16", 32, False))]
CASES += [_case(dtype, 256, band, (4, 2), dtype == "float16" and band is BANDS[0])
          for dtype, band in itertools.product(("bfloat16", "float16"), BANDS)]
CASES += [_case(dtype, 128, band, heads, dtype == "float16" and band is NO_MASK[0])
          for dtype, band, heads in itertools.product(("bfloat16", "float16"), NO_MASK,
                                                      HEADS_FULL)]


def _takes_long_rows(q, k, v, band, sinks):
    spec = _api._plan(q, k, v, softmax_scale=None, return_lse=True, implementation="cute",
                      sinks=sinks, **{"causal": False, **band})
    return spec.long_rows


@functools.partial(jax.jit, static_argnames=("band",))
def _forward(q, k, v, sinks, band):
    return jax_fa4.attention(q, k, v, sinks=sinks, return_lse=True, implementation="cute",
                             **dict(band))


@pytest.mark.parametrize("dtype,head_dim,band,sq,sk,heads,with_sinks", CASES)
def test_long_rows_matches_reference(fa, dtype, head_dim, band, sq, sk, heads, with_sinks):
    seed = zlib.crc32(repr(("long", dtype, head_dim, sorted(band.items()), sq, sk, heads,
                            with_sinks)).encode())
    q, k, v, _, _ = fa.problem(seed, dtype, BATCH, sq, sk, *heads, head_dim)
    sinks = (jnp.log(jnp.float32(sk)) + jax.random.normal(jax.random.key(seed), (heads[0],))
             if with_sinks else None)
    assert _takes_long_rows(q, k, v, band, sinks), "the call does not take the long-row tile"
    out, lse = _forward(q, k, v, sinks, band=tuple(sorted(band.items())))
    mask = {"causal": band.get("causal", False), "window": band.get("window"),
            "alignment": band.get("alignment", "bottom_right"), "sinks": sinks}
    fa.assert_attention("long rows", out, lse, q, k, v, **mask)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_long_rows_gradients(fa, dtype, causal):
    sq = sk = LONG + 100 if causal else FULL + 52
    seed = f"long-grad-{dtype}" if causal else f"long-grad-full-{dtype}"
    q, k, v, dout, dlse = fa.problem(zlib.crc32(seed.encode()), dtype,
                                     BATCH, sq, sk, 4, 2, 64 if causal else 128)
    assert _takes_long_rows(q, k, v, {"causal": causal}, None)
    attn = functools.partial(jax_fa4.attention, causal=causal, return_lse=True,
                             implementation="cute")

    @jax.jit
    def forward_and_grads(q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(attn, q, k, v)
        return out, lse, vjp((dout, dlse))

    out, lse, grads = forward_and_grads(q, k, v, dout, dlse)
    fa.assert_attention("long rows", out, lse, q, k, v, causal=causal)
    fa.assert_gradients("long rows", grads, q, k, v, dout, dlse, causal=causal)
