"""The long-band tile (jax_fa4/_path.py with_long_band): which dense banded calls take
the banded kernel's taller tile, and that the choice reaches the lowered call. The
kernel itself is checked on the GPU (tests/gpu/test_gpu_long_band.py)."""

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


def sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _plan(sq, sk, d=64, heads=(16, 16), dtype=jnp.bfloat16, arrays=(), **options):
    q, kv = sds(2, sq, heads[0], d, dtype=dtype), sds(2, sk, heads[1], d, dtype=dtype)
    extra = {name: sds(2, dtype=jnp.int32) for name in arrays}
    return _api._plan(q, kv, kv, softmax_scale=None, return_lse=False,
                      implementation=None, **{"causal": True, **options}, **extra)


@pytest.mark.parametrize("sq,sk,d,options,long_band", [
    (LONG, LONG, 64, {}, True),                     # causal self-attention at the bound
    (LONG - 128, LONG - 128, 64, {}, False),        # below it
    (1024, 4 * LONG, 64, {}, True),                 # a chunk of queries over many keys
    (LONG, LONG, 64, {"dtype": jnp.float16}, True),
    (LONG, LONG, 128, {}, False),                   # built at head_dim 64 and 256
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
])
def test_long_band_choice(built, sq, sk, d, options, long_band):
    spec = _plan(sq, sk, d, **options)
    assert spec.path == "platform" and spec.long_band == long_band, spec
    assert not (spec.long_band and (spec.split_kernel or spec.segment_kernel)), spec


def test_the_choice_reaches_the_call_and_not_the_backward(built):
    q = sds(1, LONG, 8, 64)
    attn = functools.partial(jax_fa4.attention, causal=True)
    grad = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)),
                    argnums=(0, 1, 2))
    text = jax.jit(grad).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    (fwd,), (bwd,) = FWD_ATTRS.findall(text), BWD_ATTRS.findall(text)
    assert "long_band = true" in fwd and "banded = true" in fwd, fwd
    assert "long_band" not in bwd, bwd
    short = sds(1, LONG // 2, 8, 64)
    text = jax.jit(attn).trace(short, short, short).lower(
        lowering_platforms=("cuda",)).as_text()
    (fwd,) = FWD_ATTRS.findall(text)
    assert "long_band = false" in fwd, fwd


def test_derived_specs_drop_it(built):
    """The automatic ring's chunk bands and the float8-KV split take other kernels."""
    spec = _plan(LONG, LONG)
    assert spec.long_band
    assert not spec.with_top_left_window((None, None)).long_band
    with pytest.raises(ValueError, match="long_band"):
        AttentionSpec(dtype="bfloat16", head_dim=64, causal=False, softmax_scale=1.0,
                      return_lse=False, long_band=True)


def test_reference_path_never_takes_it():
    spec = _api._plan(sds(1, LONG, 8, 64), sds(1, LONG, 8, 64), sds(1, LONG, 8, 64),
                      causal=True, softmax_scale=None, return_lse=False,
                      implementation="reference")
    assert not spec.long_band
