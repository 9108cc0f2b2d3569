"""paged_attention on the GPU: the paged kernels (pages read in place) over pages in
random order with ragged lengths, bit for bit equal to `attention` on the same keys held
densely, and within the rule of tests/README.md, at every page size and head dim they
take, with pack-GQA, split-KV, causal, windows, softcap and sinks; page ids and lengths
out of range; a changing page table and lengths under jit (replayed in a CUDA graph:
test_gpu_command_buffer.py); and the one warning of the calls that gather the pages
instead."""

import functools
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
    paged = jax.jit(lambda *a: jax_fa4.paged_attention(*a, return_lse=True, **options))
    # What the call lowers to (not only what a "cute" probe plans): the paged kernel,
    # with nothing gathering the pages, else the comparison below would hold trivially.
    text = paged.lower(q, k_cache, v_cache, table, lengths).as_text()
    assert "jax_fa4_fwd" in text and "gather" not in text, f"{what}: pages gathered"
    out, lse = paged(q, k_cache, v_cache, table, lengths)
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


@pytest.mark.parametrize("page_size", [32, 64, 128, 256])
@pytest.mark.parametrize("sq,causal", [(1, True), (64, False)])
def test_paged_d64_page_sizes(fa, page_size, sq, causal):
    """d64 (the generation example's head dim) at page sizes below, equal to and above
    its key blocks (64 keys in the split kernel, 128 in the other)."""
    max_pages = 4096 // page_size
    q, k_cache, v_cache, table = _problem(page_size + sq + 64, page_size, max_pages, sq,
                                          d=64, dv=64)
    lengths = jnp.asarray([4096 - 100, 700], jnp.int32)
    _check(fa, f"d64 page {page_size} sq {sq}", q, k_cache, v_cache, table, lengths,
           causal=causal)


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


def _appending(seed, batch, page_size, max_pages, sq, d, dtype=jnp.bfloat16):
    """A cache whose table covers the batch's pages in random order, q and its tokens'
    new keys and values."""
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + 3
    caches = [jnp.asarray(rng.standard_normal((num_pages, page_size, HKV, d)), dtype)
              for _ in range(2)]
    table = jnp.asarray(rng.permutation(num_pages)[:batch * max_pages]
                        .reshape(batch, max_pages), jnp.int32)
    q, k_new, v_new = (jnp.asarray(rng.standard_normal((batch, sq, h, d)), dtype)
                       for h in (HQ, HKV, HKV))
    return q, *caches, table, k_new, v_new


@pytest.mark.parametrize("batch,page_size,d,sq,causal", [
    (1, 64, 128, 1, True),  # split-KV decode, pack-GQA
    (2, 16, 64, 1, True),
    (3, 256, 256, 4, True),  # speculative tokens
    (2, 32, 128, 64, False),  # a prefill chunk: rows spread over lanes and blocks
    (40, 64, 64, 1, True),  # a batch that fills the GPU: one split
])
def test_appending_rows(fa, batch, page_size, d, sq, causal):
    """The kernel writes k_new / v_new into their pages as it attends: both caches bit
    for bit those of scattering them first (`_paged.append`, XLA), out and lse within
    the rule on the keys so written. Not bit for bit the call that scatters first and
    then attends: an appending call visits its key blocks upwards (the new rows' blocks
    last, jax_fa4/_ffi_calls.py), the other downwards, so P is rounded to 16 bits
    against other running maxima (up to 7 bf16 units in the last place apart, seen on
    an H100). Lengths: ragged, shorter than the new rows (the first are dropped), zero,
    and past the table (clipped)."""
    max_pages = 4096 // page_size
    q, k_cache, v_cache, table, k_new, v_new = _appending(batch + d, batch, page_size,
                                                          max_pages, sq, d)
    lengths = jnp.asarray(([4096 - 37, 2, 0, 10 ** 6, 1] * batch)[:batch], jnp.int32)
    assert _paged._kernel_spec(q, k_cache, v_cache, table, lengths, None,
                               implementation="cute", causal=causal, window=None,
                               softcap=None, softmax_scale=None) is not None

    @jax.jit
    def fused(q, k_cache, v_cache, table, lengths, k_new, v_new):
        return jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths, k_new=k_new,
                                       v_new=v_new, causal=causal, return_lse=True)

    out, lse, k_after, v_after = fused(q, k_cache, v_cache, table, lengths, k_new, v_new)
    k_want = jax.jit(_paged.append)(k_cache, k_new, table, lengths)
    v_want = jax.jit(_paged.append)(v_cache, v_new, table, lengths)
    for name, x, y in (("k_cache", k_after, k_want), ("v_cache", v_after, v_want)):
        assert np.array_equal(np.asarray(x), np.asarray(y)), name
    k, v = _paged.gather(k_want, table), _paged.gather(v_want, table)
    fa.assert_attention(f"appended b{batch} d{d} sq{sq}", out, lse, q, k, v,
                        causal=causal, segments={"kv_lengths": jnp.clip(lengths, 0, k.shape[1])})


def test_appending_in_a_decode_loop(fa):
    """A decode loop under jit (the caches a loop carry, written in place by the kernel;
    one compiled loop): its caches bit for bit those of the same loop that scatters
    each step's row first, each step's out and lse within the rule on the keys up to
    its own (test_appending_rows says why not bit for bit that loop's)."""
    batch, page_size, max_pages, steps = 2, 64, 20, 6
    q, k_cache, v_cache, table, k_new, v_new = _appending(11, batch, page_size, max_pages,
                                                          steps, 128)
    start = jnp.asarray([700, 64], jnp.int32)

    def loop(fused):
        def step(i, state):
            outs, lses, k_cache, v_cache = state
            lengths = start + i + 1
            rows = [jax.lax.dynamic_slice_in_dim(x, i, 1, axis=1) for x in (q, k_new, v_new)]
            if fused:
                out, lse, k_cache, v_cache = jax_fa4.paged_attention(
                    rows[0], k_cache, v_cache, table, lengths, k_new=rows[1], v_new=rows[2],
                    return_lse=True)
                outs = jax.lax.dynamic_update_slice_in_dim(outs, out, i, axis=1)
                lses = jax.lax.dynamic_update_slice_in_dim(lses, lse, i, axis=2)
            else:
                k_cache = _paged.append(k_cache, rows[1], table, lengths)
                v_cache = _paged.append(v_cache, rows[2], table, lengths)
            return outs, lses, k_cache, v_cache

        lses = jnp.zeros((batch, HQ, steps), jnp.float32)
        return jax.jit(lambda k_cache, v_cache: jax.lax.fori_loop(
            0, steps, step, (jnp.zeros_like(q), lses, k_cache, v_cache)))(k_cache, v_cache)

    (outs, lses, *got), (_, _, *want) = loop(True), loop(False)
    for name, x, y in zip(("k_cache", "v_cache"), got, want):
        assert np.array_equal(np.asarray(x), np.asarray(y)), name
    k, v = _paged.gather(got[0], table), _paged.gather(got[1], table)
    for i in range(steps):
        fa.assert_attention(f"decode loop step {i}", outs[:, i:i + 1], lses[:, :, i:i + 1],
                            q[:, i:i + 1], k, v, causal=True,
                            segments={"kv_lengths": start + i + 1})


@pytest.mark.parametrize("shared_cache,appends", [(True, False), (False, False),
                                                  (True, True), (False, True)])
def test_vmap(shared_cache, appends):
    """vmap over 3 elements, each of batch 2: sharing one cache, folded into one call of
    batch 6; a cache per element, or appended rows, one call each (lax.map). Each
    element bit for bit the call alone (the same spec: splits per element's shape);
    with appended rows, the call alone on its caches with the rows scattered first
    (`_paged.append`), which the vmapped call returns as its caches."""
    n, batch, page_size, max_pages = 3, 2, 64, 16
    q, k_cache, v_cache, table, k_new, v_new = _appending(21, n * batch, page_size,
                                                          max_pages, 1, D)
    lengths = jnp.asarray([900, 1, 0, 1024, 300, 64], jnp.int32)
    per = lambda x: x.reshape(n, batch, *x.shape[1:])  # noqa: E731
    caches = (k_cache, v_cache) if shared_cache else tuple(
        jnp.stack([c, jnp.roll(c, 1, axis=0), -c]) for c in (k_cache, v_cache))

    def step(q, kc, vc, t, lengths, kn, vn):
        new = dict(k_new=kn, v_new=vn) if appends else {}
        return jax_fa4.paged_attention(q, kc, vc, t, lengths, return_lse=True, **new)

    axis = None if shared_cache else 0
    got = jax.jit(jax.vmap(step, in_axes=(0, axis, axis, 0, 0, 0, 0)))(
        per(q), *caches, per(table), per(lengths), per(k_new), per(v_new))
    for i in range(n):
        kc, vc = caches if shared_cache else (c[i] for c in caches)
        t, n_i = per(table)[i], per(lengths)[i]
        appended = ()
        if appends:
            kc = _paged.append(kc, per(k_new)[i], t, n_i)
            vc = _paged.append(vc, per(v_new)[i], t, n_i)
            appended = (kc, vc)
        want = (*jax.jit(functools.partial(jax_fa4.paged_attention, return_lse=True))(
            per(q)[i], kc, vc, t, n_i), *appended)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert np.array_equal(np.asarray(g[i]), np.asarray(w)), i
