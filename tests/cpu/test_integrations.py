"""The Flax (linen, nnx) and Equinox adapters run the real modules and agree with their
default attention; what they cannot compute is refused with the alternative."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
eqx = pytest.importorskip("equinox")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from jax_fa4 import equinox as fa4_eqx  # noqa: E402
from jax_fa4 import flax as fa4_flax  # noqa: E402

B, S, FEATURES, HEADS = 2, 17, 32, 4


def x_input(dtype=jnp.float32, seed=0):
    return jax.random.normal(jax.random.key(seed), (B, S, FEATURES), jnp.float32).astype(dtype)


def close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol)


def nnx_pair(**kw):
    """Flax's default attention and jax_fa4's, with the same weights (same seed)."""
    def make(**extra):
        args = dict(num_heads=HEADS, in_features=FEATURES, qkv_features=64, decode=False,
                    rngs=nnx.Rngs(0))
        return nnx.MultiHeadAttention(**{**args, **kw, **extra})

    return make(), make(attention_fn=fa4_flax.attention)


@pytest.mark.parametrize("is_causal", [False, True])
def test_nnx_matches_default_attention(is_causal):
    default, ours = nnx_pair()
    x = x_input()
    close(ours(x, is_causal=is_causal), default(x, is_causal=is_causal))
    jitted = nnx.jit(lambda m, x: m(x, is_causal=is_causal))
    close(jitted(ours, x), default(x, is_causal=is_causal))


def test_nnx_gradients_match():
    default, ours = nnx_pair()
    x = x_input()

    def loss(model, x):
        return jnp.sum(model(x, is_causal=True) ** 2)

    g_default = nnx.grad(loss)(default, x)
    g_ours = nnx.jit(nnx.grad(loss))(ours, x)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_default)):
        close(a, b, tol=1e-4)


def test_nnx_bf16_kernel_path(built):
    # 4 heads of 64 in bf16 select the kernel path; on CPU its forward runs the reference.
    default, ours = nnx_pair(qkv_features=256, dtype=jnp.bfloat16)
    x = x_input()
    y = nnx.jit(lambda m, x: m(x, is_causal=True))(ours, x)
    close(y, default(x, is_causal=True), tol=3e-2)


def test_linen_matches_default_attention():
    x = x_input()
    default = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=64)
    causal = nn.MultiHeadDotProductAttention(
        num_heads=HEADS, qkv_features=64,
        attention_fn=functools.partial(fa4_flax.attention, causal=True))
    params = default.init(jax.random.key(1), x)
    want = default.apply(params, x, mask=nn.make_causal_mask(x[..., 0]))
    close(jax.jit(causal.apply)(params, x), want)
    # A concrete causal mask (built outside jit) is read and honoured.
    plain = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=64,
                                            attention_fn=fa4_flax.attention)
    close(plain.apply(params, x, mask=nn.make_causal_mask(x[..., 0])), want)
    close(plain.apply(params, x), default.apply(params, x))


def test_flax_refusals_name_the_alternative():
    q = jnp.ones((B, S, HEADS, 16))
    with pytest.raises(NotImplementedError, match="bias"):
        fa4_flax.attention(q, q, q, bias=jnp.zeros((B, HEADS, S, S)))
    with pytest.raises(NotImplementedError, match="dropout_rate=0.0"):
        fa4_flax.attention(q, q, q, dropout_rate=0.1, deterministic=False)
    with pytest.raises(NotImplementedError, match="sow"):
        fa4_flax.attention(q, q, q, module=object())
    padding = jnp.ones((B, 1, S, S), bool).at[:, :, :, -3:].set(False)
    with pytest.raises(NotImplementedError, match="kv_lengths"):
        fa4_flax.attention(q, q, q, mask=padding)
    with pytest.raises(NotImplementedError, match="traced"):
        jax.jit(lambda m: fa4_flax.attention(q, q, q, mask=m))(jnp.ones((S, S), bool))
    # Dropout is fine where it is off.
    fa4_flax.attention(q, q, q, dropout_rate=0.1, deterministic=True)


def eqx_default_and_ours(causal, **kw):
    mha = eqx.nn.MultiheadAttention(HEADS, FEATURES, key=jax.random.key(2), **kw)
    return mha, fa4_eqx.MultiheadAttention.wrap(mha, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_equinox_matches_default_attention(causal):
    mha, ours = eqx_default_and_ours(causal)
    x = x_input()
    mask = jnp.tril(jnp.ones((S, S), bool)) if causal else None
    want = jax.vmap(lambda x: mha(x, x, x, mask=mask))(x)
    close(eqx.filter_jit(jax.vmap(lambda x: ours(x, x, x)))(x), want)
    # Constructed directly with the same key: the same weights.
    direct = fa4_eqx.MultiheadAttention(HEADS, FEATURES, causal=causal, key=jax.random.key(2))
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(ours)):
        np.testing.assert_array_equal(a, b)


def test_equinox_reads_a_per_head_mask():
    # Equinox takes (num_heads, q_len, kv_len) masks too; the adapter had refused them
    # as not broadcasting to (q_len, kv_len).
    mha, ours = eqx_default_and_ours(False)
    x = x_input()[0]
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((S, S), bool)), (HEADS, S, S))
    close(ours(x, x, x, mask=mask), mha(x, x, x, mask=mask))


def test_equinox_gradients_match():
    mha, ours = eqx_default_and_ours(True)
    x = x_input()
    mask = jnp.tril(jnp.ones((S, S), bool))

    def loss(model, x, **kw):
        return jnp.sum(jax.vmap(lambda x: model(x, x, x, **kw))(x) ** 2)

    g_ours = eqx.filter_jit(eqx.filter_grad(loss))(ours, x)
    g_default = eqx.filter_grad(functools.partial(loss, mask=mask))(mha, x)
    for a, b in zip(jax.tree.leaves(eqx.filter(g_ours, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(g_default, eqx.is_array))):
        close(a, b, tol=1e-4)


def test_equinox_bf16_kernel_path_under_vmap(built):
    # 4 heads of 64 over 256 features in bf16: the kernel path, whose vmap is folded
    # into the kernel's batch (on CPU its forward runs the reference).
    mha = eqx.nn.MultiheadAttention(HEADS, 256, key=jax.random.key(3))
    mha = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_array(a) else a, mha)
    ours = fa4_eqx.MultiheadAttention.wrap(mha, causal=True)
    x = jax.random.normal(jax.random.key(4), (B, S, 256), jnp.float32).astype(jnp.bfloat16)
    mask = jnp.tril(jnp.ones((S, S), bool))
    close(jax.jit(jax.vmap(lambda x: ours(x, x, x)))(x),
          jax.vmap(lambda x: mha(x, x, x, mask=mask))(x), tol=3e-2)


def test_equinox_refuses_active_dropout_and_other_masks():
    mha, ours = eqx_default_and_ours(False, dropout_p=0.1)
    x = x_input()[0]
    with pytest.raises(NotImplementedError, match="dropout"):
        ours(x, x, x, key=jax.random.key(0))
    ours(x, x, x, inference=True)
    # Equinox's rule: a call's inference=False overrides the module's inference=True,
    # so dropout is active there (it had run without dropout and without an error).
    quiet = eqx_default_and_ours(False, dropout_p=0.1, inference=True)[1]
    quiet(x, x, x)
    with pytest.raises(NotImplementedError, match="dropout"):
        quiet(x, x, x, inference=False, key=jax.random.key(0))
    with pytest.raises(NotImplementedError, match="causal"):
        ours(x, x, x, mask=jnp.ones((S, S), bool).at[0, 1:].set(False).at[:, -1].set(False),
             inference=True)


def test_flax_promotes_mixed_dtypes_and_checks_batch_dims():
    # Flax's promote_dtype: float32 q with bfloat16 k, v runs in float32 (it had been
    # refused as "q, k, v must have the same dtype").
    q = jax.random.normal(jax.random.key(5), (B, S, HEADS, 16))
    k = jax.random.normal(jax.random.key(6), (B, S, HEADS, 16)).astype(jnp.bfloat16)
    out = fa4_flax.attention(q, k, k)
    assert out.dtype == jnp.float32
    close(out, nn.dot_product_attention(q, k, k), tol=1e-6)
    # Batch dims of key and value had been taken from query's: (2, 3) queries against
    # (3, 2) keys ran, pairing the examples wrongly.
    q = jnp.ones((2, 3, S, HEADS, 16))
    k = jnp.ones((3, 2, S, HEADS, 16))
    with pytest.raises(ValueError, match="same batch dims"):
        fa4_flax.attention(q, k, k)


def test_adapters_check_the_mask_shape_before_reading_it():
    # An all-visible mask was accepted whatever its shape (jax.nn: a broadcasting error).
    q = jnp.ones((B, S, HEADS, 16))
    with pytest.raises(ValueError, match=r"mask shape \(3, 9\) does not broadcast"):
        fa4_flax.attention(q, q, q, mask=jnp.ones((3, 9), bool))
    mha, ours = eqx_default_and_ours(False)
    x = x_input()[0]
    with pytest.raises(ValueError, match=r"mask shape \(1, 1, 17, 17\) does not broadcast"):
        ours(x, x, x, mask=jnp.ones((1, 1, S, S), bool))


def test_equinox_checks_key_and_value_lengths_and_reads_p_only_when_active():
    mha, ours = eqx_default_and_ours(False)
    x = x_input()[0]
    with pytest.raises(ValueError, match="equal length; got 17 and 16"):
        ours(x, x, x[:-1])
    # An array p, traced under filter_jit, with inference=True: no dropout runs, so p is
    # not read (comparing it had raised TracerBoolConversionError).
    traced_p = eqx.tree_at(lambda m: m.dropout.p, ours, jnp.float32(0.1))
    out = eqx.filter_jit(lambda m, x: m(x, x, x, inference=True))(traced_p, x)
    close(out, mha(x, x, x))
    with pytest.raises(NotImplementedError, match="dropout"):
        eqx.filter_jit(lambda m, x: m(x, x, x, key=jax.random.key(0)))(traced_p, x)


def test_linen_custom_einsums_are_refused_not_dropped():
    # linen passes an attention_fn only the arguments its signature names: custom einsums
    # had been filtered out before the call, and attention ran without them.
    class Einsum(nn.Module):
        @nn.compact
        def __call__(self, spec, *operands, precision=None):
            return 2 * jnp.einsum(spec, *operands, precision=precision)

    mha = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=64,
                                          attention_fn=fa4_flax.attention,
                                          qk_attn_weights_einsum_cls=Einsum,
                                          attn_weights_value_einsum_cls=Einsum)
    x = x_input()
    with pytest.raises(NotImplementedError, match="custom einsums"):
        mha.init(jax.random.key(0), x)
