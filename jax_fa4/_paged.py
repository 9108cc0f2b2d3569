"""`paged_attention`: attention over a paged KV cache, for inference.

A cache holds K and V in pages of `page_size` keys, (num_pages, page_size, Hkv, D / Dv);
sequence b's key j lives in page page_table[b, j // page_size] at slot j % page_size, for
j < kv_lengths[b]. Today the pages a batch's table names are gathered into a dense
(B, max_pages * page_size, Hkv, D) copy, which `attention` then runs with kv_lengths
(its kernels, split-KV included, where they run); a kernel that reads the pages in
place is not built yet, and on a GPU the first call says so once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_fa4 import _api, _fallback, _validate

GATHER_WARNING = (
    "jax_fa4.paged_attention gathers the pages of each call into a dense copy of K and V "
    "before the attention kernel (no kernel reads the pages in place yet): it reads the "
    "cache about three times per step")


def paged_attention(q, k_cache, v_cache, page_table, kv_lengths, *, causal=True, window=None,
                    softcap=None, sinks=None, softmax_scale=None, return_lse=False,
                    implementation=None):
    """Attention of q over the keys and values of a paged cache.

    q (B, Sq, Hq, D); k_cache (num_pages, page_size, Hkv, D); v_cache (num_pages,
    page_size, Hkv, Dv); page_table (B, max_pages) int32; kv_lengths (B,) int32 ->
    out (B, Sq, Hq, Dv), plus lse (B, Hq, Sq) float32 when `return_lse`.

    Sequence b's keys are its first kv_lengths[b] cache positions: key j at page
    page_table[b, j // page_size], slot j % page_size. Sq >= 1 query rows (a decode step,
    speculative tokens, a prefill chunk) are aligned bottom-right with each sequence's
    length: with causal, query i sees keys j <= kv_lengths[b] - Sq + i. window, softcap,
    sinks and softmax_scale are those of `attention`.

    Runtime values are defined for every int32: lengths are clipped to [0, max_pages *
    page_size] (a sequence of length 0 gives out = 0, lse = -inf), and a page id outside
    [0, num_pages) reads the nearest valid page (clipped), never outside the cache.
    implementation: as in `attention` (None: the kernels where they run). Inference only:
    jax.grad through it raises NotImplementedError.
    """
    _check(q, k_cache, v_cache, page_table, kv_lengths)
    if _api._gpu_devices() and implementation != "reference":
        _fallback.warn_message_once(GATHER_WARNING)
    run = functools.partial(
        _api.attention, causal=causal, window=window, softcap=softcap,
        softmax_scale=softmax_scale, return_lse=return_lse, implementation=implementation)
    return _inference_only(run, q, gather(k_cache, page_table),
                           gather(v_cache, page_table), kv_lengths, sinks)


def gather(cache, page_table):
    """(num_pages, page_size, Hkv, X), (B, max_pages) -> (B, max_pages * page_size, Hkv,
    X): each batch's pages in table order, ids clipped to the cache."""
    pages = jnp.clip(page_table, 0, cache.shape[0] - 1)
    dense = jnp.take(cache, pages, axis=0)
    return dense.reshape(page_table.shape[0], -1, *cache.shape[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _inference_only(run, q, k, v, kv_lengths, sinks):
    return run(q, k, v, kv_lengths=kv_lengths, sinks=sinks)


def _forward(run, q, k, v, kv_lengths, sinks):
    return _inference_only(run, q, k, v, kv_lengths, sinks), None


def _backward(run, residuals, cotangents):
    raise NotImplementedError(
        "jax_fa4.paged_attention has no gradient (it serves inference); differentiate "
        "jax_fa4.attention on the dense keys and values instead")


_inference_only.defvjp(_forward, _backward)


def _check(q, k_cache, v_cache, page_table, kv_lengths) -> None:
    """The paged operands' shapes; `attention` checks the rest on the gathered keys."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not _validate.is_array(x) or len(x.shape) != 4:
            raise ValueError(f"{name} must be an array of rank 4; got {_validate.describe(x)}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            "k_cache and v_cache must have the same (num_pages, page_size, Hkv); got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_pages, page_size = k_cache.shape[:2]
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"the cache needs at least one page of at least one key; got "
                         f"k_cache {tuple(k_cache.shape)}")
    batch = q.shape[0]
    if not (_validate.is_array(page_table) and len(page_table.shape) == 2
            and page_table.shape[0] == batch and page_table.shape[1] >= 1):
        raise ValueError(f"page_table must be an int32 array of shape (B, max_pages) with "
                         f"B = {batch} and max_pages >= 1; got "
                         f"{_validate.describe(page_table)}")
    _validate.check_int_array("page_table", page_table, tuple(page_table.shape),
                              "(B, max_pages)")
    if kv_lengths is None:
        raise ValueError("kv_lengths must be an int32 array of shape (B,); got None")
    _validate.check_int_array("kv_lengths", kv_lengths, (batch,), "(B,)")
