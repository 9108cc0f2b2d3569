"""The long-row tiles (jax_fa4/_path.py with_long_rows): which dense calls take the tile
for rows that see many keys (banded ones from LONG_BAND_KEYS keys a row, calls without a
mask from LONG_FULL_ROWS queries and keys), and that the choice reaches the lowered
call. The kernels themselves are checked on the GPU (tests/gpu/test_gpu_long_rows.py)."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import jax_fa4
from jax_fa4 import _api, _path
from jax_fa4._spec import AttentionSpec

FWD_ATTRS = re.compile(r"stablehlo\.custom_call @jax_fa4_fwd\(.*?\{(.*?)\}", re.MULTILINE)
BWD_ATTRS = re.compile(r"stablehlo\.custom_call @jax_fa4_bwd\(.*?\{(.*?)\}", re.MULTILINE)
LONG = _path.LONG_BAND_KEYS
FULL = _path.LONG_FULL_ROWS


def sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _plan(sq, sk, d=64, heads=(16, 16), dtype=jnp.bfloat16, arrays=(), **options):
    q, kv = sds(2, sq, heads[0], d, dtype=dtype), sds(2, sk, heads[1], d, dtype=dtype)
    extra = {name: sds(2, dtype=jnp.int32) for name in arrays}
    return _api._plan(q, kv, kv, softmax_scale=None, return_lse=False,
                      implementation=None, **{"causal": True, **options}, **extra)


@pytest.mark.parametrize("sq,sk,d,options,long_rows", [
    (LONG, LONG, 64, {}, True),                     # causal self-attention at the bound
    (LONG - 128, LONG - 128, 64, {}, False),        # below it
    (1024, 4 * LONG, 64, {}, True),                 # a chunk of queries over many keys
    (LONG, LONG, 64, {"dtype": jnp.float16}, True),
    (LONG, LONG, 128, {}, False),                   # banded: built at 64 and 256
    (LONG, LONG, 256, {}, True),
    (LONG - 128, LONG - 128, 256, {}, False),
    (LONG, LONG, 32, {}, True),                     # zero-padded to 64's kernels
    (LONG, LONG, 64, {"causal": False}, False),     # no band: the full kernel
    (LONG, LONG, 64, {"window": (1024, 0)}, False),  # rows see 1025 keys
    (2 * LONG, 2 * LONG, 64, {"window": (LONG, 0)}, True),
    (LONG, LONG, 64, {"causal": False, "window": (1024, None)}, True),  # open right side
    (LONG, LONG, 64, {"softcap": 30.0}, False),     # no softcap variant
    (LONG, LONG, 64, {"arrays": ("kv_lengths",)}, False),  # lengths: segment kernel
    (LONG, LONG, 64, {"heads": (16, 4)}, True),     # GQA, not packed at these rows
    (64, LONG, 64, {"heads": (16, 4)}, False),      # packed band: segment kernel
    # Without a mask: built at head_dim 128, from FULL queries and keys.
    (FULL, FULL, 128, {"causal": False}, True),
    (FULL, FULL, 128, {"causal": False, "dtype": jnp.float16}, True),
    (FULL - 1, 4 * FULL, 128, {"causal": False}, False),  # too few queries
    (4 * FULL, FULL - 1, 128, {"causal": False}, False),  # too few keys
    (FULL, FULL, 112, {"causal": False}, True),     # zero-padded to 128's kernels
    (FULL, FULL, 64, {"causal": False}, False),     # not built at 64
    (FULL, FULL, 256, {"causal": False}, False),
    (FULL, FULL, 128, {"causal": False, "softcap": 30.0}, False),  # the banded kernel
    (FULL, FULL, 128, {"causal": False, "arrays": ("kv_lengths",)}, False),
    (FULL, FULL, 128, {"causal": False, "heads": (16, 4)}, True),
])
def test_long_rows_choice(built, sq, sk, d, options, long_rows):
    spec = _plan(sq, sk, d, **options)
    assert spec.path == "platform" and spec.long_rows == long_rows, spec
    assert not (spec.long_rows and (spec.split_kernel or spec.segment_kernel)), spec


def test_the_choice_reaches_the_call_and_not_the_backward(built):
    q = sds(1, LONG, 8, 64)
    attn = functools.partial(jax_fa4.attention, causal=True)
    grad = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)),
                    argnums=(0, 1, 2))
    text = jax.jit(grad).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    (fwd,), (bwd,) = FWD_ATTRS.findall(text), BWD_ATTRS.findall(text)
    assert "long_rows = true" in fwd and "banded = true" in fwd, fwd
    assert "long_rows" not in bwd, bwd
    short = sds(1, LONG // 2, 8, 64)
    text = jax.jit(attn).trace(short, short, short).lower(
        lowering_platforms=("cuda",)).as_text()
    (fwd,) = FWD_ATTRS.findall(text)
    assert "long_rows = false" in fwd, fwd


def test_the_full_choice_reaches_the_call(built):
    x = sds(1, FULL, 8, 128)
    text = jax.jit(jax_fa4.attention).trace(x, x, x).lower(
        lowering_platforms=("cuda",)).as_text()
    (fwd,) = FWD_ATTRS.findall(text)
    assert "long_rows = true" in fwd and "banded = false" in fwd, fwd


@pytest.mark.parametrize("causal", [True, False])
def test_derived_specs_drop_it(built, causal):
    """The automatic ring's chunks and the float8-KV split take other kernels."""
    spec = _plan(LONG, LONG, 64 if causal else 128, causal=causal)
    assert spec.long_rows
    assert not spec.with_top_left_window((None, None)).long_rows
    with pytest.raises(ValueError, match="long_rows"):
        AttentionSpec(dtype="bfloat16", head_dim=64, causal=causal, softmax_scale=1.0,
                      return_lse=False, split_kernel=True, long_rows=True)


def test_reference_path_never_takes_it():
    spec = _api._plan(sds(1, LONG, 8, 64), sds(1, LONG, 8, 64), sds(1, LONG, 8, 64),
                      causal=True, softmax_scale=None, return_lse=False,
                      implementation="reference")
    assert not spec.long_rows
