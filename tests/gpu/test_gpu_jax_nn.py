"""jax_fa4.dot_product_attention on the kernels against jax.nn.dot_product_attention's
cuDNN path on the same arguments: out, residual and gradients, bf16, rank 3 and 4, GQA,
causal, a causal left window, lengths. cuDNN is held to bf16 rounding (its own error),
jax_fa4 to the rule of tests/README.md through the other GPU tests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4

pytestmark = pytest.mark.gpu

CASES = {
    "causal": dict(is_causal=True),
    "none-gqa": dict(),
    "causal-window": dict(is_causal=True, local_window_size=(100, 0)),
    "lengths-causal": dict(is_causal=True, lengths=([512, 300], [512, 129])),
    "rank3-causal": dict(is_causal=True, rank=3),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
def test_equals_cudnn(fa, case):
    case = dict(case)
    rank, lengths = case.pop("rank", 4), case.pop("lengths", None)
    q, k, v, dout, _ = fa.problem(53, "bfloat16", 2, 512, 512, 8, 2, 128)
    if rank == 3:
        q, k, v, dout = (x[0] for x in (q, k, v, dout))
    if lengths:
        case.update(query_seq_lengths=jnp.array(lengths[0], jnp.int32),
                    key_value_seq_lengths=jnp.array(lengths[1], jnp.int32))

    def run(fn):
        def loss(q, k, v):
            out, residual = fn(q, k, v, **case, return_residual=True)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), (out, residual)

        (_, (out, residual)), grads = jax.jit(jax.value_and_grad(
            loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return out, residual, grads

    got = run(jax_fa4.dot_product_attention)
    hlo = jax.jit(lambda q, k, v: jax_fa4.dot_product_attention(q, k, v, **case)).lower(
        q, k, v).compile().as_text()
    assert "jax_fa4_fwd" in hlo
    want = run(functools.partial(jax.nn.dot_product_attention, implementation="cudnn"))
    # Rows past the query length are 0 on both; every other row sees a key here.
    q_len = case.get("query_seq_lengths")
    if q_len is not None:
        padded = np.arange(512)[None, :] >= np.asarray(q_len)[:, None]
        assert not np.asarray(got[0], np.float32)[padded].any()
    for name, a, b in zip(("out", "residual", "dq", "dk", "dv"), jax.tree.leaves(got),
                          jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if name == "residual" and q_len is not None:
            keep = ~padded[..., None]
            a, b = np.where(keep, a, 0), np.where(keep, b, 0)
        scale = max(float(np.max(np.abs(b))), 1.0)
        np.testing.assert_allclose(a, b, atol=2e-2 * scale, err_msg=name)
