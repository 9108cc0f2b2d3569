"""The contract for runtime index values (README, `attention` / `attention_varlen`
docstrings): any int32 that a traced array can hold has a defined meaning, the same on
every path. Offsets are clipped to [0, total] and made non-decreasing (a running
maximum); lengths are clipped to [0, S]; segment ids are compared for equality only.

On CPU the default path computes visibility from the segment kernels' rows, keys and
plans (`_segment_plan`), the reference from `_masks`: both must agree, values and
gradients. tests/gpu/test_gpu_runtime_values.py runs the same values on the kernels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _masks

I32 = np.iinfo(np.int32)

# (cu_seqlens_q, cu_seqlens_k) over total_q = 64 and total_k = 100 rows.
OFFSETS = {
    "past_the_end": ([0, 30, 64], [0, 50, 150]),  # the last key offset past total_k
    "decreasing": ([0, 40, 20, 64], [0, 60, 30, 100]),
    "negative": ([-7, 10, 64], [-100, 20, 90]),
    "all_past": ([70, 80, 90], [101, 200, 300]),
    "int32_extremes": ([I32.min, 5, I32.max], [I32.min, I32.max, I32.max]),
}


def _inputs(sq, sk, seed=0, lead=(), heads=(4, 2), d=64):
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = ((*lead, sq, heads[0], d), (*lead, sk, heads[1], d), (*lead, sk, heads[1], d))
    return [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes)]


def _assert_same_bits(paths, attend, clipped, q, k, v):
    """attend and clipped give the same bits on both paths, values and gradients."""
    for implementation in (None, "reference"):
        got, want = (paths.run(f, implementation, q, k, v) for f in (attend, clipped))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)


def test_clip_offsets():
    clipped = _masks.clip_offsets(jnp.array([-5, 50, 30, 150, 70], jnp.int32), 100)
    np.testing.assert_array_equal(clipped, [0, 50, 50, 100, 100])


@pytest.mark.parametrize("name", OFFSETS)
@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window=(9, 3), alignment="top_left"),
                                    dict(softcap=5.0, sinks=True)])
def test_any_offsets_mean_the_clipped_ones_on_every_path(built, paths, name, kwargs):
    q, k, v = (x[0] for x in _inputs(64, 100, lead=(1,)))
    cu_q, cu_k = (jnp.array(c, jnp.int32) for c in OFFSETS[name])
    kwargs = dict(kwargs)
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)

    def attend(implementation, q, k, v, cu_q=cu_q, cu_k=cu_k):
        return jax_fa4.attention_varlen(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=64,
            max_seqlen_k=100, return_lse=True, implementation=implementation, **kwargs)

    paths.assert_agree(attend, q, k, v)
    # The meaning: exactly the call with the clipped, non-decreasing offsets.
    clipped = functools.partial(attend, cu_q=_masks.clip_offsets(cu_q, 64),
                                cu_k=_masks.clip_offsets(cu_k, 100))
    _assert_same_bits(paths, attend, clipped, q, k, v)


@pytest.mark.parametrize("q_lengths,kv_lengths", [
    ([-3, 40], [0, 77]),  # negative, past Sq; zero, past Sk
    ([I32.min, I32.max], [I32.max, I32.min]),
    ([5, 0], None),
    (None, [-1, 12]),
])
@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window=(4, 2), alignment="top_left"),
                                    {}])
def test_any_lengths_mean_the_clipped_ones_on_every_path(built, paths, q_lengths,
                                                          kv_lengths, kwargs):
    q, k, v = _inputs(24, 40, lead=(2,))
    lengths = {name: jnp.array(x, jnp.int32) for name, x in
               (("q_lengths", q_lengths), ("kv_lengths", kv_lengths)) if x is not None}

    def attend(implementation, q, k, v, lengths=lengths):
        return jax_fa4.attention(q, k, v, return_lse=True, implementation=implementation,
                                 **kwargs, **lengths)

    paths.assert_agree(attend, q, k, v)
    clipped = {name: jnp.clip(x, 0, 24 if name == "q_lengths" else 40)
               for name, x in lengths.items()}
    _assert_same_bits(paths, attend, functools.partial(attend, lengths=clipped), q, k, v)


def test_segment_ids_are_compared_for_equality_only(built, paths):
    q, k, v = _inputs(24, 40, lead=(2,))
    ids = np.array([I32.min, I32.max, -1, 0])
    q_ids = jnp.asarray(np.repeat(ids, 6)[None].repeat(2, 0), jnp.int32)
    k_ids = jnp.asarray(np.repeat(ids, 10)[None].repeat(2, 0), jnp.int32)

    def attend(implementation, q, k, v):
        return jax_fa4.attention(q, k, v, causal=True, return_lse=True,
                                 q_segment_ids=q_ids, kv_segment_ids=k_ids,
                                 implementation=implementation)

    paths.assert_agree(attend, q, k, v)
