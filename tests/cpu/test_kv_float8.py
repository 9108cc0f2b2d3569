"""float8_e4m3fn K/V with bfloat16 q (jax_fa4/_kv_float8.py), dense and paged: the
dequantized problem's attention, forward only, the refusals, and the float8-KV kernel
calls lowered for CUDA. tests/gpu/test_gpu_kv_float8.py runs the kernels."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _api, _kv_float8, _paged, _path

E4M3 = jnp.float8_e4m3fn
B, SQ, SK, HQ, HKV, D = 2, 3, 200, 8, 2, 64


def inputs(seed=0, sq=SQ, sk=SK, d=D):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, sq, HQ, d), jnp.float32).astype(jnp.bfloat16),
            jax.random.normal(kk, (B, sk, HKV, d), jnp.float32).astype(E4M3),
            jax.random.normal(kv, (B, sk, HKV, d), jnp.float32).astype(E4M3))


def dequantized(x, descale):
    """x * descale in bfloat16, written independently of jax_fa4 (exact for these
    descales: few significant bits)."""
    scale = np.broadcast_to(np.asarray(descale, np.float32), (x.shape[-2],))[:, None]
    return jnp.asarray(np.asarray(x.astype(jnp.float32)) * scale, jnp.bfloat16)


KD = jnp.asarray([0.5, 3.0], jnp.float32)
VD = jnp.float32(1.5)


@pytest.mark.parametrize("causal", [False, True])
def test_kv_float8_is_attention_on_the_dequantized_kv(causal):
    q, k, v = inputs()
    out, lse = jax.jit(lambda q, k, v: jax_fa4.attention(
        q, k, v, k_descale=KD, v_descale=VD, causal=causal, return_lse=True))(q, k, v)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    # Both jitted: eager and jitted programs may fuse the lse's sum differently (one
    # float32 unit apart under jax 0.11.2's CPU backend).
    want, want_lse = jax.jit(lambda q, k, v: jax_fa4.attention(
        q, k, v, causal=causal, return_lse=True))(q, dequantized(k, KD), dequantized(v, VD))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


def test_kv_float8_is_forward_only():
    q, k, v = inputs()
    loss = lambda q, k, v, kd: jax_fa4.attention(q, k, v, k_descale=kd).astype(
        jnp.float32).sum()
    for argnum in (0, 3):
        with pytest.raises(NotImplementedError, match="forward only"):
            jax.grad(loss, argnums=argnum)(q, k, v, KD)
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.jvp(lambda q: loss(q, k, v, KD), (q,), (q,))


def test_kv_float8_paged_gradients_raise_eagerly():
    """jax.grad outside jit through a paged call's descales: its gather path had closed
    over them, and they leaked out of the custom_vjp (UnexpectedTracerError)."""
    q, k, v = inputs()
    table, lengths = jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([7, 30], jnp.int32)
    k_cache, v_cache = (x.reshape(B * SK // 16, 16, HKV, D) for x in (k, v))  # pages of 16

    def loss(kd, vd, q):
        return jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths, k_descale=kd,
                                       v_descale=vd).astype(jnp.float32).sum()

    for argnum in (0, 1, 2):
        with pytest.raises(NotImplementedError, match="no gradient"):
            jax.grad(loss, argnums=argnum)(KD, VD, q)
    # Forward mode too (a custom_vjp had refused it with JAX's generic TypeError).
    with pytest.raises(NotImplementedError, match="no gradient"):
        jax.jvp(functools.partial(loss, KD, VD), (q,), (q,))
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(lambda v: jax_fa4.attention(q, k, v, return_lse=True)[1].sum())(v)


def test_kv_float8_negative_descale_gives_nan_heads():
    q, k, v = inputs()
    out, lse = jax_fa4.attention(q, k, v, k_descale=jnp.asarray([1.0, -1.0], jnp.float32),
                                 return_lse=True)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert np.all(np.isfinite(out[:, :, :4])) and np.all(np.isnan(out[:, :, 4:]))
    assert np.all(np.isnan(lse[:, 4:]))


Q, K8 = inputs()[:2]


@pytest.mark.parametrize("call, match", [
    (lambda: jax_fa4.attention(Q.astype(jnp.float16), K8, K8), "q must be bfloat16"),
    (lambda: jax_fa4.attention(Q, K8, K8.astype(jnp.bfloat16)), "k, v both float8_e4m3fn"),
    (lambda: jax_fa4.attention(Q, K8.astype(jnp.float8_e5m2), K8.astype(jnp.float8_e5m2)),
     "k, v both float8_e4m3fn"),
    (lambda: jax_fa4.attention(Q, K8, K8, q_descale=jnp.float32(1)), "q_descale"),
    (lambda: jax_fa4.attention(Q, K8, K8, out_dtype=jnp.float32), "out_dtype"),
    (lambda: jax_fa4.attention(Q, K8, K8, k_descale=jnp.ones((3,), jnp.float32)),
     "k_descale must be None or a float32 array"),
    (lambda: jax_fa4.attention(Q, K8, K8, v_descale=jnp.ones((), jnp.float16)),
     "v_descale must be None or a float32 array"),
    (lambda: jax_fa4.paged_attention(Q, jnp.zeros((4, 16, HKV, D), jnp.bfloat16),
                                     jnp.zeros((4, 16, HKV, D), jnp.bfloat16),
                                     jnp.zeros((B, 2), jnp.int32), jnp.ones((B,), jnp.int32),
                                     k_descale=jnp.float32(1)), "for float8_e4m3fn caches"),
])
def test_kv_float8_refusals(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _fwd_calls(text):
    return [line for line in text.splitlines() if "custom_call @jax_fa4_fwd(" in line]


@pytest.mark.parametrize("sq, d, window, lengths", [
    (1, 128, None, False), (1, 64, (100, 0), True), (5, 256, None, True),
    (300, 128, None, False), (40, 96, (20, 0), False)])
def test_kv_float8_kernel_call_lowers_for_cuda(built, sq, d, window, lengths):
    q, k, v = inputs(1, sq=sq, sk=1000, d=d)
    kv_lengths = jnp.asarray([500, 1000], jnp.int32) if lengths else None
    fn = jax.jit(lambda q, k, v, kd, n: jax_fa4.attention(
        q, k, v, k_descale=kd, causal=True, window=window, kv_lengths=n))
    text = fn.trace(q, k, v, KD, kv_lengths).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = _fwd_calls(text)
    assert "kv_float8 = true" in call and "split_kernel = true" in call
    # k and v reach the kernel in e4m3 (zero-padded to a built head dim), then the
    # (3, Hkv) table.
    kernel_d = {64: 64, 96: 128, 128: 128, 256: 256}[d]
    assert f"x{HKV}x{kernel_d}xf8E4M3FN>" in call
    assert f"tensor<3x{HKV}xf32>" in call
    # CPU: the reference on the dequantized inputs.
    got = np.asarray(fn(q, k, v, KD, kv_lengths), np.float32)
    want = jax_fa4.attention(q, dequantized(k, KD), v.astype(jnp.bfloat16), causal=True,
                             window=window, kv_lengths=kv_lengths)
    np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=2 ** -7, atol=1e-6)


def test_kv_float8_softcap_dequantizes_into_the_bf16_kernels(built):
    q, k, v = inputs(2, sq=1, sk=1000)
    fn = jax.jit(lambda q, k, v: jax_fa4.attention(q, k, v, k_descale=KD, softcap=30.0))
    (call,) = _fwd_calls(fn.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text())
    assert "kv_float8 = false" in call and "f8E4M3FN" not in call


@pytest.mark.parametrize("descales_batched", [False, True], ids=["shared", "per_element"])
def test_kv_float8_under_vmap(built, descales_batched):
    q, k, v = (jnp.stack([x] * 3) for x in inputs(3, sq=1, sk=500))
    kd = jnp.asarray([[0.5, 2.0], [1.0, 1.0], [3.0, 0.75]], jnp.float32)

    def f(q, k, v, kd):
        return jax_fa4.attention(q, k, v, k_descale=kd, causal=True)

    kd_in = kd if descales_batched else kd[0]
    fn = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0 if descales_batched else None)))
    text = fn.trace(q, k, v, kd_in).lower(lowering_platforms=("cuda",)).as_text()
    assert len(_fwd_calls(text)) == 1 and "kv_float8 = true" in _fwd_calls(text)[0]
    got = np.asarray(fn(q, k, v, kd_in), np.float32)
    for i in range(3):
        want = f(q[i], k[i], v[i], kd[i] if descales_batched else kd[0])
        np.testing.assert_allclose(got[i], np.asarray(want, np.float32), rtol=2 ** -7,
                                   atol=1e-6)


def test_kv_float8_paged_lowers_for_cuda_and_appends(built):
    num_pages, page_size = 40, 16
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.permutation(num_pages)[:2 * 15].reshape(2, 15), jnp.int32)
    lengths = jnp.asarray([70, 240], jnp.int32)
    q = inputs(4, sq=1)[0]
    _, k_cache, v_cache = inputs(5, sk=num_pages * page_size // B)
    k_cache, v_cache = (x.reshape(num_pages, page_size, HKV, D) for x in (k_cache, v_cache))
    _, k_new, v_new = inputs(6, sk=1)

    def call(q, kc, vc, kn, vn):
        return jax_fa4.paged_attention(q, kc, vc, table, lengths, k_new=kn, v_new=vn,
                                       k_descale=KD, v_descale=VD)

    fn = jax.jit(call)
    text = fn.trace(q, k_cache, v_cache, k_new, v_new).lower(
        lowering_platforms=("cuda",)).as_text()
    (kernel,) = _fwd_calls(text)
    assert "kv_float8 = true" in kernel and f"tensor<3x{HKV}xf32>" in kernel
    # The paged kernel itself: the table reaches it and nothing gathers or scatters the
    # pages (the dense float8-KV kernel on gathered pages had passed the checks above).
    assert "tensor<2x15xi32>" in kernel
    assert "gather" not in text and "scatter" not in text
    out, k_after, v_after = fn(q, k_cache, v_cache, k_new, v_new)
    k_want = _paged.append(k_cache, k_new, table, lengths)
    v_want = _paged.append(v_cache, v_new, table, lengths)
    assert np.array_equal(np.asarray(k_after).view(np.uint8), np.asarray(k_want).view(np.uint8))
    assert np.array_equal(np.asarray(v_after).view(np.uint8), np.asarray(v_want).view(np.uint8))
    want = jax_fa4.attention(q, dequantized(_paged.gather(k_want, table), KD),
                             dequantized(_paged.gather(v_want, table), VD), causal=True,
                             kv_lengths=lengths)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("d, slots_per_sm", [(64, 2), (128, 2), (256, 1)])
def test_kv_float8_decode_splits_fill_every_cta_slot(built, d, slots_per_sm):
    """A batch-1 decode step's float8-KV split count fills every CTA slot of the SMs
    (two per SM at d64 / d128; _split_kv.slots), bf16 K/V's one per SM."""
    q = jax.ShapeDtypeStruct((1, 1, 32, d), jnp.bfloat16)
    counts = {}
    for dtype in (jnp.bfloat16, E4M3):
        kv = jax.ShapeDtypeStruct((1, 131072, 8, d), dtype)
        text = jax.jit(lambda q, k, v: jax_fa4.attention(q, k, v)).trace(q, kv, kv).lower(
            lowering_platforms=("cuda",)).as_text()
        (call,) = _fwd_calls(text)
        counts[dtype] = int(call.split("num_splits = ")[1].split(" ")[0])
    # 8 K/V heads (pack-GQA: one 64-row tile each) on 132 SMs.
    assert counts[jnp.bfloat16] == 132 // 8
    assert counts[E4M3] == 132 * slots_per_sm // 8


def test_kv_float8_supports_names_what_runs(built):
    q = jax.ShapeDtypeStruct((1, 1, HQ, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 4096, HKV, 128), E4M3)
    support = jax_fa4.supports(q, kv, kv, k_descale=KD)
    (ok, reason), path = support, support.path
    # No Hopper GPU here: the reason is the device, and the reference runs instead.
    assert not ok and "Hopper" in reason and path == "reference"
    with pytest.raises(ValueError, match="q_descale"):
        jax_fa4.supports(q, kv, kv, q_descale=KD)


@pytest.mark.parametrize("batch,kernel", [(1, True), (2, False)])
def test_kv_float8_outs_past_the_split_view_dequantize(built, batch, kernel):
    # Every float8-KV kernel is a split kernel, whose out view has 32-bit offsets: an out
    # of 2^31 elements or more runs the bf16 kernels on the dequantized K/V instead.
    q = jax.ShapeDtypeStruct((batch, 65536, 128, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, 65536, 8, 128), E4M3)
    spec = _api._plan(q, _kv_float8.as_bfloat16(kv), _kv_float8.as_bfloat16(kv),
                      causal=False, softmax_scale=None, return_lse=False,
                      implementation=None)
    sizes = _path.sizes(q, kv, varlen=False)
    assert (_kv_float8.kernel_spec(spec, sizes) is not None) == kernel
    assert bool(_kv_float8.too_large(spec, sizes)) != kernel
