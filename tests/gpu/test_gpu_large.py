"""Tensors of 2^31 elements (4 GiB of bf16 each): offsets past int32 inside the kernels'
addressing. The whole forward and backward run; the first and last batch rows (where
an int32 overflow of a batch offset would land) meet the rule of tests/README.md. And
more key blocks than a grid's y or z dimension holds.

About 45 GiB of GPU memory at its peak (the 2^31-element test): `--dist loadgroup`
keeps it in a group of its own, and tests/README.md runs it alone."""

import functools

import jax
import jax.numpy as jnp
import pytest

import jax_fa4

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("large")]

B, S, H, D = 256, 2048, 32, 128  # B * S * H * D = 2^31
assert B * S * H * D == 1 << 31


@jax.jit
def _forward_backward(q, k, v, dout):
    attn = functools.partial(jax_fa4.attention, causal=True, return_lse=True,
                             implementation="cute", deterministic=True)
    (out, lse), vjp = jax.vjp(attn, q, k, v)
    return out, lse, vjp((dout, jnp.zeros_like(lse)))


def test_two_to_the_31_elements_per_tensor(fa):
    keys = jax.random.split(jax.random.key(41), 4)
    q, k, v, dout = (jax.random.normal(key, (B, S, H, D), jnp.bfloat16) for key in keys)
    out, lse, grads = _forward_backward(q, k, v, dout)
    for b in (0, B - 1):
        row = lambda x: x[b:b + 1]  # noqa: E731
        fa.assert_attention(f"batch row {b}", row(out), row(lse), row(q), row(k), row(v),
                            causal=True)
        fa.assert_gradients(f"batch row {b}", [row(g) for g in grads], row(q), row(k), row(v),
                            row(dout), jnp.zeros_like(row(lse)), causal=True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_more_key_blocks_than_a_grid_row(fa, deterministic):
    """65537 key blocks of 128 (d64): past the 65535 a grid's y or z holds, which the
    backward had refused; its key blocks run along x. One K/V head of 8.4M keys, a
    query tile of 64 rows whose dq takes every block's add (in turn, deterministic)."""
    sk = 65536 * 128 + 1
    keys = jax.random.split(jax.random.key(43), 4)
    q, dout = (jax.random.normal(key, (1, 64, 1, 64), jnp.bfloat16) for key in keys[:2])
    k, v = (jax.random.normal(key, (1, sk, 1, 64), jnp.bfloat16) for key in keys[2:])

    @jax.jit
    def forward_backward(q, k, v, dout):
        attn = functools.partial(jax_fa4.attention, return_lse=True, implementation="cute",
                                 deterministic=deterministic)
        (out, lse), vjp = jax.vjp(attn, q, k, v)
        return out, lse, vjp((dout, jnp.zeros_like(lse)))

    out, lse, grads = forward_backward(q, k, v, dout)
    fa.assert_attention("8.4M keys", out, lse, q, k, v, causal=False)
    fa.assert_gradients("8.4M keys", grads, q, k, v, dout, jnp.zeros_like(lse), causal=False)
