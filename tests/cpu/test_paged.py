"""paged_attention (jax_fa4/_paged.py): equal to `attention` over the same keys held
densely, for pages in any order, ragged and out-of-range lengths and page ids; its
validation; no gradient; and the kernel call it lowers to for CUDA."""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _api, _fallback, _paged, _path

B, HQ, HKV, D = 3, 4, 2, 16


class Hopper:
    compute_capability = "9.0"


def _cache(rng, page_size, max_pages, num_pages, dv=D, dtype=jnp.float32):
    """Dense K, V (B, max_pages * page_size, Hkv, D / Dv) scattered into a cache of
    num_pages pages (pages in random order, spare pages filled with noise), and the
    page table that reads them back."""
    length = max_pages * page_size
    k = rng.standard_normal((B, length, HKV, D)).astype(np.float32)
    v = rng.standard_normal((B, length, HKV, dv)).astype(np.float32)
    order = rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages)
    k_cache = rng.standard_normal((num_pages, page_size, HKV, D)).astype(np.float32)
    v_cache = rng.standard_normal((num_pages, page_size, HKV, dv)).astype(np.float32)
    k_cache[order] = k.reshape(B, max_pages, page_size, HKV, D)
    v_cache[order] = v.reshape(B, max_pages, page_size, HKV, dv)
    arrays = k, v, k_cache, v_cache
    return (*(jnp.asarray(x, dtype) for x in arrays), jnp.asarray(order, jnp.int32))


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("sq,options", [
    (1, {}),
    (3, {"causal": True}),
    (5, {"causal": True, "window": (40, 0), "softcap": 7.0}),
    (2, {"causal": False, "sinks": True}),
])
def test_paged_equals_dense(page_size, sq, options):
    rng = np.random.default_rng(page_size * 10 + sq)
    max_pages = max(2, 300 // page_size)
    k, v, k_cache, v_cache, table = _cache(rng, page_size, max_pages, B * max_pages + 3)
    q = jnp.asarray(rng.standard_normal((B, sq, HQ, D)), jnp.float32)
    capacity = max_pages * page_size
    # A full sequence, a ragged one, an empty one.
    lengths = jnp.asarray([capacity, capacity // 2 + 7, 0], jnp.int32)
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = jnp.asarray(rng.standard_normal(HQ), jnp.float32)
    out, lse = jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths,
                                       return_lse=True, **options)
    options.setdefault("causal", True)
    want_out, want_lse = jax_fa4.attention(q, k, v, kv_lengths=lengths, return_lse=True,
                                           **options)
    np.testing.assert_allclose(out, want_out, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(lse, want_lse, atol=1e-6, rtol=1e-6)
    # The empty sequence: out 0, with sinks too (they add weight, not values); lse -inf
    # without sinks.
    assert not np.any(out[2])
    assert np.all(np.isneginf(lse[2])) or "sinks" in options


def test_out_of_range_values_are_clipped():
    """Lengths past the table's capacity mean all of it, negative ones none; page ids
    outside [0, num_pages) read the nearest page."""
    rng = np.random.default_rng(0)
    _, _, k_cache, v_cache, table = _cache(rng, 16, 4, 20)
    q = jnp.asarray(rng.standard_normal((B, 1, HQ, D)), jnp.float32)
    wild = table.at[0, 1].set(-5).at[1, 3].set(1000)
    clipped = jnp.clip(wild, 0, 19)
    lengths = jnp.asarray([10_000, -3, 40], jnp.int32)
    got = jax_fa4.paged_attention(q, k_cache, v_cache, wild, lengths)
    want = jax_fa4.paged_attention(q, k_cache, v_cache, clipped,
                                   jnp.asarray([64, 0, 40], jnp.int32))
    np.testing.assert_array_equal(got, want)


def test_jit_and_changing_tables():
    rng = np.random.default_rng(1)
    k, v, k_cache, v_cache, table = _cache(rng, 32, 3, 12)
    q = jnp.asarray(rng.standard_normal((B, 1, HQ, D)), jnp.float32)
    step = jax.jit(jax_fa4.paged_attention)
    for n in ([96, 1, 50], [5, 96, 0]):
        lengths = jnp.asarray(n, jnp.int32)
        np.testing.assert_allclose(
            step(q, k_cache, v_cache, table, lengths),
            jax_fa4.attention(q, k, v, kv_lengths=lengths, causal=True), atol=1e-6)


@pytest.mark.parametrize("sq,dv", [(1, D), (3, 8)])
def test_appending_writes_the_new_rows_then_attends(sq, dv):
    """k_new / v_new land at keys L - Sq .. L - 1 of each sequence (L clipped to the
    table; keys below 0 dropped), in their pages; the rest of both caches is untouched,
    and the attention is that of the updated caches."""
    rng = np.random.default_rng(sq)
    page_size, max_pages = 16, 4
    _, _, k_cache, v_cache, table = _cache(rng, page_size, max_pages, B * max_pages + 2, dv)
    q = jnp.asarray(rng.standard_normal((B, sq, HQ, D)), jnp.float32)
    k_new = jnp.asarray(rng.standard_normal((B, sq, HKV, D)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((B, sq, HKV, dv)), jnp.float32)
    lengths = jnp.asarray([37, 2, 10_000], jnp.int32)  # ragged, shorter than sq, clipped
    out, lse, k2, v2 = jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths,
                                               k_new=k_new, v_new=v_new, return_lse=True)
    k_dense, v_dense = (np.array(_paged.gather(c, table)) for c in (k_cache, v_cache))
    for b, length in enumerate(np.clip(np.asarray(lengths), 0, max_pages * page_size)):
        for i in range(sq):
            if length - sq + i >= 0:
                k_dense[b, length - sq + i] = k_new[b, i]
                v_dense[b, length - sq + i] = v_new[b, i]
    np.testing.assert_array_equal(_paged.gather(k2, table), k_dense)
    np.testing.assert_array_equal(_paged.gather(v2, table), v_dense)
    spare = np.setdiff1d(np.arange(k_cache.shape[0]), np.asarray(table))
    np.testing.assert_array_equal(k2[spare], k_cache[spare])
    want_out, want_lse = jax_fa4.attention(q, jnp.asarray(k_dense), jnp.asarray(v_dense),
                                           kv_lengths=lengths, causal=True, return_lse=True)
    np.testing.assert_allclose(out, want_out, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(lse, want_lse, atol=1e-6, rtol=1e-6)
    out_only, *_ = jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths,
                                           k_new=k_new, v_new=v_new)
    np.testing.assert_array_equal(out_only, out)


@pytest.mark.parametrize("change,message", [
    (dict(k_new=jnp.zeros((B, 1, HKV, D))), "k_new and v_new go together"),
    (dict(k_new=jnp.zeros((B, 2, HKV, D)), v_new=jnp.zeros((B, 2, HKV, D))),
     "k_new must be a float32 array of shape \\(B, Sq, Hkv, D\\) = \\(3, 1, 2, 16\\)"),
    (dict(k_new=jnp.zeros((B, 1, HKV, D)), v_new=jnp.zeros((B, 1, HKV, D), jnp.bfloat16)),
     "v_new must be a float32 array"),
])
def test_appending_validation(change, message):
    args = dict(q=jnp.zeros((B, 1, HQ, D)), k_cache=jnp.zeros((8, 16, HKV, D)),
                v_cache=jnp.zeros((8, 16, HKV, D)), page_table=jnp.zeros((B, 2), jnp.int32),
                kv_lengths=jnp.zeros((B,), jnp.int32))
    with pytest.raises(ValueError, match=message):
        jax_fa4.paged_attention(**args, **change)


def test_gradients_are_refused():
    rng = np.random.default_rng(2)
    _, _, k_cache, v_cache, table = _cache(rng, 16, 2, 8)
    q = jnp.asarray(rng.standard_normal((B, 1, HQ, D)), jnp.float32)
    lengths = jnp.asarray([3, 20, 32], jnp.int32)
    loss = lambda q: jnp.sum(jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths))
    with pytest.raises(NotImplementedError, match="no gradient"):
        jax.grad(loss)(q)
    # Forward mode too (a custom_vjp had refused it with JAX's generic TypeError).
    with pytest.raises(NotImplementedError, match="no gradient"):
        jax.jvp(loss, (q,), (q,))


@pytest.mark.parametrize("change,message", [
    (dict(q=jnp.zeros((B, HQ, D))), "q must be an array of rank 4"),
    (dict(v_cache=jnp.zeros((9, 16, HKV, D))), "same \\(num_pages, page_size, Hkv\\)"),
    (dict(k_cache=jnp.zeros((0, 16, HKV, D)), v_cache=jnp.zeros((0, 16, HKV, D))),
     "at least one page"),
    (dict(page_table=jnp.zeros((B + 1, 2), jnp.int32)), "page_table must be an int32 array"),
    (dict(page_table=jnp.zeros((B, 2), jnp.float32)), "page_table must be an int32 array"),
    (dict(kv_lengths=None), "kv_lengths must be an int32 array"),
    (dict(kv_lengths=jnp.zeros((B, 1), jnp.int32)), "kv_lengths must be an int32 array"),
    # in the caches' terms, not the gathered keys' (B, max_pages * page_size, Hkv, D)
    (dict(k_cache=jnp.zeros((8, 16, 3, D)), v_cache=jnp.zeros((8, 16, 3, D))),
     r"multiple of the caches' heads Hkv = 3 \(GQA/MQA\); got q \(3, 1, 4, 16\), "
     r"k_cache \(8, 16, 3, 16\)"),
    (dict(q=jnp.zeros((B, 1, HQ, 2 * D))),
     r"same head_dim D; got q \(3, 1, 4, 32\), k_cache \(8, 16, 2, 16\)"),
])
def test_validation(change, message):
    args = dict(q=jnp.zeros((B, 1, HQ, D)), k_cache=jnp.zeros((8, 16, HKV, D)),
                v_cache=jnp.zeros((8, 16, HKV, D)), page_table=jnp.zeros((B, 2), jnp.int32),
                kv_lengths=jnp.zeros((B,), jnp.int32))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        jax_fa4.paged_attention(**args)


def sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _fwd_operands(text):
    """The operand types of the one jax_fa4_fwd call in `text`."""
    calls = re.findall(r"custom_call @jax_fa4_fwd\(.*?: \((.*?)\) ->", text)
    assert len(calls) == 1, calls
    return calls[0].split(", ")


def test_decode_lowers_to_the_kernel(built):
    """bf16 decode over 64-key pages lowers for CUDA to the paged forward kernel: the
    page table is its last operand (no gather), split-KV since batch 1 leaves SMs idle,
    and there is no backward."""
    q, cache = sds(1, 1, 32, 128), sds(300, 64, 8, 128)
    table, lengths = sds(1, 128, dtype=jnp.int32), sds(1, dtype=jnp.int32)
    text = jax.jit(jax_fa4.paged_attention).trace(q, cache, cache, table, lengths).lower(
        lowering_platforms=("cuda",)).as_text()
    operands = _fwd_operands(text)
    assert "jax_fa4_bwd" not in text
    # q (packed rows), the caches, rows, keys, plan, then the page table.
    assert operands[1:3] == ["tensor<300x64x8x128xbf16>"] * 2, operands
    assert operands[-1] == "tensor<1x128xi32>", operands
    if _path.sm_count() == 132:
        assert "num_splits = 16 : i32" in text


def test_appending_decode_lowers_to_the_kernel_in_place(built):
    """With k_new / v_new the paged kernel takes them after the page table and returns
    the caches aliased to its k and v operands: donated, XLA writes them in place (no
    scatter, no copy)."""
    q, cache, new = sds(1, 1, 32, 128), sds(300, 64, 8, 128), sds(1, 1, 8, 128)
    table, lengths = sds(1, 128, dtype=jnp.int32), sds(1, dtype=jnp.int32)
    step = jax.jit(lambda q, kc, vc, t, n, kn, vn: jax_fa4.paged_attention(
        q, kc, vc, t, n, k_new=kn, v_new=vn), donate_argnums=(1, 2))
    text = step.trace(q, cache, cache, table, lengths, new, new).lower(
        lowering_platforms=("cuda",)).as_text()
    operands = _fwd_operands(text)
    assert operands[-3:] == ["tensor<1x128xi32>"] + ["tensor<1x1x8x128xbf16>"] * 2, operands
    assert re.search(r"output_operand_aliases = \[#stablehlo.output_operand_alias<"
                     r"output_tuple_indices = \[5\], operand_index = 1,", text), text
    assert "scatter" not in text


@pytest.mark.parametrize("cache_axis,appends,folded", [
    (None, False, True),  # one cache, per-element sequences: the batch grows
    (0, False, False),  # a cache per element: one call each
    (None, True, False),  # appended rows: each element's updated cache is its own
    (0, True, False),
])
def test_vmap_of_paged_decode(built, cache_axis, appends, folded):
    """The FFI call had got the vmapped caches as 5-D arrays (rejected at run time).
    Appended rows are scattered before a call without them: in the loop, the call's
    cache results had not aliased a shared cache (the handler refused it on an H100)."""
    n, q = 3, sds(3, 2, 1, 32, 128)
    cache = sds(*((n,) if cache_axis == 0 else ()), 300, 64, 8, 128)
    table, lengths = sds(n, 2, 128, dtype=jnp.int32), sds(n, 2, dtype=jnp.int32)
    new = sds(n, 2, 1, 8, 128)

    def step(q, kc, vc, t, lengths, kn, vn):
        if appends:
            return jax_fa4.paged_attention(q, kc, vc, t, lengths, k_new=kn, v_new=vn)
        return jax_fa4.paged_attention(q, kc, vc, t, lengths)

    batched = jax.vmap(step, in_axes=(0, cache_axis, cache_axis, 0, 0, 0, 0))
    text = jax.jit(batched).trace(q, cache, cache, table, lengths, new, new).lower(
        lowering_platforms=("cuda",)).as_text()
    operands = _fwd_operands(text)
    assert operands[1:3] == ["tensor<300x64x8x128xbf16>"] * 2, operands
    assert operands[-1] == f"tensor<{2 * n if folded else 2}x128xi32>", operands
    assert ("stablehlo.while" in text) != folded
    assert "output_operand_aliases" not in text
    assert ("stablehlo.scatter" in text) == appends
    results = jax.eval_shape(batched, q, cache, cache, table, lengths, new, new)
    if appends:
        assert results[1].shape == (n, 300, 64, 8, 128)
    else:
        assert results.shape == (n, 2, 1, 32, 128)


@pytest.mark.parametrize("cache_axis,appends", [(None, False), (0, False), (None, True),
                                               (0, True)])
def test_vmap_rule_matches_each_element(built, monkeypatch, cache_axis, appends):
    """The vmap rule run on the CPU, the kernel call emulated by the gather path (which
    checks that it gets one batch of 4-D caches, as the FFI handler does): each element
    equals the call alone; with appended rows, its rows scattered first and the call
    without them, and its own updated caches."""
    n, batch, page_size, max_pages, num_pages = 3, 2, 16, 4, 20
    rng = np.random.default_rng(5)

    def emulated(spec, q, k_cache, v_cache, page_table, kv_lengths, sinks, k_new, v_new,
                 table):
        assert q.ndim == k_cache.ndim == 4 and page_table.shape[0] == q.shape[0]
        attention = functools.partial(_api.attention, causal=True,
                                      implementation="reference")
        return _paged._gathered(attention, True, q, k_cache, v_cache, page_table,
                                kv_lengths, sinks, k_new, v_new, table)

    monkeypatch.setattr(_path, "gpu_devices", lambda: (Hopper(),))
    monkeypatch.setattr(_paged, "_kernel", emulated)
    _paged._batched.cache_clear()
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    q, k_new, v_new = normal(n, batch, 1, 4, 64), normal(n, batch, 1, 2, 64), normal(
        n, batch, 1, 2, 64)
    cache_shape = (*((n,) if cache_axis == 0 else ()), num_pages, page_size, 2, 64)
    k_cache, v_cache = normal(*cache_shape), normal(*cache_shape)
    table = jnp.asarray(rng.integers(0, num_pages, (n, batch, max_pages)), jnp.int32)
    lengths = jnp.asarray(rng.integers(0, max_pages * page_size + 1, (n, batch)), jnp.int32)

    def step(q, kc, vc, t, lengths, kn, vn, appends=appends):
        new = dict(k_new=kn, v_new=vn) if appends else {}
        return jax_fa4.paged_attention(q, kc, vc, t, lengths, return_lse=True,
                                       implementation="cute", **new)

    got = jax.jit(jax.vmap(step, in_axes=(0, cache_axis, cache_axis, 0, 0, 0, 0)))(
        q, k_cache, v_cache, table, lengths, k_new, v_new)
    try:
        for i in range(n):
            kc, vc = (k_cache, v_cache) if cache_axis is None else (k_cache[i], v_cache[i])
            caches = ()
            if appends:
                kc = _paged.append(kc, k_new[i], table[i], lengths[i])
                vc = _paged.append(vc, v_new[i], table[i], lengths[i])
                caches = (kc, vc)
            want = (*step(q[i], kc, vc, table[i], lengths[i], None, None, appends=False),
                    *caches)
            assert len(got) == len(want)
            for name, g, w in zip(("out", "lse", "k_cache", "v_cache"), got, want):
                np.testing.assert_allclose(np.asarray(g[i], np.float32),
                                           np.asarray(w, np.float32), rtol=1e-6, atol=1e-6,
                                           err_msg=f"{name} {i}")
    finally:
        _paged._batched.cache_clear()  # its entries call the emulation


@pytest.mark.parametrize("page_size,dims,kernel_d", [(24, (128, 128), 128),
                                                     (64, (80, 80), 96),  # zero-padded
                                                     (64, (192, 128), 192)])
def test_other_pages_and_head_dims_are_gathered(built, monkeypatch, page_size, dims,
                                                 kernel_d):
    """Page sizes off the 16-key grid and head dims without a paged kernel lower to the
    dense kernel on gathered keys; implementation="cute" says why it cannot page."""
    d, dv = dims
    q = sds(1, 1, 32, d)
    k_cache, v_cache = sds(300, page_size, 8, d), sds(300, page_size, 8, dv)
    table, lengths = sds(1, 16, dtype=jnp.int32), sds(1, dtype=jnp.int32)
    text = jax.jit(jax_fa4.paged_attention).trace(
        q, k_cache, v_cache, table, lengths).lower(lowering_platforms=("cuda",)).as_text()
    operands = _fwd_operands(text)
    assert operands[1] == f"tensor<1x{16 * page_size}x8x{kernel_d}xbf16>", operands  # gathered
    monkeypatch.setattr(_path, "gpu_devices", lambda: (Hopper(),))
    with pytest.raises(NotImplementedError, match="paged kernel"):
        _paged._kernel_spec(q, k_cache, v_cache, table, lengths, None, causal=True,
                            window=None, softcap=None, softmax_scale=None,
                            implementation="cute")


def test_warns_on_a_gpu_that_pages_are_gathered(monkeypatch, fresh_warnings):
    """On a GPU the gather costs a copy of the cache per call: said once; not on CPUs,
    where the reference runs anyway, nor when the reference is asked for."""
    rng = np.random.default_rng(3)
    _, _, k_cache, v_cache, table = _cache(rng, 16, 2, 8)
    q = jnp.asarray(rng.standard_normal((B, 1, HQ, D)), jnp.float32)
    lengths = jnp.asarray([3, 20, 32], jnp.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths)
        monkeypatch.setattr(_path, "gpu_devices", lambda: ("a GPU",))
        jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths,
                                implementation="reference")
        for _ in range(2):
            jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths)
    # (The fake GPU, no Hopper, also brings the fallback's own warning.)
    assert [str(w.message) for w in caught if "gathers" in str(w.message)] == [
        _paged.GATHER_WARNING]


def test_a_gpu_without_paged_kernels_hears_only_of_what_runs(built, monkeypatch,
                                                             fresh_warnings):
    # The probe for a paged kernel plans with return_lse=True; on an A100 it had warned
    # that cuDNN gives no lse, which the caller never asked for.
    class A100:
        compute_capability = "8.0"

    monkeypatch.setattr(_path, "gpu_devices", lambda: (A100(),))
    monkeypatch.setattr(_fallback, "through_jax_nn", functools.partial(
        _fallback.through_jax_nn, implementation="xla"))
    rng = np.random.default_rng(4)
    _, _, k_cache, v_cache, table = _cache(rng, 16, 2, 8)
    k_cache, v_cache = (x.astype(jnp.bfloat16) for x in (k_cache, v_cache))
    q = jnp.asarray(rng.standard_normal((B, 2, HQ, D)), jnp.bfloat16)  # even, for cuDNN
    lengths = jnp.asarray([4, 20, 32], jnp.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths, causal=False)
    messages = [str(w.message) for w in caught]
    assert _paged.GATHER_WARNING in messages
    assert not [m for m in messages if "return_lse" in m], messages


@pytest.mark.parametrize("batch,heads_kv", [(0, HKV), (B, 0)])
def test_empty_batch_or_heads(batch, heads_kv):
    # The gather's reshape had inferred a -1 from a size of 0 (ZeroDivisionError).
    q = jnp.zeros((batch, 1, heads_kv * 2, D))
    cache = jnp.zeros((8, 16, heads_kv, D))
    out, lse = jax_fa4.paged_attention(q, cache, cache, jnp.zeros((batch, 2), jnp.int32),
                                       jnp.zeros((batch,), jnp.int32), return_lse=True)
    assert out.shape == q.shape and lse.shape == (batch, heads_kv * 2, 1)


def test_the_gather_asks_for_lse_only_when_it_is_returned(monkeypatch):
    # cuDNN refuses calls that return lse: on a GPU the kernels do not run on, a paged
    # call that returns none had always taken the reference instead.
    rng = np.random.default_rng(4)
    _, _, k_cache, v_cache, table = _cache(rng, 16, 2, 8)
    q = jnp.asarray(rng.standard_normal((B, 1, HQ, D)), jnp.float32)
    lengths = jnp.asarray([3, 20, 32], jnp.int32)
    asked, attention = [], _api.attention

    def recording(*args, **kwargs):
        asked.append(kwargs["return_lse"])
        return attention(*args, **kwargs)

    monkeypatch.setattr(_api, "attention", recording)
    out = jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths)
    with_lse, _ = jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths, return_lse=True)
    assert asked == [False, True]
    np.testing.assert_array_equal(out, with_lse)
