"""The kernels on several GPUs: a jit over sharded arrays and ring attention give the
single-GPU results.

Sharding over batch and heads runs the same kernel on each shard, so with the
deterministic backward the results equal the single-GPU ones bit for bit, and the
compiled program moves no attention data between GPUs. A sharded sequence runs ring
attention (a different summation), held to the numerics rule against the float32
reference like any kernel result. Skipped with fewer than 2 GPUs.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fa4

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpus():
    devices = jax.devices("gpu")
    if len(devices) < 2:
        pytest.skip("needs 2 or more GPUs")
    return devices


def _inputs(fa, b, s, hq, hkv, d, seed=0):
    return fa.problem(seed, jnp.bfloat16, b, s, s, hq, hkv, d)


def _vjp(causal, deterministic=True, window=None):
    attn = functools.partial(jax_fa4.attention, causal=causal, return_lse=True,
                             implementation="cute", deterministic=deterministic,
                             window=window)

    def run(q, k, v, dout, dlse):
        (out, lse), pullback = jax.vjp(attn, q, k, v)
        return (out, lse, *pullback((dout, dlse)))

    return run


def _bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _crossing(compiled_text):
    return set(re.findall(r"\b(all-gather|all-reduce|all-to-all|reduce-scatter|"
                          r"collective-permute)", compiled_text))


@pytest.mark.parametrize("axes", ["batch", "heads", "batch+heads"])
@pytest.mark.parametrize("causal", [False, True])
def test_batch_and_head_sharding_equals_one_gpu_bitwise(fa, gpus, axes, causal):
    n = len(gpus)
    if axes == "batch+heads":
        if n < 4:
            pytest.skip("a 2-D (batch, heads) mesh needs 4 GPUs")
        mesh_shape, names = (2, n // 2), ("b", "h")
    else:
        mesh_shape, names = (n,), (axes[0],)
    mesh = Mesh(np.array(gpus[:int(np.prod(mesh_shape))]).reshape(mesh_shape), names)
    batch_axis = "b" if "b" in names else None
    head_axis = "h" if "h" in names else None
    # GQA 8 / 4 heads: a head sharding keeps each group on one GPU.
    q, k, v, dout, dlse = _inputs(fa, 4, 1000, 8 * n, 4 * n, 128)
    seq = NamedSharding(mesh, P(batch_axis, None, head_axis, None))
    rows = NamedSharding(mesh, P(batch_axis, head_axis, None))
    shardings = (seq, seq, seq, seq, rows)
    run = _vjp(causal)
    single = jax.device_get(jax.jit(run)(q, k, v, dout, dlse))
    sharded_fn = jax.jit(run, in_shardings=shardings,
                         out_shardings=(seq, rows, seq, seq, seq))
    placed = [jax.device_put(x, s) for x, s in zip((q, k, v, dout, dlse), shardings)]
    assert _crossing(sharded_fn.lower(*placed).compile().as_text()) == set()
    got = jax.device_get(sharded_fn(*placed))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, single):
        assert _bits_equal(a, b), f"{name} differs from the single-GPU result"


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (300, 100)),
                                           (True, (700, 0))],
                         ids=["full", "causal", "window", "causal-window"])
def test_sequence_sharded_jit_runs_the_ring(fa, gpus, causal, window):
    # Chunks of 512 (zigzag halves of 256 when causal): with a window the band ring
    # skips the chunk pairs outside it and runs those it cuts as top-left windows over
    # their visible rows and keys.
    n = len(gpus)
    mesh = Mesh(np.array(gpus), ("s",))
    q, k, v, dout, dlse = _inputs(fa, 2, 512 * n, 8, 2, 128)
    seq = NamedSharding(mesh, P(None, "s", None, None))
    rows = NamedSharding(mesh, P(None, None, "s"))
    shardings = (seq, seq, seq, seq, rows)
    fn = jax.jit(_vjp(causal, deterministic=False, window=window), in_shardings=shardings,
                 out_shardings=(seq, rows, seq, seq, seq))
    placed = [jax.device_put(x, s) for x, s in zip((q, k, v, dout, dlse), shardings)]
    assert _crossing(fn.lower(*placed).compile().as_text()) == {"collective-permute"}
    out, lse, *grads = jax.device_get(fn(*placed))
    fa.assert_attention("ring", out, lse, q, k, v, causal=causal, window=window)
    # The ring sums per-pair dv rounded to bf16: zigzag halves when the band is one-sided.
    pieces = 2 * n if causal else n
    fa.assert_gradients("ring", grads, q, k, v, dout, dlse, causal=causal, window=window,
                        pieces=pieces)


@pytest.mark.parametrize("static", [{"causal": True}, {"window": (300, 100)}],
                         ids=["causal", "window"])
def test_sequence_sharded_jit_runs_the_segment_ring(fa, gpus, static):
    # Packed documents whose boundaries fall inside and across the devices' chunks, and
    # a padded tail: the segment kernels on each chunk pair, the key ids travelling
    # with K/V. Causal runs in zigzag halves of 256 (Sq == Sk), the window in
    # contiguous chunks of 512.
    n = len(gpus)
    mesh = Mesh(np.array(gpus), ("s",))
    s = 512 * n
    q, k, v, dout, dlse = _inputs(fa, 2, s, 8, 2, 128)
    ids = jnp.broadcast_to((jnp.arange(s, dtype=jnp.int32) * 5 // s)[None], (2, s))
    arrays = {"q_segment_ids": ids, "kv_segment_ids": ids,
              "kv_lengths": jnp.array([s, s - 200], jnp.int32)}
    attn = functools.partial(jax_fa4.attention, return_lse=True, implementation="cute",
                             **static)

    def run(q, k, v, dout, dlse, arrays):
        (out, lse), pullback = jax.vjp(lambda q, k, v: attn(q, k, v, **arrays), q, k, v)
        return (out, lse, *pullback((dout, dlse)))

    seq = NamedSharding(mesh, P(None, "s", None, None))
    rows = NamedSharding(mesh, P(None, None, "s"))
    array_shardings = {"q_segment_ids": NamedSharding(mesh, P(None, "s")),
                       "kv_segment_ids": NamedSharding(mesh, P(None, "s")),
                       "kv_lengths": NamedSharding(mesh, P())}
    shardings = (seq, seq, seq, seq, rows, array_shardings)
    fn = jax.jit(run, in_shardings=shardings, out_shardings=(seq, rows, seq, seq, seq))
    placed = jax.device_put((q, k, v, dout, dlse, arrays), shardings)
    assert _crossing(fn.lower(*placed).compile().as_text()) == {"collective-permute"}
    out, lse, *grads = jax.device_get(fn(*placed))
    mask = {"causal": static.get("causal", False), "window": static.get("window"),
            "segments": arrays}
    fa.assert_attention("segment ring", out, lse, q, k, v, **mask)
    fa.assert_gradients("segment ring", grads, q, k, v, dout, dlse, **mask,
                        pieces=2 * n if "causal" in static else n)


@pytest.mark.parametrize("causal", [False, True])
def test_shard_map_zigzag_ring(fa, gpus, causal):
    n = len(gpus)
    mesh = Mesh(np.array(gpus), ("s",))
    q, k, v, dout, dlse = _inputs(fa, 2, 512 * n, 8, 8, 64, seed=1)
    spec_seq, spec_rows = P(None, "s", None, None), P(None, None, "s")

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec_seq,) * 3,
                       out_specs=(spec_seq, spec_rows))
    def ring(q, k, v):
        return jax_fa4.ring_attention(q, k, v, axis_name="s", causal=causal,
                                      layout="zigzag", return_lse=True,
                                      implementation="cute")

    def whole(q, k, v):
        out, lse = ring(*(jax_fa4.zigzag(x, n) for x in (q, k, v)))
        return jax_fa4.unzigzag(out, n), jax_fa4.unzigzag(lse, n, axis=2)

    def run(q, k, v, dout, dlse):
        (out, lse), pullback = jax.vjp(whole, q, k, v)
        return (out, lse, *pullback((dout, dlse)))

    out, lse, *grads = jax.device_get(jax.jit(run)(q, k, v, dout, dlse))
    fa.assert_attention("zigzag ring", out, lse, q, k, v, causal=causal)
    fa.assert_gradients("zigzag ring", grads, q, k, v, dout, dlse, causal=causal,
                        pieces=2 * n)
