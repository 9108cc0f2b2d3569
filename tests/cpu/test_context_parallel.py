"""Ring attention on 4 CPU devices equals attention over the whole sequence, forward and
gradients, for both layouts; only collective-permutes cross devices."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_fa4
from jax_fa4 import ring_attention, unzigzag, zigzag
from jax_fa4._ring import Cut, chunk_pair

N = 4
SEQ = P(None, "seq", None, None)
LSE = P(None, None, "seq")


@pytest.fixture
def mesh():
    devices = jax.devices("cpu")
    if len(devices) < N:
        pytest.skip(f"needs {N} CPU devices (tests/conftest.py sets jax_num_cpu_devices)")
    return Mesh(np.array(devices[:N]), ("seq",))


def inputs(s=48, b=2, h=4, d=16, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, dout = (jax.random.normal(key, (b, s, h, d), jnp.float32).astype(dtype)
                     for key in keys)
    return q, k, v, dout


def sharded_ring(mesh, causal, layout, **kw):
    """Ring attention over the mesh, on inputs already in `layout` order."""
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=(SEQ, LSE))
    def sharded(q, k, v):
        return ring_attention(q, k, v, axis_name="seq", causal=causal, layout=layout,
                              return_lse=True, **kw)

    return sharded


def ring(mesh, causal, layout, **kw):
    """Whole-sequence attention computed by ring attention over the mesh."""
    sharded = sharded_ring(mesh, causal, layout, **kw)

    def full(q, k, v):
        if layout == "contiguous":
            return sharded(q, k, v)
        out, lse = sharded(*(zigzag(x, N) for x in (q, k, v)))
        return unzigzag(out, N), unzigzag(lse, N, axis=2)

    return full


def loss(attn, q, k, v, dout):
    out, lse = attn(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(lse)


def reference(causal):
    return functools.partial(jax_fa4.attention, causal=causal, return_lse=True,
                             implementation="reference")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_equals_full_attention(mesh, causal, layout):
    q, k, v, dout = inputs()
    attn = jax.jit(ring(mesh, causal, layout))
    out, lse = attn(q, k, v)
    want_out, want_lse = reference(causal)(q, k, v)
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)
    # The ring itself (inputs already laid out) moves data only with collective-permutes.
    laid_out = [zigzag(x, N) if layout == "zigzag" else x for x in (q, k, v)]
    text = jax.jit(sharded_ring(mesh, causal, layout)).lower(*laid_out).compile().as_text()
    crossing = set(re.findall(r"\b(all-gather|all-reduce|all-to-all|collective-permute)", text))
    assert crossing <= {"collective-permute"}, crossing


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_gradients_equal_full_attention(mesh, causal, layout):
    q, k, v, dout = inputs()
    got = jax.jit(jax.grad(functools.partial(loss, ring(mesh, causal, layout)),
                           argnums=(0, 1, 2)))(q, k, v, dout)
    want = jax.grad(functools.partial(loss, reference(causal)), argnums=(0, 1, 2))(
        q, k, v, dout)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def segment_ids(s=48, b=2, seed=1):
    """Sorted ids: documents packed into each row."""
    starts = jax.random.randint(jax.random.key(seed), (b, s), 0, 7) == 0
    return jnp.cumsum(starts, axis=1).astype(jnp.int32)


def ring_with(mesh, layout, **kw):
    """Whole-sequence attention by the ring, with segment ids as arguments."""
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(SEQ,) * 3 + (P(None, "seq"),) * 2,
                       out_specs=(SEQ, LSE))
    def sharded(q, k, v, q_seg, kv_seg):
        return ring_attention(q, k, v, axis_name="seq", layout=layout, return_lse=True,
                              q_segment_ids=q_seg, kv_segment_ids=kv_seg, **kw)

    def full(q, k, v, seg):
        if layout == "contiguous":
            return sharded(q, k, v, seg, seg)
        out, lse = sharded(*(zigzag(x, N) for x in (q, k, v, seg, seg)))
        return unzigzag(out, N), unzigzag(lse, N, axis=2)

    return full


# Bands that cut chunk pairs every way: inside one chunk, across several, one-sided.
@pytest.mark.parametrize("causal,window", [
    (True, (5, None)), (True, (13, None)), (False, (3, 9)), (False, (None, 7)),
    (False, (20, 0)), (False, (0, None)),
])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_window_and_segments_equal_full_attention(mesh, layout, causal, window):
    q, k, v, dout = inputs()
    seg = segment_ids()
    kw = {"causal": causal, "window": window}
    ring_fn = ring_with(mesh, layout, **kw)

    def whole(q, k, v, seg):
        return jax_fa4.attention(q, k, v, return_lse=True, implementation="reference",
                                 q_segment_ids=seg, kv_segment_ids=seg, **kw)

    out, lse = jax.jit(ring_fn)(q, k, v, seg)
    want_out, want_lse = whole(q, k, v, seg)
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)

    def grads(attn):
        return jax.grad(lambda q, k, v: loss(lambda *a: attn(*a, seg), q, k, v, dout),
                        argnums=(0, 1, 2))(q, k, v)

    for g, w in zip(jax.jit(lambda: grads(ring_fn))(), grads(whole)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_chunk_pairs_outside_the_band_are_skipped():
    # Global band [-5, 0] (causal, window 5) over 4 chunks of 12: query chunk 2 sees the
    # end of chunk 1 (keys from i + 7 on, in chunk coordinates) and the diagonal of its
    # own chunk; chunks 0 and 3 are skipped.
    def run(lo, hi):
        return jnp.array([-99 if lo is None else lo, 99 if hi is None else hi])

    def nothing():
        return jnp.array([0, 0])

    got = [chunk_pair((5, 0), 12, 4, 2, c, run, nothing).tolist() for c in range(4)]
    assert got == [[0, 0], [7, 99], [-5, 0], [0, 0]]
    # No band: one branch, every pair whole.
    assert chunk_pair((None, None), 12, 4, 2, 3, run, nothing).tolist() == [-99, 99]


def test_cut_moves_a_band_onto_the_diagonal():
    # Keys 0..2 of the pair are seen by no query (j - i >= 3): dropped, and the band
    # starts on the diagonal. Queries 0..1 see no key (j - i <= -2): dropped, and the
    # band ends on it. A band through the diagonal runs whole.
    assert Cut.of(3, None) == Cut(0, 3, (0, None))
    assert Cut.of(3, 7) == Cut(0, 3, (0, 4))
    assert Cut.of(None, -2) == Cut(2, 0, (None, 0))
    assert Cut.of(-6, -2) == Cut(2, 0, (4, 0))
    assert Cut.of(-5, 3) == Cut(0, 0, (5, 3))
    assert Cut.of(None, None) == Cut(0, 0, None)


def test_ring_kernel_path(built, mesh):
    # bf16 and head_dim 64: each chunk takes the kernel path (the reference on CPU).
    q, k, v, _ = inputs(d=64, dtype=jnp.bfloat16)
    out, lse = jax.jit(ring(mesh, True, "zigzag"))(q, k, v)
    want_out, want_lse = reference(True)(q, k, v)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-4, atol=1e-4)


def test_ring_takes_the_deterministic_backward(built, mesh, monkeypatch):
    """deterministic=True reaches every chunk pair's backward kernel call."""
    from jax_fa4 import _ffi_calls

    seen = []
    bwd = _ffi_calls.bwd
    monkeypatch.setattr(_ffi_calls, "bwd", lambda *a, spec, **kw: (
        seen.append(spec.deterministic), bwd(*a, spec=spec, **kw))[1])
    q, k, v, _ = inputs(d=64, dtype=jnp.bfloat16)
    for deterministic in (False, True):
        seen.clear()
        loss = lambda q, k, v: ring(mesh, True, "zigzag", deterministic=deterministic)(
            q, k, v)[0].astype(jnp.float32).sum()
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v)
        assert seen and set(seen) == {deterministic}, seen


def test_zigzag_round_trip_and_validation(mesh):
    x = jnp.arange(2 * N * 3)[None, :]
    np.testing.assert_array_equal(unzigzag(zigzag(x, N), N), x)
    assert zigzag(x, N)[0, :6].tolist() == [0, 1, 2, 21, 22, 23]
    q, k, v, _ = inputs()
    kv = k[:, :40]
    with pytest.raises(ValueError, match="same length"):
        jax.shard_map(functools.partial(ring_attention, axis_name="seq", causal=True),
                      mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)(q, kv, kv)
    with pytest.raises(ValueError, match="same length"):
        jax.shard_map(functools.partial(ring_attention, axis_name="seq", window=(4, 4)),
                      mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)(q, kv, kv)
    # A window unbounded on both sides is no band: cross-attention chunks of any length.
    for window in ((None, None), (2**31, 2**31)):
        out = jax.shard_map(functools.partial(ring_attention, axis_name="seq", window=window),
                            mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)(q, kv, kv)
        np.testing.assert_allclose(out, jax_fa4.attention(q, kv, kv, implementation="reference"),
                                   rtol=2e-5, atol=2e-5)
    seg = segment_ids()
    with pytest.raises(ValueError, match="together"):
        jax.shard_map(lambda q, k, v, s: ring_attention(q, k, v, axis_name="seq",
                                                        q_segment_ids=s),
                      mesh=mesh, in_specs=(SEQ,) * 3 + (P(None, "seq"),),
                      out_specs=SEQ)(q, k, v, seg)
    with pytest.raises(ValueError, match="layout"):
        jax.shard_map(functools.partial(ring_attention, axis_name="seq", layout="spiral"),
                      mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)(q, k, v)
    # The zigzag cut names n and the length (it had been jnp.split's "array split does
    # not result in an equal division").
    with pytest.raises(ValueError, match=r"2n = 8 equal chunks \(n = 4 devices\); its "
                                         "length 6 is not a multiple of 8"):
        zigzag(x[:, :6], N)
    # The local chunks are checked as passed: a pair's own call had named them cut by
    # the window (k (2, 1, 4, 16) for a k of (2, 12, 4, 16)).
    with pytest.raises(ValueError, match=r"got q \(1, 12, 4, 16\), k \(2, 12, 4, 16\)"):
        jax.shard_map(functools.partial(ring_attention, axis_name="seq", window=(1, 0)),
                      mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)(q[:1], k, v)
