"""paged_attention on the GPU: the paged kernels (pages read in place) over pages in
random order with ragged lengths, bit for bit equal to `attention` on the same keys held
densely, and within the rule of tests/README.md, at every page size and head dim they
take, with pack-GQA, split-KV, causal, windows, softcap and sinks; page ids and lengths
out of range; a changing page table and lengths under jit (a CUDA graph); and the one
warning of the calls that gather the pages instead."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _fallback, _paged

pytestmark = pytest.mark.gpu

B, HQ, HKV, D = 2, 32, 8, 128


def _problem(seed, page_size, max_pages, sq, dtype=jnp.bfloat16, d=D, dv=D):
    rng = np.random.default_rng(seed)
    num_pages = B * max_pages + 5
    k_cache = jnp.asarray(rng.standard_normal((num_pages, page_size, HKV, d)), dtype)
    v_cache = jnp.asarray(rng.standard_normal((num_pages, page_size, HKV, dv)), dtype)
    table = jnp.asarray(rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages),
                        jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, sq, HQ, d)), dtype)
    return q, k_cache, v_cache, table


def _check(fa, what, q, k_cache, v_cache, table, lengths, **options):
    """The paged call against attention on the gathered keys (bitwise) and the rule."""
    assert _paged._kernel_spec(q, k_cache, v_cache, table, lengths, options.get("sinks"),
                               implementation="cute", **{
                                   "causal": True, "window": None, "softcap": None,
                                   "softmax_scale": None,
                                   **{n: x for n, x in options.items() if n != "sinks"}}
                               ) is not None, f"{what}: not the paged kernel"
    out, lse = jax.jit(lambda *a: jax_fa4.paged_attention(*a, return_lse=True,
                                                          **options))(
        q, k_cache, v_cache, table, lengths)
    k, v = _paged.gather(k_cache, table), _paged.gather(v_cache, table)
    want, want_lse = jax.jit(lambda q, k, v, n: jax_fa4.attention(
        q, k, v, kv_lengths=n, return_lse=True, **{"causal": True, **options}))(
        q, k, v, lengths)
    assert np.array_equal(np.asarray(out), np.asarray(want)), f"{what}: out"
    assert np.array_equal(np.asarray(lse), np.asarray(want_lse)), f"{what}: lse"
    mask = {n: options[n] for n in ("sinks", "window", "softcap") if n in options}
    fa.assert_attention(what, out, lse, q, k, v, causal=options.get("causal", True),
                        segments={"kv_lengths": jnp.clip(lengths, 0, k.shape[1])}, **mask)


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("sq,causal", [(1, True), (4, True), (64, False)])
def test_paged_kernel(fa, page_size, sq, causal):
    max_pages = 8192 // page_size
    q, k_cache, v_cache, table = _problem(page_size + sq, page_size, max_pages, sq)
    lengths = jnp.asarray([8192 - 300, 1000], jnp.int32)
    _check(fa, f"page {page_size} sq {sq}", q, k_cache, v_cache, table, lengths,
           causal=causal)


@pytest.mark.parametrize("dtype,d", [("bfloat16", 64), ("float16", 64), ("bfloat16", 256),
                                     ("float16", 128)])
def test_paged_head_dims(fa, dtype, d):
    q, k_cache, v_cache, table = _problem(d, 32, 40, 3, jnp.dtype(dtype), d, d)
    _check(fa, f"{dtype} d{d}", q, k_cache, v_cache, table,
           jnp.asarray([1280, 333], jnp.int32))


@pytest.mark.parametrize("name,options", [
    ("window", dict(window=(200, 0))),
    ("softcap", dict(softcap=15.0)),
    ("sinks", dict(sinks=jnp.linspace(-2.0, 3.0, HQ))),
    ("no mask", dict(causal=False)),
])
def test_paged_features(fa, name, options):
    q, k_cache, v_cache, table = _problem(len(name), 64, 50, 5)
    _check(fa, name, q, k_cache, v_cache, table, jnp.asarray([3200, 77], jnp.int32),
           **options)


def test_out_of_range_ids_and_lengths(fa):
    """Table entries outside the cache read the nearest page, lengths are clipped: the
    kernel clamps what the gather clips."""
    q, k_cache, v_cache, table = _problem(9, 32, 30, 2)
    wild = table.at[0, 3].set(-7).at[1, 29].set(10 ** 6).at[1, 0].set(k_cache.shape[0])
    _check(fa, "wild ids", q, k_cache, v_cache, wild, jnp.asarray([10 ** 6, -2], jnp.int32))


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


def test_warns_once_when_pages_are_gathered(fa, monkeypatch):
    """Pages of 24 keys have no paged kernel: gathered, said once, and right; head dim 96
    has none either, and implementation="cute" says so."""
    monkeypatch.setattr(_fallback, "_warned", set())
    lengths = jnp.asarray([10, 64], jnp.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q, k_cache, v_cache, table = _problem(5, 16, 4, 1)
        jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths)  # in place: silent
        q, k_cache, v_cache, table = _problem(5, 24, 4, 1)
        for _ in range(2):
            out, lse = jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths,
                                               return_lse=True)
    assert [str(w.message) for w in caught] == [_paged.GATHER_WARNING]
    k, v = _paged.gather(k_cache, table), _paged.gather(v_cache, table)
    fa.assert_attention("gathered", out, lse, q, k, v, causal=True,
                        segments={"kv_lengths": lengths})
    q, k_cache, v_cache, table = _problem(6, 16, 4, 1, d=96, dv=96)
    with pytest.raises(NotImplementedError, match="no paged kernel"):
        jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths, implementation="cute")
