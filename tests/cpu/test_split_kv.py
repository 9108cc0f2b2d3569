"""Split-KV (jax_fa4/_split_kv.py): the split count and the split forward's call in the
HLO lowered for CUDA. The kernels (split and combine) are checked on the GPU
(tests/gpu/test_gpu_split_kv.py)."""

import functools
import itertools
import re

import jax
import jax.export
import jax.numpy as jnp
import pytest

import jax_fa4
from jax_fa4 import _api, _path, _split_kv

FWD = re.compile(r"stablehlo\.custom_call @jax_fa4_fwd\((.*?)\) \{(.*?)\} : \((.*?)\) -> "
                 r"\((.*?)\)$", re.MULTILINE)
BWD = re.compile(r"stablehlo\.custom_call @jax_fa4_bwd\(.*?\{(.*?)\}", re.MULTILINE)


@pytest.mark.parametrize("ctas,blocks,sms,expected", [
    (8, 64, 132, 16),      # decode: batch 1, 8 KV heads, 8k keys of 128
    (8, 1024, 132, 16),    # 128k keys: still one wave
    (8, 6, 132, 3),        # few keys: every split walks 2 blocks at least
    (8, 3, 132, 1),        # too few to split
    (32, 64, 132, 4),      # batch 4
    (105, 64, 132, 1),     # 80% of the SMs busy: no split
    (132, 64, 132, 1),
    (1, 4096, 132, 128),   # capped at MAX_SPLITS
    (0, 64, 132, 1),
    (4, 0, 132, 1),        # no key
    (8, 100, 132, 15),     # 16 runs of 7 would leave the 16th empty
    (33, 9, 132, 3),       # 4 runs of 3 would too
])
def test_num_splits(ctas, blocks, sms, expected):
    assert _split_kv.num_splits(ctas, blocks, sms) == expected


def test_no_split_is_empty(kernel_band):
    """Every split walks at least one block of the longest tile (band.split_visits)."""
    for blocks, ctas in itertools.product(range(1, 300), (1, 3, 8, 33, 100)):
        splits = _split_kv.num_splits(ctas, blocks, 132)
        runs = [kernel_band.split_visits(blocks, s, splits) for s in range(splits)]
        assert all(first < end for first, end in runs), (ctas, splits, runs)
        assert runs[-1][1] == blocks


def sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _lowered(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _fwd_calls(text):
    """[(attributes, result types)] of each jax_fa4_fwd call."""
    return [(attrs, results) for _, attrs, _, results in FWD.findall(text)]


def _fwd_operand_types(text):
    """[operand types] of each jax_fa4_fwd call."""
    return [operands for _, _, operands, _ in FWD.findall(text)]


def test_decode_lowers_to_the_split_kernel(built):
    """Batch 1, 32 query / 8 KV heads, 8k keys: pack-GQA gives 8 CTAs, so 16 splits of
    the banded kernel with fp32 partials (batch, split, ...) as workspace results, and
    q, out and lse in the caller's layout (the kernel reads q's group as rows, the
    combine unpacks out and lse); its 4 rows per K/V head take the keys-as-M tile."""
    if _path.sm_count() != 132:
        pytest.skip("the expected split count assumes 132 SMs")
    q, kv = sds(1, 1, 32, 128), sds(1, 8192, 8, 128)
    text = _lowered(jax_fa4.attention, q, kv, kv)
    (attrs, results), = _fwd_calls(text)
    # q as the caller has it: the kernel reads the group's heads as rows (no transpose).
    operands, = _fwd_operand_types(text)
    assert operands.startswith("tensor<1x1x32x128xbf16>, "), operands
    assert "transpose" not in text
    assert "banded = true" in attrs and "num_splits = 16 : i32" in attrs, attrs
    assert "keys_as_m = true" in attrs, attrs
    assert "unpack_group = 4 : i32" in attrs and "q_heads_as_rows = true" in attrs, attrs
    # out, lse, the tile counter, then the partials of the packed rows (the 4 query
    # heads of each KV head).
    assert results == ("tensor<1x1x32x128xbf16>, tensor<1x32x1xf32>, tensor<1xi32>, "
                       "tensor<1x16x4x8x128xf32>, tensor<1x16x8x4xf32>"), results


def test_full_grids_and_gradients_do_not_split(built):
    """A grid that fills the GPU keeps one split; the backward never splits (its call
    keeps the forward's band: no mask here)."""
    if _path.sm_count() != 132:
        pytest.skip("the expected split count assumes 132 SMs")
    q, kv = sds(8, 1024, 16, 128), sds(8, 1024, 16, 128)
    (attrs, _), = _fwd_calls(_lowered(jax_fa4.attention, q, kv, kv))
    assert "banded = false" in attrs and "num_splits = 1 : i32" in attrs, attrs

    q, kv = sds(1, 64, 8, 128), sds(1, 8192, 8, 128)
    loss = functools.partial(jax_fa4.attention)
    grad = jax.grad(lambda *a: jnp.sum(loss(*a).astype(jnp.float32)), argnums=(0, 1, 2))
    text = _lowered(grad, q, kv, kv)
    (attrs, _), = _fwd_calls(text)
    assert "num_splits = 16 : i32" in attrs, attrs
    (bwd_attrs,) = BWD.findall(text)
    assert "banded = false" in bwd_attrs and "num_splits" not in bwd_attrs, bwd_attrs


@pytest.mark.parametrize("sq,d,options,keys_as_m", [
    (1, 128, {}, True),                     # decode: 4 query heads per K/V head as rows
    (2, 128, {}, True),                     # two positions of 4: the tile's 8 rows
    (3, 128, {}, False),                    # 12 rows: the 64-row split tile
    (1, 64, {}, False),                     # head_dim 64: not built there (config.py)
    (1, 128, {"softcap": 20.0}, False),     # no softcap variant
    (1, 128, {"kv_lengths": True}, True),   # lengths: its segment variant
])
def test_keys_as_m_tile_choice(built, sq, d, options, keys_as_m):
    """Split calls whose rows per K/V head (pack-GQA's included) fit the keys-as-M
    tile's 8 take it where it was built (head_dim 128, no softcap), others the 64-row
    split tile; the choice reaches the lowered call."""
    options = dict(options)
    q, kv, arrays = sds(1, sq, 32, d), sds(1, 8192, 8, d), {}
    if options.pop("kv_lengths", False):
        arrays["kv_lengths"] = sds(1, dtype=jnp.int32)
    spec = _api._plan(q, kv, kv, causal=False, softmax_scale=None, return_lse=False,
                      implementation=None, **options, **arrays)
    assert spec.split_kernel and spec.keys_as_m == keys_as_m, spec
    text = _lowered(lambda q, k, v, arrays: jax_fa4.attention(q, k, v, **options, **arrays),
                    q, kv, kv, arrays)
    (attrs, _), = _fwd_calls(text)
    assert f"keys_as_m = {str(keys_as_m).lower()}" in attrs, attrs


def test_symbolic_sizes_do_not_split(built):
    """jax.export with a symbolic key length: the split count is a static choice."""
    b, = jax.export.symbolic_shape("b")
    q, kv = sds(1, 1, 32, 128), sds(1, 8192, 8, 128)
    spec = _api._plan(sds(b, 1, 32, 128), sds(b, 8192, 8, 128), sds(b, 8192, 8, 128),
                      causal=False, softmax_scale=None, return_lse=False,
                      implementation=None)
    assert spec.num_splits == 1
    assert _api._plan(q, kv, kv, causal=False, softmax_scale=None, return_lse=False,
                      implementation=None).num_splits > 1


@pytest.mark.parametrize("batch,split", [(16384, True), (32768, False)])
def test_outs_past_the_split_kernels_view_run_unsplit(built, batch, split):
    # The split kernels compute their out view's offsets in 32 bits: a decode-shaped call
    # (one position of 64 query heads per K/V head: one 64-row tile) whose out has 2^31
    # elements would have written the batches past 2^31 elsewhere. It runs unsplit.
    q, kv = sds(batch, 1, 256, 256), sds(batch, 320, 4, 256)
    spec = _api._plan(q, kv, kv, causal=False, softmax_scale=None, return_lse=False,
                      implementation=None)
    assert spec.split_kernel == split, spec
    assert _split_kv.out_view_fits(batch, 256, 1, 256) == split
