"""implementation=None on a GPU the kernels do not serve runs cuDNN through
jax.nn.dot_product_attention (or the reference), with a warning. No other GPU is at
hand, so the H100 is taken for one that is not Hopper: the same decisions follow."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _fallback, _path

pytestmark = pytest.mark.gpu


@pytest.fixture
def not_hopper(monkeypatch):
    monkeypatch.setattr(_path, "is_hopper", lambda device: False)
    monkeypatch.setattr(_fallback, "_warned", set())


CASES = {
    "causal": (dict(causal=True), {}),
    "gqa-top-left-window": (dict(causal=True, window=(64, 0), alignment="top_left"), {}),
    # Out-of-range lengths (300 and 400 clip to 256) with rows that see keys in both
    # batch entries (the former [300, -4] / [0, 255] left nothing visible: all zeros).
    "lengths": (dict(causal=True, alignment="top_left"),
                {"q_lengths": [300, 200], "kv_lengths": [400, 100]}),
}


@pytest.mark.parametrize("kwargs,lengths", CASES.values(), ids=CASES)
def test_cudnn_fallback(fa, not_hopper, kwargs, lengths):
    q, k, v, dout, _ = fa.problem(43, "bfloat16", 2, 256, 256, 8, 2, 128)
    lengths = {n: jnp.array(x, jnp.int32) for n, x in lengths.items()}
    attn = functools.partial(jax_fa4.attention, **kwargs, **lengths)
    assert jax_fa4.supports(q, k, v, **kwargs, **lengths).path == "cudnn"

    def loss(q, k, v):
        return jnp.sum(attn(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))

    with pytest.warns(RuntimeWarning, match="running cuDNN"):
        step = jax.jit(jax.value_and_grad(lambda *x: (loss(*x), attn(*x)), argnums=(0, 1, 2),
                                          has_aux=True))
        hlo = step.lower(q, k, v).compile().as_text()
    assert '__cudnn$' in hlo and "jax_fa4_fwd" not in hlo
    (_, out), grads = step(q, k, v)
    clipped = {n: jnp.clip(x, 0, 256) for n, x in lengths.items()}
    mask = {"causal": kwargs["causal"], "window": kwargs.get("window"),
            "alignment": kwargs.get("alignment", "bottom_right"), "segments": clipped or None}
    (ref, _), _ = fa.references(q, k, v, **mask)
    # cuDNN is held to bf16 rounding of the output, not to the kernels' rule.
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=2e-2)
    want = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax_fa4.attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        implementation="reference", **kwargs, **clipped) * dout.astype(jnp.float32)),
        argnums=(0, 1, 2)))(q, k, v)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=2e-2 * scale,
                                   err_msg=name)


def test_reference_fallback_warns_once(fa, not_hopper):
    q, k, v, _, _ = fa.problem(44, "bfloat16", 1, 64, 64, 2, 2, 64)
    attn = jax.jit(functools.partial(jax_fa4.attention, softcap=5.0))
    with pytest.warns(RuntimeWarning, match=r"no softcap\); running the pure-JAX reference"):
        out = attn(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(functools.partial(jax_fa4.attention, softcap=5.0))(q, k, v)
    np.testing.assert_array_equal(out, jax.jit(functools.partial(
        jax_fa4.attention, softcap=5.0, implementation="reference"))(q, k, v))
