"""paged_attention on the GPU: over pages in random order with ragged lengths, equal
bit for bit to `attention` on the same keys held densely (both run the kernels, split-KV
included), within the rule of tests/README.md; a changing page table and lengths under
jit (a CUDA graph); and the one warning that says the pages are gathered."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _fallback, _paged

pytestmark = pytest.mark.gpu

B, HQ, HKV, D = 2, 32, 8, 128


def _problem(seed, page_size, max_pages, sq, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    num_pages = B * max_pages + 5
    k_cache = jnp.asarray(rng.standard_normal((num_pages, page_size, HKV, D)), dtype)
    v_cache = jnp.asarray(rng.standard_normal((num_pages, page_size, HKV, D)), dtype)
    table = jnp.asarray(rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages),
                        jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, sq, HQ, D)), dtype)
    return q, k_cache, v_cache, table


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("sq,causal", [(1, True), (4, True), (64, False)])
def test_paged_equals_dense_kernel(fa, page_size, sq, causal):
    max_pages = 8192 // page_size
    q, k_cache, v_cache, table = _problem(page_size + sq, page_size, max_pages, sq)
    lengths = jnp.asarray([8192 - 300, 1000], jnp.int32)
    out, lse = jax.jit(lambda *a: jax_fa4.paged_attention(*a, causal=causal,
                                                          return_lse=True))(
        q, k_cache, v_cache, table, lengths)
    k, v = _paged.gather(k_cache, table), _paged.gather(v_cache, table)
    want, want_lse = jax.jit(lambda q, k, v, n: jax_fa4.attention(
        q, k, v, kv_lengths=n, causal=causal, return_lse=True))(q, k, v, lengths)
    assert np.array_equal(np.asarray(out), np.asarray(want))
    assert np.array_equal(np.asarray(lse), np.asarray(want_lse))
    fa.assert_attention(f"paged {page_size}", out, lse, q, k, v, causal=causal,
                        segments={"kv_lengths": lengths})


def test_changing_tables_under_jit(fa):
    q, k_cache, v_cache, table = _problem(3, 64, 64, 1)
    step = jax.jit(lambda *a: jax_fa4.paged_attention(*a, return_lse=True))
    rng = np.random.default_rng(4)
    for n in ([4096, 1], [0, 3000], [17, 4096]):
        table = jnp.asarray(rng.permutation(k_cache.shape[0])[:B * 64].reshape(B, 64),
                            jnp.int32)
        lengths = jnp.asarray(n, jnp.int32)
        out, lse = step(q, k_cache, v_cache, table, lengths)
        k, v = _paged.gather(k_cache, table), _paged.gather(v_cache, table)
        fa.assert_attention(f"lengths {n}", out, lse, q, k, v, causal=True,
                            segments={"kv_lengths": lengths})


def test_warns_once_that_pages_are_gathered(monkeypatch):
    monkeypatch.setattr(_fallback, "_warned", set())
    q, k_cache, v_cache, table = _problem(5, 16, 4, 1)
    lengths = jnp.asarray([10, 64], jnp.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths)
    assert [str(w.message) for w in caught] == [_paged.GATHER_WARNING]
