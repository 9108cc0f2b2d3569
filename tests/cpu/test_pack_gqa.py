"""Pack-GQA (jax_fa4/_pack_gqa.py): the packed layout, when it is chosen, and that a
short grouped call lowers to kernel calls on the packed problem (a band through the
segment variant, Sq = 1 causal without one). The numerics run on the GPU
(tests/gpu/test_gpu_gqa.py, Sq 1, 17 and 64)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _api, _pack_gqa, _path


def test_rows_put_a_groups_heads_next_to_each_other():
    g = 4
    q = jnp.arange(2 * 3 * 8 * 5, dtype=jnp.float32).reshape(2, 3, 8, 5)
    packed = _pack_gqa._rows(q, g)
    assert packed.shape == (2, 3 * g, 2, 5)
    for s, h, j in ((0, 0, 0), (1, 1, 3), (2, 0, 2)):
        np.testing.assert_array_equal(packed[:, s * g + j, h], q[:, s, h * g + j])
    np.testing.assert_array_equal(_pack_gqa._unrows(packed, g), q)
    lse = jnp.arange(2 * 8 * 3, dtype=jnp.float32).reshape(2, 8, 3)
    packed_lse = _pack_gqa._lse_rows(lse, g)
    assert packed_lse.shape == (2, 2, 3 * g)
    np.testing.assert_array_equal(packed_lse[:, 1, 2 * g + 3], lse[:, 1 * g + 3, 2])
    np.testing.assert_array_equal(_pack_gqa._lse_unrows(packed_lse, g), lse)
    # Split-KV partials carry a split axis after the batch: unpacked split by split.
    splits = jnp.stack([packed, packed + 1], axis=1)
    np.testing.assert_array_equal(_pack_gqa._unrows(splits, g), jnp.stack([q, q + 1], axis=1))
    lse_splits = jnp.stack([packed_lse, packed_lse * 2], axis=1)
    np.testing.assert_array_equal(_pack_gqa._lse_unrows(lse_splits, g),
                                  jnp.stack([lse, lse * 2], axis=1))


@pytest.mark.parametrize("group,seqlen_q,tile_m,packs", [
    (1, 1, 128, False),
    (4, 1, 128, True),
    (4, 64, 128, True),
    (4, 65, 128, False),
    (3, 42, 128, True),
    (3, 43, 128, False),
    (8, 300, 128, False),
    (2, 96, 192, True),
])
def test_packing_at_least_halves_the_tiles(group, seqlen_q, tile_m, packs):
    assert _pack_gqa.worthwhile(group, seqlen_q, tile_m) == packs


class Hopper:
    compute_capability = "9.0"


@pytest.mark.parametrize("seqlen_q,causal,segment_variant", [
    (5, True, True), (5, False, False), (1, True, False)])
def test_short_grouped_calls_lower_packed(built, monkeypatch, seqlen_q, causal,
                                          segment_variant):
    monkeypatch.setattr(_path, "gpu_devices", lambda: (Hopper(),))
    q = jax.ShapeDtypeStruct((2, seqlen_q, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 300, 2, 64), jnp.bfloat16)
    spec = _api._plan(q, kv, kv, causal=causal, softmax_scale=None, return_lse=False,
                      implementation=None)
    assert spec.pack_gqa and spec.segment_kernel == segment_variant
    assert not spec.segments  # no caller arrays: the sharding rules see a plain call
    grad = jax.grad(lambda q, k, v: jax_fa4.attention(q, k, v, causal=causal).astype(
        jnp.float32).sum(), argnums=(0, 1, 2))
    lowered = jax.jit(grad).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    # A one-position forward on the split kernel reads q where the caller has it, its
    # group's heads as rows (q_heads_as_rows); the backward always takes q packed.
    in_place = seqlen_q == 1 and spec.split_kernel
    for target in ("jax_fa4_fwd", "jax_fa4_bwd"):
        types = re.search(rf"custom_call @{target}\(.*\}} : \((.*?)\) ->", lowered).group(1)
        first = q.shape if in_place and target == "jax_fa4_fwd" else (2, seqlen_q * 4, 2, 64)
        assert types.startswith("tensor<{}xbf16>".format("x".join(map(str, first)))), types
        assert types.count("xi32>") == (3 if segment_variant else 0), types  # rows, keys, plan
