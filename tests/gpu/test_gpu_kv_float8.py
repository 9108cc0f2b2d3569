"""float8_e4m3fn K/V with bfloat16 q (jax_fa4/_kv_float8.py) on the float8-KV kernels,
dense and paged, against the 16-bit numerics rule on the dequantized inputs.

The descales have few significant bits (0.5, 0.75, 1.5, 2, 3), so k * k_descale and
v * v_descale are exact in bfloat16: the rule's inputs are the values the call stands
for, and its low-precision baseline is plain bfloat16 attention on them. Each call is
checked to run a float8-KV kernel (the lowered text names the attribute)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _paged, _split_kv

pytestmark = pytest.mark.gpu

E4M3 = jnp.float8_e4m3fn
DESCALES = (0.5, 0.75, 1.5, 2.0, 3.0)


def _descale(kind, heads_kv, seed):
    if kind is None:
        return None
    rng = np.random.default_rng(seed)
    if kind == "tensor":
        return jnp.float32(rng.choice(DESCALES))
    return jnp.asarray(rng.choice(DESCALES, heads_kv), jnp.float32)


def _dequantized(x, descale):
    if descale is None:
        return x.astype(jnp.bfloat16)
    scale = jnp.broadcast_to(descale, (x.shape[-2],))[:, None]
    return (x.astype(jnp.float32) * scale).astype(jnp.bfloat16)


def _inputs(seed, batch, sq, sk, hq, hkv, d):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, sq, hq, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (batch, sk, hkv, d), jnp.float32).astype(E4M3)
    v = jax.random.normal(kv, (batch, sk, hkv, d), jnp.float32).astype(E4M3)
    return q, k, v


def _runs_kernel(fn, *args, page_table=None):
    """fn's lowering calls a float8-KV kernel; with `page_table`, the paged one: the
    table reaches the call and no gather or scatter moves the pages."""
    text = fn.lower(*args).as_text()
    assert "jax_fa4_fwd" in text and "kv_float8 = true" in text, "no float8-KV kernel call"
    if page_table is not None:
        table = "x".join(map(str, page_table.shape))
        assert f"tensor<{table}xi32>" in text, "the page table does not reach the kernel"
        assert "gather" not in text and "scatter" not in text, "the pages were gathered"


CASES = [
    # (batch, sq, sk, hq, hkv, d, causal, window, lengths, descales kind)
    (1, 1, 8192 + 17, 32, 8, 128, True, None, False, "head"),  # decode, batch 1: splits
    (3, 1, 4000, 8, 2, 128, True, None, True, "tensor"),  # ragged lengths
    (2, 1, 3000, 8, 8, 64, False, None, False, None),  # no GQA, d64
    (1, 1, 5000, 4, 1, 256, True, (1000, 0), False, "head"),  # MQA, window, d256
    (2, 4, 1500, 8, 2, 128, True, None, True, "head"),  # speculative tokens
    (1, 300, 700, 8, 2, 128, True, None, False, "tensor"),  # prefill-shaped
    (2, 200, 333, 4, 2, 96, False, (50, 50), False, "head"),  # d96 zero-padded to d128
    (64, 1, 2048, 32, 8, 128, True, None, False, "tensor"),  # batch 64: one split
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_sq{}_sk{}_h{}/{}_d{}_{}_w{}_{}_{}".format(
    *c[:6], "causal" if c[6] else "full", c[7], "lengths" if c[8] else "dense", c[9]))
def test_kv_float8_kernel(fa, case):
    batch, sq, sk, hq, hkv, d, causal, window, lengths, kind = case
    q, k, v = _inputs(sq + sk + d, batch, sq, sk, hq, hkv, d)
    kd, vd = _descale(kind, hkv, 1), _descale(kind, hkv, 2)
    kv_lengths = (jnp.asarray(np.random.default_rng(sk).integers(sq, sk + 1, batch), jnp.int32)
                  if lengths else None)

    def call(q, k, v, kv_lengths):
        return jax_fa4.attention(q, k, v, k_descale=kd, v_descale=vd, causal=causal,
                                 window=window, kv_lengths=kv_lengths, return_lse=True)

    fn = jax.jit(call)
    _runs_kernel(fn, q, k, v, kv_lengths)
    out, lse = fn(q, k, v, kv_lengths)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    segments = None if kv_lengths is None else {"kv_lengths": kv_lengths}
    fa.assert_attention("kv float8", out, lse, q, _dequantized(k, kd), _dequantized(v, vd),
                        causal=causal, window=window, segments=segments)


def test_kv_float8_sinks(fa):
    q, k, v = _inputs(5, 2, 1, 3000, 8, 2, 128)
    sinks = jnp.asarray([0.0, 3.0, -2.0, 8.0, 1.0, 0.5, -1.0, 2.0], jnp.float32)
    kd = jnp.asarray([0.5, 3.0], jnp.float32)
    fn = jax.jit(lambda q, k, v: jax_fa4.attention(q, k, v, k_descale=kd, sinks=sinks,
                                                   causal=True, return_lse=True))
    _runs_kernel(fn, q, k, v)
    out, lse = fn(q, k, v)
    fa.assert_attention("kv float8 sinks", out, lse, q, _dequantized(k, kd),
                        _dequantized(v, None), causal=True, sinks=sinks)


@pytest.mark.parametrize("batch", [1, 64])
def test_kv_float8_keys_as_m_tile(fa, monkeypatch, batch):
    """Decode steps whose rows fit the keys-as-M tile (32 / 8 heads: 4 rows) run it, with
    several splits (batch 1) or one (batch 64): against the rule, and within an output
    rounding of the 64-row split tile, and an LSE within 2e-6 of its own plus the bound
    of a reordered sum (_reordered_sum_bound)."""
    q, k, v = _inputs(8 + batch, batch, 1, 6000 + 13, 32, 8, 128)
    kd, vd = _descale("head", 8, 3), _descale("head", 8, 4)

    def jitted():  # traced afresh: the tile is chosen while tracing
        return jax.jit(lambda q, k, v: jax_fa4.attention(q, k, v, k_descale=kd, v_descale=vd,
                                                         return_lse=True))

    fn = jitted()
    assert "keys_as_m = true" in fn.lower(q, k, v).as_text()
    out, lse = fn(q, k, v)
    fa.assert_attention("kv float8 keys as M", out, lse, q, _dequantized(k, kd),
                        _dequantized(v, vd), causal=False)
    monkeypatch.setattr(_split_kv, "KEYS_AS_M", False)
    fn = jitted()
    assert "keys_as_m = false" in fn.lower(q, k, v).as_text()
    out64, lse64 = fn(q, k, v)
    ulp = float(jnp.finfo(jnp.bfloat16).eps) * float(jnp.max(jnp.abs(out64.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out64, np.float32),
                               atol=2 * ulp, rtol=0)
    gap = np.abs(np.asarray(lse) - np.asarray(lse64))
    bound = _reordered_sum_bound(q, _dequantized(k, kd)) + 2e-6 * np.abs(np.asarray(lse64))
    assert np.all(gap <= bound), f"LSE gap {gap.max():.3g} past its bound"


def _reordered_sum_bound(q, k):
    """(B, Hq, Sq): how far a row's LSE may move when each score q . k sums its D
    products in another order, as the keys-as-M tile's K in registers does (Q's D columns
    permuted to match). Either order's score is off by at most D eps32 scale
    sum_d |q_d k_d|, so the two differ by at most twice that, and the LSE, whose gradient
    in the scores is a distribution, by at most its row's largest difference."""
    d, group = q.shape[-1], q.shape[2] // k.shape[2]
    mags = jnp.einsum("bqhd,bkhd->bhqk", jnp.abs(q.astype(jnp.float32)),
                      jnp.repeat(jnp.abs(k.astype(jnp.float32)), group, axis=2))
    eps = float(jnp.finfo(jnp.float32).eps)
    return np.asarray(2 * d * eps * d ** -0.5 * jnp.max(mags, axis=-1))


def test_kv_float8_split_is_deterministic():
    """A batch-1 decode step over 20k keys runs many splits and their combine: bit for
    bit the same every time."""
    q, k, v = _inputs(6, 1, 1, 20000, 32, 8, 128)
    fn = jax.jit(lambda q, k, v: jax_fa4.attention(q, k, v, return_lse=True))
    hlo = fn.lower(q, k, v).as_text()
    assert "kv_float8 = true" in hlo and "split_kernel = true" in hlo, hlo[-2000:]
    splits = re.search(r"num_splits = (\d+)", hlo)
    assert splits and int(splits[1]) > 1, "expected several splits"
    first = jax.device_get(fn(q, k, v))
    for _ in range(3):
        for x, y in zip(first, jax.device_get(fn(q, k, v))):
            assert np.array_equal(np.asarray(x), np.asarray(y))


def test_kv_float8_negative_descale_gives_nan_for_its_heads():
    q, k, v = _inputs(7, 1, 1, 2000, 4, 2, 128)
    kd = jnp.asarray([1.0, -1.0], jnp.float32)
    out, lse = jax_fa4.attention(q, k, v, k_descale=kd, return_lse=True)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert np.all(np.isfinite(out[:, :, :2])) and np.all(np.isnan(out[:, :, 2:]))
    assert np.all(np.isfinite(lse[:, :2])) and np.all(np.isnan(lse[:, 2:]))


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("d", [64, 128])
def test_kv_float8_paged(fa, page_size, d):
    """Pages in a random order, ragged lengths, the step's own rows appended in place:
    against dense attention on the gathered, dequantized pages, and the caches against
    the scatter."""
    batch, hq, hkv, sq = 3, 8, 2, 1
    rng = np.random.default_rng(page_size + d)
    max_pages = -(-5000 // page_size)
    num_pages = batch * max_pages + 3
    table = jnp.asarray(rng.permutation(num_pages)[:batch * max_pages].reshape(batch, -1),
                        jnp.int32)
    lengths = jnp.asarray(rng.integers(1, max_pages * page_size + 1, batch), jnp.int32)
    _, k_cache, v_cache = _inputs(8, 1, 1, num_pages * page_size, hq, hkv, d)
    q = jax.random.normal(jax.random.key(10), (batch, sq, hq, d), jnp.float32).astype(
        jnp.bfloat16)
    k_cache, v_cache = (x.reshape(num_pages, page_size, hkv, d) for x in (k_cache, v_cache))
    _, k_new, v_new = _inputs(9, batch, sq, sq, hq, hkv, d)
    kd, vd = jnp.asarray([0.75, 2.0], jnp.float32), jnp.float32(1.5)

    def call(q, k_cache, v_cache, k_new, v_new):
        return jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths, k_new=k_new,
                                       v_new=v_new, k_descale=kd, v_descale=vd,
                                       return_lse=True)

    fn = jax.jit(call)
    _runs_kernel(fn, q, k_cache, v_cache, k_new, v_new, page_table=table)
    out, lse, k_after, v_after = fn(q, k_cache, v_cache, k_new, v_new)
    k_want = _paged.append(k_cache, k_new, table, lengths)
    v_want = _paged.append(v_cache, v_new, table, lengths)
    for got, want in ((k_after, k_want), (v_after, v_want)):
        assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    k_dense = _dequantized(_paged.gather(k_want, table), kd)
    v_dense = _dequantized(_paged.gather(v_want, table), vd)
    fa.assert_attention("paged kv float8", out, lse, q, k_dense, v_dense, causal=True,
                        segments={"kv_lengths": lengths})
