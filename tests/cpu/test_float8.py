"""float8_e4m3fn q, k, v with descales (jax_fa4.attention): the dequantized problem's
attention, out in out_dtype, forward only, and the refusals around it. On this machine
the reference runs (directly, or as the CPU branch of the per-platform path); the e4m3
kernel's call is checked by lowering it for CUDA and its V layout against the wgmma
fragments. tests/gpu/test_gpu_float8.py runs the kernels."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _float8

E4M3 = jnp.float8_e4m3fn
B, SQ, SK, HQ, HKV, D = 2, 24, 40, 4, 2, 32


def quantized(seed, shape, heads_kv_scales):
    """(x in e4m3, descale): x * descale is the float32 tensor it stands for."""
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    descale = jnp.asarray(heads_kv_scales, jnp.float32)
    head_scale = descale if descale.ndim == 0 else jnp.repeat(descale, shape[2] // HKV)
    return (x / head_scale[..., None]).astype(E4M3), descale


def dense(x, descale):
    """The float32 tensor e4m3 x and its descale stand for, written independently of
    jax_fa4 (per K/V head descales expand over each group's query heads)."""
    scale = np.asarray(descale, np.float32)
    if scale.ndim:
        scale = np.repeat(scale, x.shape[2] // HKV)[:, None]
    return np.asarray(x.astype(jnp.float32)) * scale


@pytest.mark.parametrize("scales", [2.5, [0.5, 4.0]], ids=["per_tensor", "per_kv_head"])
@pytest.mark.parametrize("causal", [False, True])
def test_float8_is_the_dequantized_attention(scales, causal):
    q, qd = quantized(0, (B, SQ, HQ, D), scales)
    k, kd = quantized(1, (B, SK, HKV, D), scales)
    v, vd = quantized(2, (B, SK, HKV, D), scales)
    out = jax.jit(lambda *a: jax_fa4.attention(*a[:3], q_descale=a[3], k_descale=a[4],
                                               v_descale=a[5], causal=causal)
                  )(q, k, v, qd, kd, vd)
    assert out.dtype == jnp.bfloat16 and out.shape == (B, SQ, HQ, D)
    want = _attention(dense(q, qd), dense(k, kd), dense(v, vd), causal)
    # out is bf16: within its rounding of the float64 result.
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=8e-3, atol=8e-3)


def _attention(q, k, v, causal):
    """Softmax attention in numpy float64, causal bottom-right aligned (query i sees the
    keys j <= i + Sk - Sq)."""
    k = np.repeat(k, HQ // HKV, axis=2).astype(np.float64)
    v = np.repeat(v, HQ // HKV, axis=2).astype(np.float64)
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k) / np.sqrt(D)
    if causal:
        visible = np.arange(SK)[None, :] <= np.arange(SQ)[:, None] + SK - SQ
        s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("out_dtype", [jnp.float16, jnp.float32, "bfloat16"])
def test_float8_out_dtype(out_dtype):
    # Random inputs (with every value 1, out is 1 whatever the weights): out in the
    # asked dtype, its values the float64 oracle's within out's rounding after bf16.
    q, qd = quantized(3, (B, SQ, HQ, D), 1.0)
    k, kd = quantized(4, (B, SK, HKV, D), 1.0)
    v, vd = quantized(5, (B, SK, HKV, D), 1.0)
    out, lse = jax_fa4.attention(q, k, v, out_dtype=out_dtype, return_lse=True)
    assert out.dtype == jnp.dtype(out_dtype) and lse.dtype == jnp.float32
    want = _attention(dense(q, qd), dense(k, kd), dense(v, vd), False)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=8e-3, atol=8e-3)


def test_float8_is_forward_only():
    q, k = jnp.ones((1, 4, 2, 16), E4M3), jnp.ones((1, 8, 2, 16), E4M3)
    descale = jnp.float32(1.0)
    for argnums in (0, 3):
        with pytest.raises(NotImplementedError, match="forward only"):
            jax.grad(lambda q, k, v, d: jnp.sum(jax_fa4.attention(q, k, v, q_descale=d)),
                     argnums=argnums)(q, k, k, descale)
    with pytest.raises(NotImplementedError, match="forward only"):  # forward mode too
        jax.jacfwd(lambda d: jnp.sum(jax_fa4.attention(q, k, k, q_descale=d)))(descale)
    # lse does not depend on v, and still raises (its gradient had been zeros on the
    # reference path, raising only on the kernel path).
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(lambda v: jax_fa4.attention(q, k, v, return_lse=True)[1].sum())(k)
    # Sinks are no float8 input: their gradient is defined.
    sinks_grad = jax.grad(lambda s: jnp.sum(jax_fa4.attention(q, k, k, sinks=s)))(
        jnp.zeros((2,), jnp.float32))
    assert np.all(np.isfinite(np.asarray(sinks_grad)))


def sds(*shape, dtype=E4M3):
    return jax.ShapeDtypeStruct(shape, dtype)


Q8, KV8 = sds(2, 16, 4, 64), sds(2, 24, 2, 64)


@pytest.mark.parametrize("call,match", [
    (lambda: jax_fa4.attention(sds(2, 16, 4, 64, dtype=jnp.bfloat16),
                               sds(2, 24, 2, 64, dtype=jnp.bfloat16),
                               sds(2, 24, 2, 64, dtype=jnp.bfloat16),
                               q_descale=sds(dtype=jnp.float32)),
     r"q_descale: for float8_e4m3fn q, k, v only; got bfloat16"),
    (lambda: jax_fa4.attention(sds(2, 16, 4, 64, dtype=jnp.float16),
                               sds(2, 24, 2, 64, dtype=jnp.float16),
                               sds(2, 24, 2, 64, dtype=jnp.float16), out_dtype=jnp.float32),
     r"out_dtype: for float8_e4m3fn q, k, v only; got float16"),
    (lambda: jax_fa4.attention(sds(2, 16, 4, 64, dtype=jnp.float8_e5m2),
                               sds(2, 24, 2, 64, dtype=jnp.float8_e5m2),
                               sds(2, 24, 2, 64, dtype=jnp.float8_e5m2)),
     r"float8 q, k, v must be float8_e4m3fn; got float8_e5m2"),
    (lambda: jax_fa4.attention(Q8, KV8, KV8, k_descale=sds(4, dtype=jnp.float32)),
     r"k_descale must be None or a float32 array of shape \(\) or \(Hkv,\) = \(2,\); "
     r"got float32 array of shape \(4,\)"),
    (lambda: jax_fa4.attention(Q8, KV8, KV8, v_descale=sds(dtype=jnp.bfloat16)),
     r"v_descale must be None or a float32 array"),
    (lambda: jax_fa4.attention(Q8, KV8, KV8, v_descale=2.0),
     r"v_descale must be None or a float32 array"),
    (lambda: jax_fa4.attention(Q8, KV8, KV8, out_dtype=jnp.int8),
     r"out_dtype must be one of \('bfloat16', 'float16', 'float32'\); got"),
    (lambda: jax_fa4.attention(Q8, KV8, KV8, out_dtype="float8"),
     r"out_dtype must be one of"),
    (lambda: jax_fa4.attention_varlen(
        sds(16, 4, 64), sds(24, 2, 64), sds(24, 2, 64),
        cu_seqlens_q=sds(3, dtype=jnp.int32), cu_seqlens_k=sds(3, dtype=jnp.int32),
        max_seqlen_q=16, max_seqlen_k=24),
     r"float8_e4m3fn q, k, v: only jax_fa4.attention takes them"),
    (lambda: jax_fa4.paged_attention(
        sds(2, 1, 4, 64), sds(8, 16, 2, 64), sds(8, 16, 2, 64),
        sds(2, 4, dtype=jnp.int32), sds(2, dtype=jnp.int32)),
     r"float8_e4m3fn q, k, v: only jax_fa4.attention takes them"),
])
def test_float8_refusals(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_float8_supports_names_the_kernel_and_what_runs_here(built):
    ok, reason = support = jax_fa4.supports(Q8, KV8, KV8, q_descale=sds(dtype=jnp.float32))
    assert not ok and reason.startswith("no Hopper (sm_90) GPU visible")
    assert support.path == "reference"
    with pytest.raises(NotImplementedError, match="no Hopper"):
        jax_fa4.attention(Q8, KV8, KV8, implementation="cute")
    # Softcap has no e4m3 kernel.
    assert "no compiled kernel for dtype=e4m3" in jax_fa4.supports(
        Q8, KV8, KV8, softcap=30.0)[1]


def test_float8_refuses_a_v_view_past_32_bits_before_tracing(built):
    # The kernel's V^T per batch element, Hkv * Dv * Skp, is addressed in int32; the
    # handler had refused it at run time (an XlaRuntimeError).
    q = sds(1, 16, 32, 128, dtype=jnp.float8_e4m3fn)
    for keys, fits in ((524256, True), (524288, False)):  # 32 * 128 * keys vs 2^31
        k = sds(1, keys, 32, 128, dtype=jnp.float8_e4m3fn)
        assert ("V^T per batch element in 32 bits" in jax_fa4.supports(q, k, k)[1]) != fits
    with pytest.raises(NotImplementedError, match=r"Hkv \* Dv \* Sk"):
        jax.eval_shape(functools.partial(jax_fa4.attention, implementation="cute"), q, k, k)


@pytest.mark.parametrize("causal,window,d", [(False, None, 64), (True, None, 128),
                                             (False, (8, 4), 96)])
def test_float8_kernel_call_lowers_for_cuda(built, causal, window, d):
    q, qd = quantized(0, (B, SQ, HQ, d), [0.5, 4.0])
    k, kd = quantized(1, (B, SK, HKV, d), 2.0)
    fn = jax.jit(lambda q, k, qd, kd: jax_fa4.attention(
        q, k, k, q_descale=qd, k_descale=kd, causal=causal, window=window))
    text = fn.trace(q, k, qd, kd).lower(lowering_platforms=("cuda",)).as_text()
    # The e4m3 target and no other kernel call.
    assert text.count("jax_fa4_fwd_fp8") == text.count("jax_fa4_fwd") > 0
    # The CPU branch of the same function is the dequantized reference (one bf16 ulp
    # apart where XLA fuses its float32 math differently).
    want = jax_fa4.attention(q, k, k, q_descale=qd, k_descale=kd, causal=causal,
                             window=window, implementation="reference")
    np.testing.assert_allclose(np.asarray(fn(q, k, qd, kd), np.float32),
                               np.asarray(want, np.float32), rtol=2 ** -7, atol=1e-6)


def _wgmma_key_order():
    """For each A column k of an m64nNk32 e4m3 slice, the score column whose value a
    thread puts there when it copies its accumulator values into its A registers in
    order (PTX ISA, wgmma register fragments). Accumulator: the thread of quad index t
    holds, per 8-column block j and row half r, columns 8 j + 2 t + {0, 1}, in the
    order (pair, r, j). A: it holds values i = 0..15 at column 4 t + i % 4 + 16 (i // 8)
    of row half (i // 4) % 2."""
    order = {}
    for t in range(4):
        acc = [(8 * j + 2 * t + p, r) for j in range(4) for r in range(2) for p in range(2)]
        slots = [(4 * t + i % 4 + 16 * (i // 8), (i // 4) % 2) for i in range(16)]
        by_row = {r: [col for col, rr in acc if rr == r] for r in range(2)}
        slot_rows = {r: [col for col, rr in slots if rr == r] for r in range(2)}
        for r in range(2):
            order.update(zip(slot_rows[r], by_row[r]))
    return [order[k] for k in range(32)]


def test_transposed_v_puts_keys_where_the_p_registers_meet_them():
    order = _wgmma_key_order()
    assert sorted(order) == list(range(32))
    v = jax.random.normal(jax.random.key(3), (2, 70, 3, 16), jnp.float32)
    vt = np.asarray(_float8.transposed_v(v))
    assert vt.shape == (2, 3, 16, 96)
    padded = np.concatenate([np.asarray(v), np.zeros((2, 26, 3, 16), np.float32)], axis=1)
    keys = np.asarray([32 * n + order[k] for n in range(3) for k in range(32)])
    np.testing.assert_array_equal(vt, padded[:, keys].transpose(0, 2, 3, 1))


def test_float8_negative_or_nonfinite_descales_give_nan_heads():
    q, _ = quantized(0, (B, SQ, HQ, D), 1.0)
    k, _ = quantized(1, (B, SK, HKV, D), 1.0)
    for kd in ([1.0, -2.0], [1.0, np.inf]):
        out, lse = jax_fa4.attention(q, k, k, k_descale=jnp.asarray(kd, jnp.float32),
                                     return_lse=True)
        out, lse = np.asarray(out, np.float32), np.asarray(lse)
        group = HQ // HKV
        assert np.all(np.isfinite(out[:, :, :group])) and np.all(np.isnan(out[:, :, group:]))
        assert np.all(np.isfinite(lse[:, :group])) and np.all(np.isnan(lse[:, group:]))


@pytest.mark.parametrize("descales_batched", [False, True])
def test_float8_kernel_call_under_vmap(built, descales_batched):
    """vmap folds its axis into the kernel's batch when the descales are shared, and
    runs one call per element when they are not (the kernel takes one table); the CPU
    branch agrees with per-slice calls."""
    q, _ = quantized(0, (3, B, SQ, HQ, D), 1.0)
    k, _ = quantized(1, (3, B, SK, HKV, D), 1.0)
    kd = jnp.asarray([[0.5, 2.0], [1.0, 1.0], [3.0, 0.25]], jnp.float32)

    def f(q, k, kd):
        return jax_fa4.attention(q, k, k, k_descale=kd, causal=True)

    in_axes = (0, 0, 0 if descales_batched else None)
    kd_in = kd if descales_batched else kd[0]
    fn = jax.jit(jax.vmap(f, in_axes=in_axes))
    text = fn.trace(q, k, kd_in).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("jax_fa4_fwd_fp8") == 1
    # Folded: one call over 3 * B (q zero-padded to the kernel's head dim); per element:
    # one call of B inside a loop.
    folded = re.search(rf"tensor<{3 * B}x{SQ}x{HQ}x\d+xf8E4M3FN>", text)
    assert bool(folded) != descales_batched
    got = np.asarray(fn(q, k, kd_in), np.float32)
    for i in range(3):
        want = f(q[i], k[i], kd[i] if descales_batched else kd[0])
        np.testing.assert_allclose(got[i], np.asarray(want, np.float32), rtol=2 ** -7,
                                   atol=1e-6)


def test_float8_without_heads_is_empty():
    """Hq = Hkv = 0 (valid input) gives empty out and lse (NaN-masking the heads had
    divided by Hkv)."""
    q, k = jnp.zeros((1, 3, 0, 16), E4M3), jnp.zeros((1, 4, 0, 16), E4M3)
    for q_ in (q, q.astype(jnp.bfloat16)):
        out, lse = jax_fa4.attention(q_, k, k, return_lse=True)
        assert out.shape == (1, 3, 0, 16) and lse.shape == (1, 0, 3)
