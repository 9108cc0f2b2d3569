"""Sharded jit on 8 CPU devices: the kernel path (forward and backward) partitions over
batch and heads with no collectives and over the sequence with ring attention (only
collective-permutes), equals the unsharded result, and refuses head_dim sharding and
sequences sharded unlike q's; gradients inside shard_map. The reference path (features the
kernels lack) partitions over batch and heads and refuses a sharded sequence.

The `built` fixture selects the kernel path; on CPU its per-platform forward and backward
run the reference, which stands in for the kernels inside each shard.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_fa4
from jax_fa4 import _api, _kernel_select, _kv_float8, _path, _spec, _vjp

COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)")


@pytest.fixture
def mesh():
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("needs 8 CPU devices (tests/conftest.py sets jax_num_cpu_devices)")
    return Mesh(np.array(devices[:8]).reshape(2, 4), ("data", "model"))


def inputs(b=8, sq=24, sk=40, h=8, d=64, dtype=jnp.bfloat16, seed=0):
    """bf16 and a compiled head_dim, so that attention takes the kernel path."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, sk, h, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, sk, h, d), jnp.float32).astype(dtype)
    dout = jax.random.normal(keys[3], (b, sq, h, d), jnp.float32).astype(dtype)
    return q, k, v, dout


def loss_and_grads(q, k, v, dout, causal, **options):
    def loss(q, k, v):
        out, lse = jax_fa4.attention(q, k, v, causal=causal, return_lse=True, **options)
        return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def assert_kernel_path(q, k, v, causal):
    """The call must take the kernel path (per-platform: the reference on this CPU)."""
    spec = _api._plan(q, k, v, causal=causal, softmax_scale=None, return_lse=True,
                      implementation=None)
    assert spec.path == "platform", spec


def assert_same(got, want):
    """Equal up to one rounding of the result dtype: per-shard programs may fuse the
    float32 reductions differently, which can move a value across a bf16 rounding."""
    ulp = float(jnp.finfo(want.dtype).eps)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=ulp, atol=ulp)


def compiled_text(fn, *args):
    return fn.lower(*args).compile().as_text()


def scalar_all_reduces(text) -> bool:
    """Whether every all-reduce in compiled HLO `text` reduces f32 scalars (loss terms);
    asserts there is at least one, the loss's."""
    reduced = re.findall(r"= (\S.*?) all-reduce\(", text)
    assert reduced, "no all-reduce of the loss"
    return all(re.fullmatch(r"\(?f32\[\](, f32\[\])*\)?", t) for t in reduced)


def assert_only_the_loss_is_reduced(text):
    """Compiled HLO `text` crosses devices only to sum the scalar loss terms."""
    assert set(COLLECTIVES.findall(text)) <= {"all-reduce"}, COLLECTIVES.findall(text)
    assert scalar_all_reduces(text)


def assert_step_matches(step, causal, args, *, value_rtol, grad_atol, **options):
    """The sharded loss_and_grads `step` equals the unsharded one."""
    value, grads = step(*args)
    ref_value, ref_grads = jax.jit(functools.partial(loss_and_grads, causal=causal,
                                                     **options))(*args)
    np.testing.assert_allclose(value, ref_value, rtol=value_rtol)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-2, atol=grad_atol)


@pytest.mark.parametrize("spec", [P("data", None, "model", None), P(("data", "model")),
                                  P(None, None, ("data", "model"), None)],
                         ids=["batch+heads", "batch", "heads"])
@pytest.mark.parametrize("causal", [False, True])
def test_batch_and_head_sharding_needs_no_collectives(built, mesh, spec, causal):
    q, k, v, dout = inputs()
    assert_kernel_path(q, k, v, causal)
    shard = NamedSharding(mesh, spec)
    fwd = jax.jit(functools.partial(jax_fa4.attention, causal=causal, return_lse=True),
                  in_shardings=(shard,) * 3)
    text = compiled_text(fwd, q, k, v)
    assert not COLLECTIVES.findall(text), COLLECTIVES.findall(text)
    out, lse = fwd(q, k, v)
    ref_out, ref_lse = jax_fa4.attention(q, k, v, causal=causal, return_lse=True,
                                         implementation="reference")
    assert_same(out, ref_out)
    assert_same(lse, ref_lse)
    assert out.sharding.is_equivalent_to(shard, 4)


@pytest.mark.parametrize("causal", [False, True])
def test_sharded_gradients_need_no_collectives_and_match(built, mesh, causal):
    q, k, v, dout = inputs()
    shard = NamedSharding(mesh, P("data", None, "model", None))
    step = jax.jit(functools.partial(loss_and_grads, causal=causal), in_shardings=(shard,) * 4)
    # Forward and backward each partition per shard (custom_partitioning), so XLA never
    # sees the kernels' operands as arrays it could gather.
    assert step.lower(q, k, v, dout).as_text().count("@CustomSPMDPartitioning") == 2
    text = compiled_text(step, q, k, v, dout)
    assert_only_the_loss_is_reduced(text)
    assert_step_matches(step, causal, (q, k, v, dout), value_rtol=1e-5, grad_atol=2e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_sequence_sharding_runs_the_ring(built, mesh, causal):
    # Sequence over "model" (4 devices), batch over "data": each device attends its
    # query chunk to every K/V chunk as they travel around the ring, forward and
    # backward; no device ever holds a whole sequence.
    q, k, v, dout = inputs(sk=24)
    assert_kernel_path(q, k, v, causal)
    shard = NamedSharding(mesh, P("data", "model", None, None))
    step = jax.jit(functools.partial(loss_and_grads, causal=causal), in_shardings=(shard,) * 4)
    fwd = jax.jit(functools.partial(jax_fa4.attention, causal=causal, return_lse=True),
                  in_shardings=(shard,) * 3)
    for fn, args in ((fwd, (q, k, v)), (step, (q, k, v, dout))):
        found = set(COLLECTIVES.findall(compiled_text(fn, *args)))
        assert found <= {"collective-permute", "all-reduce"}, found
    assert scalar_all_reduces(compiled_text(step, q, k, v, dout))
    out, lse = fwd(q, k, v)
    assert out.sharding.is_equivalent_to(shard, 4)
    ref_out, ref_lse = jax_fa4.attention(q, k, v, causal=causal, return_lse=True,
                                         implementation="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # Each chunk pair's out comes back in bf16 before the merge, and the causal ring's
    # zigzag halves make twice the pairs: the loss, a sum of ~50k such outputs, moves by
    # about 1e-4 of itself (0.45 in 3978), where each element stays within the 2e-2 above.
    assert_step_matches(step, causal, (q, k, v, dout), value_rtol=3e-4, grad_atol=3e-2)


def test_head_dim_sharding_is_refused(built, mesh):
    q, k, v, _ = inputs()
    shard = NamedSharding(mesh, P(None, None, None, "model"))
    fwd = jax.jit(jax_fa4.attention, in_shardings=(shard,) * 3)
    with pytest.raises(Exception, match="sharded along its head_dim axis"):
        fwd.lower(q, k, v).compile()


def test_sequence_sharded_unlike_q_is_refused(built, mesh):
    q, k, v, _ = inputs()
    whole, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "data", None, None))
    fwd = jax.jit(jax_fa4.attention, in_shardings=(whole, split, split))
    with pytest.raises(Exception, match="k is sharded along its sequence axis"):
        fwd.lower(q, k, v).compile()


@pytest.mark.parametrize("options", [{"causal": True}, {"window": (4, 4)}],
                         ids=["causal", "window"])
def test_banded_ring_needs_equal_lengths(built, mesh, options):
    # The band ring reads the band in global positions, one for queries and keys.
    q, k, v, _ = inputs()  # Sq 24, Sk 40
    shard = NamedSharding(mesh, P(None, "data", None, None))
    fwd = jax.jit(functools.partial(jax_fa4.attention, **options), in_shardings=(shard,) * 3)
    with pytest.raises(Exception, match="needs queries and keys of one length"):
        fwd.lower(q, k, v).compile()


@pytest.mark.parametrize("options", [{}, {"window": (2, 2)}, {"causal": True},
                                     {"causal": True, "lengths": True}],
                         ids=["none", "window", "causal", "segment-ring"])
def test_rings_refuse_a_sequence_the_devices_do_not_divide(built, mesh, options):
    """A sharding constraint inside jit may split 10 positions 4 ways (chunks of 3, the
    last padded with values XLA leaves unspecified); the band ring would take the padding
    for keys, the segment ring would read its rows, key ids and dout (a wrong result)."""
    q, k, v, _ = inputs(b=2, sq=10, sk=10)
    seq = NamedSharding(mesh, P(None, "model", None, None))
    options = dict(options)
    if options.pop("lengths", False):
        options["kv_lengths"] = jnp.array([10, 7], jnp.int32)

    def f(q, k, v):
        q, k, v = (jax.lax.with_sharding_constraint(x, seq) for x in (q, k, v))
        return jax_fa4.attention(q, k, v, **options)

    with pytest.raises(Exception, match="a sequence of 10 is sharded over 4 devices"):
        jax.jit(f).lower(q, k, v).compile()


# Windows over a sequence of 24 sharded 4 ways, chunks of 6: name -> (options, key/value
# heads, whether the ring runs in zigzag halves of 3). Every window is narrower than
# the sequence: pairs of chunks far apart are skipped, and the pairs a window cuts run
# their visible rows and keys (queries dropped below the diagonal, keys above it).
WINDOW_RINGS = {
    "window": ({"window": (5, 3)}, 8, False),
    "causal-window": ({"causal": True, "window": (7, 0)}, 8, True),
    "one-sided": ({"window": (None, 2)}, 8, True),
    "softcap-sinks": ({"window": (1, 1), "softcap": 3.0, "sinks": True}, 8, False),
    "gqa": ({"causal": True, "window": (4, 0)}, 2, True),
}


@pytest.mark.parametrize("name", WINDOW_RINGS)
def test_windowed_sequence_sharding_runs_the_ring(built, mesh, name):
    from jax_fa4 import _ring

    options, heads_kv, zigzag = WINDOW_RINGS[name]
    options = dict(options)
    causal = options.pop("causal", False)
    if options.pop("sinks", False):
        options["sinks"] = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    q, k, v, dout = inputs(sk=24)
    k, v = k[:, :, :heads_kv], v[:, :, :heads_kv]
    spec = _api._plan(q, k, v, causal=causal, softmax_scale=None, return_lse=True,
                      implementation=None, **options)
    assert spec.path == "platform", spec
    chunk = jax.ShapeDtypeStruct((8, 6, 8, 64), q.dtype)
    assert _ring._Layout.of(spec, "model", 4, chunk, chunk).zigzag == zigzag
    shard = NamedSharding(mesh, P("data", "model", None, None))
    step = jax.jit(functools.partial(loss_and_grads, causal=causal, **options),
                   in_shardings=(shard,) * 4)
    fwd = jax.jit(functools.partial(jax_fa4.attention, causal=causal, return_lse=True,
                                    **options), in_shardings=(shard,) * 3)
    for fn, args in ((fwd, (q, k, v)), (step, (q, k, v, dout))):
        found = set(COLLECTIVES.findall(compiled_text(fn, *args)))
        assert "collective-permute" in found, found
        assert found <= {"collective-permute", "all-reduce"}, found
    assert scalar_all_reduces(compiled_text(step, q, k, v, dout))
    out, lse = fwd(q, k, v)
    assert out.sharding.is_equivalent_to(shard, 4)
    ref_out, ref_lse = jax_fa4.attention(q, k, v, causal=causal, return_lse=True,
                                         implementation="reference", **options)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert_step_matches(step, causal, (q, k, v, dout), value_rtol=3e-4, grad_atol=3e-2,
                        **options)


def test_backward_refuses_head_dim_sharding(built, mesh):
    # The backward on its own (in a grad, the forward would refuse first).
    q, k, v, dout = inputs()
    attention_spec = _api._plan(q, k, v, causal=True, softmax_scale=None, return_lse=True,
                                implementation=None)
    out, lse = jax_fa4.attention(q, k, v, causal=True, return_lse=True)
    shard = NamedSharding(mesh, P(None, None, None, "model"))
    replicated = NamedSharding(mesh, P())
    bwd = jax.jit(_vjp._sharded_backward(attention_spec),
                  in_shardings=(replicated,) * 4 + (shard,) + (replicated,) * 2)
    with pytest.raises(Exception, match="dout is sharded along its head_dim axis"):
        bwd.lower(q, k, v, out, dout, lse, jnp.zeros_like(lse)).compile()


def test_shard_map_runs_per_shard(built, mesh):
    q, k, v, _ = inputs()
    spec = P("data", None, "model", None)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec,) * 3,
                       out_specs=(spec, P("data", "model", None)))
    def per_shard(q, k, v):
        return jax_fa4.attention(q, k, v, causal=True, return_lse=True)

    out, lse = per_shard(q, k, v)
    ref_out, ref_lse = jax_fa4.attention(q, k, v, causal=True, return_lse=True,
                                         implementation="reference")
    assert_same(out, ref_out)
    assert_same(lse, ref_lse)
    assert not COLLECTIVES.findall(compiled_text(per_shard, q, k, v))


def test_vmap_folds_into_batch(built):
    q, k, v, _ = inputs(b=2)
    stack = lambda x: jnp.stack([x, x[::-1]])  # noqa: E731
    out = jax.jit(jax.vmap(functools.partial(jax_fa4.attention, causal=True)))(
        stack(q), stack(k), stack(v))
    for i in range(2):
        ref = jax_fa4.attention(stack(q)[i], stack(k)[i], stack(v)[i], causal=True,
                                implementation="reference")
        assert_same(out[i], ref)


def test_vmap_past_the_grid_runs_in_groups(built, monkeypatch):
    # With grids of at most 5 batch elements (and heads), 4 vmapped elements of batch 2
    # go two a call (the largest group that divides 4 and fits) through a lax.map;
    # forward and gradients as each element alone.
    monkeypatch.setattr(_kernel_select, "GRID_YZ_LIMIT", 5)
    q, k, v, _ = inputs(b=2, h=4)
    assert_kernel_path(q, k, v, causal=True)
    stack = lambda x: jnp.stack([x, x[::-1], 2 * x, -x])  # noqa: E731
    q, k, v = stack(q), stack(k), stack(v)

    def loss(q, k, v):
        return jnp.sum(jax_fa4.attention(q, k, v, causal=True).astype(jnp.float32) ** 2)

    step = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2))))
    assert "while" in step.lower(q, k, v).compile().as_text()
    value, grads = step(q, k, v)
    for i in range(4):
        ref_value, ref_grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i])
        assert_same(value[i], ref_value)
        for g, ref in zip(grads, ref_grads):
            assert_same(g[i], ref)


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("spec", [P(None, "data", None, "model", None),
                                  P("data", None, None, "model", None),
                                  P(None, None, None, ("data", "model"), None)],
                         ids=["batch", "vmapped", "heads"])
def test_vmap_over_a_sharded_call_needs_no_collectives(request, mesh, spec, path):
    # A vmapped axis had been folded into the batch before partitioning: left whole in
    # front of a sharded batch, it made XLA gather the batch (three all-gathers).
    q, k, v, dout = (jnp.stack([x, x[::-1]]) for x in inputs(b=4))
    options = dict(causal=True)
    if path == "kernel":
        request.getfixturevalue("built")
        assert_kernel_path(q[0], k[0], v[0], causal=True)
    else:
        options["implementation"] = "reference"

    def loss(q, k, v, dout):
        out = jax.vmap(functools.partial(jax_fa4.attention, **options))(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    shard = NamedSharding(mesh, spec)
    fwd = jax.jit(jax.vmap(functools.partial(jax_fa4.attention, **options)),
                  in_shardings=(shard,) * 3)
    assert not COLLECTIVES.findall(compiled_text(fwd, q, k, v))
    out = fwd(q, k, v)
    assert out.sharding.is_equivalent_to(shard, 5)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), in_shardings=(shard,) * 4)
    text = compiled_text(step, q, k, v, dout)
    assert_only_the_loss_is_reduced(text)
    _, grads = step(q, k, v, dout)
    _, want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v, dout)
    for i in range(2):
        assert_same(out[i], jax_fa4.attention(q[i], k[i], v[i], causal=True,
                                              implementation="reference"))
    for g, w in zip(grads, want):
        assert_same(g, w)


def test_vmap_over_a_sequence_sharded_call_runs_the_ring(built, mesh):
    q, k, v, _ = (jnp.stack([x, x[::-1]]) for x in inputs(b=2, sq=32, sk=32))
    shard = NamedSharding(mesh, P("data", None, "model", None, None))
    fwd = jax.jit(jax.vmap(functools.partial(jax_fa4.attention, causal=True)),
                  in_shardings=(shard,) * 3)
    assert set(COLLECTIVES.findall(compiled_text(fwd, q, k, v))) == {"collective-permute"}
    out = fwd(q, k, v)
    for i in range(2):
        assert_same(out[i], jax_fa4.attention(q[i], k[i], v[i], causal=True,
                                              implementation="reference"))


def test_shard_map_gradients(built, mesh):
    # Queries split along the sequence over "data", k and v replicated there: the
    # gradients of k and v are the sums of every device's contribution.
    q, k, v, dout = inputs()
    q_spec, kv_spec = P(None, "data", "model", None), P(None, None, "model", None)

    def grads(implementation):
        def loss(q, k, v, dout):
            out, lse = jax_fa4.attention(q, k, v, return_lse=True, implementation=implementation)
            return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(lse)

        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, q_spec),
                           out_specs=(q_spec, kv_spec, kv_spec))
        def per_shard(q, k, v, dout):
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v, dout)

        return per_shard(q, k, v, dout)

    for got, want in zip(grads(None), grads("reference")):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=2e-2, atol=2e-2)


def gqa_inputs(heads_kv):
    q, _, _, dout = inputs()
    k, v = (jax.random.normal(key, (8, 40, heads_kv, 64), jnp.float32).astype(jnp.bfloat16)
            for key in jax.random.split(jax.random.key(9), 2))
    return q, k, v, dout


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_head_sharding_keeps_groups_on_one_device(built, mesh, causal):
    # 8 query heads on 4 key/value heads, heads sharded 4 ways: each device holds 2
    # query heads and the 1 key/value head they share; forward and backward need no
    # collectives beyond the scalar loss.
    q, k, v, dout = gqa_inputs(heads_kv=4)
    assert_kernel_path(q, k, v, causal)
    shard = NamedSharding(mesh, P("data", None, "model", None))
    step = jax.jit(functools.partial(loss_and_grads, causal=causal), in_shardings=(shard,) * 4)
    text = compiled_text(step, q, k, v, dout)
    assert set(COLLECTIVES.findall(text)) <= {"all-reduce"}, COLLECTIVES.findall(text)
    reduced = re.findall(r"= (\S.*?) all-reduce\(", text)
    assert all(re.fullmatch(r"\(?f32\[\](, f32\[\])*\)?", t) for t in reduced), reduced
    (value, grads) = step(q, k, v, dout)
    ref_value, ref_grads = jax.jit(functools.partial(loss_and_grads, causal=causal))(q, k, v, dout)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r, x in zip(grads, ref_grads, (q, k, v)):
        assert g.shape == x.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-2, atol=2e-2)


def test_gqa_head_sharding_must_divide_the_kv_heads(built, mesh):
    q, k, v, _ = gqa_inputs(heads_kv=2)
    shard = NamedSharding(mesh, P(None, None, "model", None))
    kv_shard = NamedSharding(mesh, P())
    fwd = jax.jit(jax_fa4.attention, in_shardings=(shard, kv_shard, kv_shard))
    with pytest.raises(Exception, match="does not divide the 2 key/value heads"):
        fwd.lower(q, k, v).compile()


def test_gqa_sequence_sharding_runs_the_ring(built, mesh):
    q, k, v, dout = gqa_inputs(heads_kv=2)
    shard = NamedSharding(mesh, P(None, "data", None, None))
    step = jax.jit(functools.partial(loss_and_grads, causal=False), in_shardings=(shard,) * 4)
    assert set(COLLECTIVES.findall(compiled_text(step, q, k, v, dout))) <= {
        "collective-permute", "all-reduce"}
    (value, grads) = step(q, k, v, dout)
    ref_value, ref_grads = jax.jit(functools.partial(loss_and_grads, causal=False))(q, k, v, dout)
    np.testing.assert_allclose(value, ref_value, rtol=1e-4)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-2, atol=3e-2)


REFERENCE_CALLS = {  # name: (dtype, head_dim, options) of a call the kernels do not take
    "float32": (jnp.float32, 64, {}),
    "head_dim_320": (jnp.bfloat16, 320, {}),
    "forced": (jnp.bfloat16, 64, {"implementation": "reference"}),
}


@pytest.mark.parametrize("name", REFERENCE_CALLS)
def test_reference_path_refuses_a_sharded_sequence(mesh, name):
    # The reference is plain jnp: over a sharded sequence XLA would gather K/V on every
    # device, so the call is refused, forward and backward, naming why it runs there.
    dtype, head_dim, options = REFERENCE_CALLS[name]
    q, k, v, dout = inputs(sk=24, d=head_dim, dtype=dtype)
    shard = NamedSharding(mesh, P("data", "model", None, None))
    fwd = jax.jit(functools.partial(jax_fa4.attention, causal=True, **options),
                  in_shardings=(shard,) * 3)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        jax_fa4.attention(q, k, v, **options).astype(jnp.float32))), in_shardings=(shard,) * 3)
    for fn in (fwd, grad):
        with pytest.raises(Exception, match="runs the pure-JAX reference .* not partitioned"):
            fn.lower(q, k, v).compile()


@pytest.mark.parametrize("name", REFERENCE_CALLS)
def test_reference_path_partitions_over_batch_and_heads(mesh, name):
    dtype, head_dim, options = REFERENCE_CALLS[name]
    q, k, v, dout = inputs(d=head_dim, dtype=dtype)
    shard = NamedSharding(mesh, P("data", None, "model", None))

    def loss(q, k, v, dout):
        out = jax_fa4.attention(q, k, v, causal=True, **options)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), in_shardings=(shard,) * 4)
    text = compiled_text(step, q, k, v, dout)
    assert_only_the_loss_is_reduced(text)
    value, grads = step(q, k, v, dout)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v, dout)
    # The loss sums B * Sq * H * D float32 terms of both signs (head_dim 320: 491,520
    # of magnitude 8.9e4 for a sum of 68), per shard and then across shards, and each
    # program may fuse the reference's reductions its own way, which can move an output
    # across a bf16 rounding (assert_same): the two sums are held to float32 eps times
    # the terms' summed magnitude (jax 0.11.2 at head_dim 320 differs by 7e-4, 1.0e-5
    # of the sum, within 0.011), while a shard dropped or counted twice moves the sum
    # by its partial sum (20 to 155 there).
    terms = jax_fa4.attention(q, k, v, causal=True, **options).astype(jnp.float32) * dout
    magnitude = float(jnp.sum(jnp.abs(terms)))
    np.testing.assert_allclose(value, ref_value, rtol=0,
                               atol=float(jnp.finfo(jnp.float32).eps) * magnitude)
    for g, r in zip(grads, ref_grads):
        assert_same(g, r)


def test_varlen_refuses_a_sharded_packed_axis(mesh):
    q, k, v, _ = inputs(b=1, sk=24, dtype=jnp.float32)
    cu = jnp.array([0, 10, 24], jnp.int32)
    shard = NamedSharding(mesh, P("model", None, None))
    fwd = jax.jit(functools.partial(jax_fa4.attention_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                    max_seqlen_q=14, max_seqlen_k=14),
                  in_shardings=(shard,) * 3)
    with pytest.raises(Exception, match="runs the pure-JAX reference"):
        fwd.lower(q[0], k[0], v[0]).compile()


@pytest.mark.parametrize("spec", [P("data", None, None, None), P(None, "data", None, None)],
                         ids=["batch", "sequence"])
def test_mqa_partitions(built, mesh, spec):
    # One key/value head: the rule keeps the query heads a factor of their own (Shardy
    # refuses a compound (h g) factor with h of size 1), forward and backward.
    q, k, v, dout = gqa_inputs(heads_kv=1)
    k, v = k[:, :24], v[:, :24]
    shard = NamedSharding(mesh, spec)
    step = jax.jit(functools.partial(loss_and_grads, causal=True), in_shardings=(shard,) * 4)
    assert_step_matches(step, True, (q, k, v, dout), value_rtol=3e-4, grad_atol=3e-2)


def test_causal_automatic_ring_trades_halves_into_the_zigzag_layout(mesh):
    # The layout step of the automatic causal ring: device r's contiguous chunk becomes
    # halves r and 2n-1-r of the sequence (jax_fa4.zigzag's layout), and back.
    from jax_fa4 import _ring

    n = 4
    x = jnp.arange(2 * 16 * 3, dtype=jnp.float32).reshape(2, 16, 3)
    spec = _api._plan(*inputs(sk=24)[:3], causal=True, softmax_scale=None,
                      return_lse=False, implementation=None)
    seq = P(None, "model", None)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=seq, out_specs=(seq, seq))
    def trade(x):
        layout = _ring._Layout.of(spec, "model", n, x, x)
        parts = layout.parts(x, 1)
        return jnp.concatenate(parts, axis=1), layout.whole(parts, 1)

    zig, back = trade(x)
    np.testing.assert_array_equal(zig, jax_fa4.zigzag(x, n))
    np.testing.assert_array_equal(back, x)


def _segment_ids(b, s):
    """Two packed documents per row."""
    return jnp.broadcast_to((jnp.arange(s) >= s // 3).astype(jnp.int32), (b, s))


def test_segment_kernels_partition_over_batch_and_heads(built, mesh):
    q, k, v, dout = inputs()
    ids = dict(q_segment_ids=_segment_ids(8, 24), kv_segment_ids=_segment_ids(8, 40),
               kv_lengths=jnp.full((8,), 35, jnp.int32))
    spec = _api._plan(q, k, v, causal=True, softmax_scale=None, return_lse=False,
                      implementation=None, **ids)
    assert spec.path == "platform" and spec.segments, spec
    shard = NamedSharding(mesh, P("data", None, "model", None))

    def loss(q, k, v, dout, ids):
        out = jax_fa4.attention(q, k, v, causal=True, **ids)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    id_shard = {name: NamedSharding(mesh, P("data")) for name in ids}
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)),
                   in_shardings=(shard,) * 4 + (id_shard,))
    assert step.lower(q, k, v, dout, ids).as_text().count("@CustomSPMDPartitioning") == 2
    text = compiled_text(step, q, k, v, dout, ids)
    assert_only_the_loss_is_reduced(text)
    value, grads = step(q, k, v, dout, ids)
    ref = jax.value_and_grad(lambda q, k, v: jnp.sum(jax_fa4.attention(
        q, k, v, causal=True, implementation="reference", **ids).astype(jnp.float32)
        * dout.astype(jnp.float32)), argnums=(0, 1, 2))
    ref_value, ref_grads = ref(q, k, v)
    np.testing.assert_allclose(value, ref_value, rtol=1e-4)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-2, atol=3e-2)


# Segment rings over a query sequence of 24 sharded 4 ways (chunks of 6): name ->
# (options, Sk, whether the ring runs in zigzag halves of 3). Causal bands over Sq == Sk
# take the zigzag layout; Sq != Sk and bands bounded on both sides keep contiguous
# chunks. With bottom-right lengths some rows see keys past their own index.
SEGMENT_RINGS = {
    "causal-ids": (dict(causal=True, segments=True), 40, False),
    "window-lengths": (dict(window=(5, 3), alignment="top_left", q_lengths=True,
                            kv_lengths=True), 40, False),
    "softcap-ids-lengths": (dict(softcap=2.0, segments=True, kv_lengths=True), 40, False),
    "square-causal-ids": (dict(causal=True, segments=True), 24, True),
    "square-causal-lengths": (dict(causal=True, q_lengths=True, kv_lengths=True), 24, True),
    "square-causal-window-ids": (dict(causal=True, window=(7, 0), segments=True), 24, True),
    "square-window-ids": (dict(window=(5, 3), segments=True), 24, False),
}


def segment_ring_permutes(zigzag: bool) -> int:
    """collective-permutes in the forward segment ring over 4 devices: 3 hops of K, V
    and key ids. In zigzag halves each hop moves two halves of each, after trading the
    halves of q, rows, k, v and key ids in and before trading out and lse back (two
    permutes each)."""
    return 2 * 5 + 3 * 3 * 2 + 2 * 2 if zigzag else 3 * 3


def out_and_lse_loss(attend):
    """value_and_grad in q, k, v of loss(q, k, v, *arrays, dout): attend(q, k, v,
    *arrays) -> (out, lse), out against dout plus the finite lse (so both carry
    cotangents)."""
    def loss(q, k, v, *rest):
        *arrays, dout = rest
        out, lse = attend(q, k, v, *arrays)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0)
        return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(finite_lse)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def assert_segment_ring(fwd, ref_fwd, step, ref_step, args, chunks, spec, zigzag):
    """The sequence-sharded forward `fwd` and loss-and-grads `step` run the segment
    ring in the expected layout (with only collective-permutes moving data) and equal
    the unsharded `ref_fwd` / `ref_step`. chunks: one device's q and k chunks."""
    from jax_fa4 import _ring

    assert spec.path == "platform" and spec.segments, spec
    assert _ring._Layout.of(spec, "model", 4, *chunks).zigzag == zigzag
    text = compiled_text(fwd, *args[:-1])
    assert set(COLLECTIVES.findall(text)) == {"collective-permute"}, text
    permutes = re.findall(r"collective-permute(?:-start)?\(", text)
    assert len(permutes) == segment_ring_permutes(zigzag)
    text = compiled_text(step, *args)
    assert set(COLLECTIVES.findall(text)) <= {"collective-permute", "all-reduce"}
    assert scalar_all_reduces(text)
    (out, lse), (ref_out, ref_lse) = fwd(*args[:-1]), ref_fwd(*args[:-1])
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # The loss's value, a sum of outputs each rounded to bf16 once per chunk pair before
    # the merge, says less than out and lse element-wise: only its gradients count.
    (_, grads), (_, ref_grads) = step(*args), ref_step(*args)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("name", SEGMENT_RINGS)
def test_segment_kernels_ring_over_a_sharded_sequence(built, mesh, name):
    # Segment ids and lengths over a sequence sharded 4 ways: the segment ring carries
    # the key ids with K/V and cuts each row's global key range to the key chunk (or
    # half) at hand, so any band (a window, top-left, Sq != Sk) and lengths work.
    kwargs, sk, zigzag = SEGMENT_RINGS[name]
    q, k, v, dout = inputs(sq=24, sk=sk)
    kwargs = dict(kwargs)
    arrays = {}
    if kwargs.pop("segments", False):
        arrays.update(q_segment_ids=_segment_ids(8, 24), kv_segment_ids=_segment_ids(8, sk))
    if kwargs.pop("q_lengths", False):
        arrays["q_lengths"] = jnp.arange(8, dtype=jnp.int32) * 3
    if kwargs.pop("kv_lengths", False):
        arrays["kv_lengths"] = sk - jnp.arange(8, dtype=jnp.int32) * (sk // 10)
    spec = _api._plan(q, k, v, softmax_scale=None, return_lse=False, implementation=None,
                      **{"causal": False, **kwargs}, **arrays)
    shard = NamedSharding(mesh, P("data", "model", None, None))
    array_shard = {n: NamedSharding(mesh, P("data", "model") if x.ndim == 2 else P("data"))
                   for n, x in arrays.items()}

    def attend(implementation, q, k, v, arrays):
        return jax_fa4.attention(q, k, v, return_lse=True, implementation=implementation,
                                 **kwargs, **arrays)

    fwd, ref = (functools.partial(attend, i) for i in (None, "reference"))
    shardings = (shard,) * 3 + (array_shard, shard)
    chunks = (jax.ShapeDtypeStruct((8, 6, 8, 64), q.dtype),
              jax.ShapeDtypeStruct((8, sk // 4, 8, 64), k.dtype))
    assert_segment_ring(jax.jit(fwd, in_shardings=shardings[:-1]), ref,
                        jax.jit(out_and_lse_loss(fwd), in_shardings=shardings),
                        out_and_lse_loss(ref), (q, k, v, arrays, dout), chunks, spec,
                        zigzag)


def test_varlen_kernels_partition_over_heads_and_the_packed_axis(built, mesh):
    q, k, v, dout = inputs(b=1, sk=40)
    q, k, v, dout = q[0], k[0], v[0], dout[0]
    cu_q, cu_k = jnp.array([0, 10, 24], jnp.int32), jnp.array([0, 25, 40], jnp.int32)
    call = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=14, max_seqlen_k=25,
                causal=True)
    spec = _path.choose(_spec.AttentionSpec.from_varlen_inputs(
        q, k, v, softmax_scale=None, return_lse=False, **call), None,
        _path.sizes(q, k, varlen=True))
    assert spec.path == "platform" and spec.segments, spec

    def loss(implementation, q, k, v, dout):
        out = jax_fa4.attention_varlen(q, k, v, implementation=implementation, **call)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    shard = NamedSharding(mesh, P(None, "model", None))
    step = jax.jit(jax.value_and_grad(functools.partial(loss, None), argnums=(0, 1, 2)),
                   in_shardings=(shard,) * 4)
    assert step.lower(q, k, v, dout).as_text().count("@CustomSPMDPartitioning") == 2
    text = compiled_text(step, q, k, v, dout)
    assert_only_the_loss_is_reduced(text)
    value, grads = step(q, k, v, dout)
    ref_value, ref_grads = jax.value_and_grad(functools.partial(loss, "reference"),
                                              argnums=(0, 1, 2))(q, k, v, dout)
    np.testing.assert_allclose(value, ref_value, rtol=1e-4)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-2, atol=3e-2)
    # The packed axis sharded: the segment ring, sequences cut across devices.
    packed = NamedSharding(mesh, P("model", None, None))
    step = jax.jit(jax.value_and_grad(functools.partial(loss, None), argnums=(0, 1, 2)),
                   in_shardings=(packed,) * 4)
    found = set(COLLECTIVES.findall(compiled_text(step, q, k, v, dout)))
    assert found <= {"collective-permute", "all-reduce"}, found
    value, grads = step(q, k, v, dout)
    # Each chunk pair's out is rounded to bf16 before the merge: one more rounding.
    np.testing.assert_allclose(value, ref_value, rtol=1e-2)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-2, atol=3e-2)


def test_causal_varlen_ring_runs_in_zigzag_halves(built, mesh):
    # attention_varlen over a packed axis of 24 queries and 24 keys sharded 4 ways:
    # causal, so the segment ring trades halves of 3 into the zigzag layout. The
    # sequences cross the chunks and halves, their key sequences are longer or shorter
    # than their queries (bottom-right: the first sequence's queries see keys past their
    # own index) and the last two rows are outside every sequence.
    q, k, v, dout = (x[0] for x in inputs(b=1, sk=24))
    call = dict(cu_seqlens_q=jnp.array([0, 5, 17, 22], jnp.int32),
                cu_seqlens_k=jnp.array([0, 9, 16, 24], jnp.int32),
                max_seqlen_q=12, max_seqlen_k=9, causal=True, return_lse=True)
    spec = _path.choose(_spec.AttentionSpec.from_varlen_inputs(
        q, k, v, softmax_scale=None, **call), None,
        _path.sizes(q, k, varlen=True))

    def attend(implementation, q, k, v):
        return jax_fa4.attention_varlen(q, k, v, implementation=implementation, **call)

    fwd, ref = (functools.partial(attend, i) for i in (None, "reference"))
    packed = NamedSharding(mesh, P("model", None, None))
    chunk = jax.ShapeDtypeStruct((1, 6, 8, 64), q.dtype)
    assert_segment_ring(jax.jit(fwd, in_shardings=(packed,) * 3), ref,
                        jax.jit(out_and_lse_loss(fwd), in_shardings=(packed,) * 4),
                        out_and_lse_loss(ref), (q, k, v, dout), (chunk, chunk), spec, True)


@pytest.mark.parametrize("spec", [P("data", None, "model", None), P(None, None, "model", None)],
                         ids=["batch+heads", "heads"])
def test_float8_partitions_over_batch_and_heads(built, mesh, spec):
    """The float8 call (jax_fa4/_float8.py) under a sharded jit: each device runs its
    batch and head shard, its per-K/V-head descales sharded with k's heads; no
    collectives, and the unsharded result."""
    q, k, v, _ = inputs(h=8, dtype=jnp.float8_e4m3fn)
    kd = jnp.linspace(0.5, 2.0, 8, dtype=jnp.float32)
    shard = NamedSharding(mesh, spec)
    heads = NamedSharding(mesh, P(spec[2]))

    def f(q, k, v, kd):
        return jax_fa4.attention(q, k, v, k_descale=kd, causal=True, return_lse=True)

    planned = _api._plan(q, k, v, causal=True, softmax_scale=None, return_lse=True,
                         implementation=None, descales={"k_descale": kd})
    assert planned.path == "platform", planned
    fwd = jax.jit(f, in_shardings=(shard,) * 3 + (heads,))
    text = compiled_text(fwd, q, k, v, kd)
    assert not COLLECTIVES.findall(text), COLLECTIVES.findall(text)
    out, lse = fwd(q, k, v, kd)
    ref_out, ref_lse = jax.jit(f)(q, k, v, kd)
    assert_same(out, ref_out)
    assert_same(lse, ref_lse)


def test_float8_refuses_a_sharded_sequence(built, mesh):
    q, k, v, _ = inputs(dtype=jnp.float8_e4m3fn)
    shard = NamedSharding(mesh, P(None, "model", None, None))
    fwd = jax.jit(jax_fa4.attention, in_shardings=(shard,) * 3)
    with pytest.raises(Exception, match="float8 attention has no ring yet"):
        fwd.lower(q, k, v).compile()


@pytest.mark.parametrize("lengths", [False, True], ids=["dense", "kv_lengths"])
@pytest.mark.parametrize("spec", [P("data", None, "model", None), P(None, None, "model", None)],
                         ids=["batch+heads", "heads"])
def test_float8_kv_partitions_over_batch_and_heads(built, mesh, spec, lengths):
    """bf16 q with float8 K/V (jax_fa4/_kv_float8.py) under a sharded jit: the
    float8-KV kernel call per batch and head shard (with lengths, the segment
    signature), per-K/V-head descales with k's heads; no collectives, the unsharded
    result."""
    q, _, _, _ = inputs(h=8, sq=1)
    _, k, v, _ = inputs(h=8, sk=300, dtype=jnp.float8_e4m3fn)
    kd = jnp.linspace(0.5, 2.0, 8, dtype=jnp.float32)
    kv_lengths = jnp.arange(8, dtype=jnp.int32) * 37 if lengths else None
    shard = NamedSharding(mesh, spec)
    heads = NamedSharding(mesh, P(spec[2]))
    rows = NamedSharding(mesh, P(spec[0]))

    def f(q, k, v, kd, kv_lengths):
        return jax_fa4.attention(q, k, v, k_descale=kd, causal=True, kv_lengths=kv_lengths,
                                 return_lse=True)

    planned = _api._plan(q, _kv_float8.as_bfloat16(k), _kv_float8.as_bfloat16(v),
                         causal=True, softmax_scale=None, return_lse=True,
                         implementation=None, kv_lengths=kv_lengths)
    kernel = _kv_float8.kernel_spec(planned, _path.sizes(q, k, varlen=False))
    assert kernel is not None and kernel.path == "platform", kernel
    fwd = jax.jit(f, in_shardings=(shard,) * 3 + (heads, rows if lengths else None))
    text = compiled_text(fwd, q, k, v, kd, kv_lengths)
    assert not COLLECTIVES.findall(text), COLLECTIVES.findall(text)
    out, lse = fwd(q, k, v, kd, kv_lengths)
    ref_out, ref_lse = jax.jit(f)(q, k, v, kd, kv_lengths)
    assert_same(out, ref_out)
    assert_same(lse, ref_lse)


def test_float8_kv_refuses_a_sharded_sequence(built, mesh):
    q, _, _, _ = inputs()
    _, k, v, _ = inputs(dtype=jnp.float8_e4m3fn)
    shard = NamedSharding(mesh, P(None, "model", None, None))
    fwd = jax.jit(jax_fa4.attention, in_shardings=(shard,) * 3)
    with pytest.raises(Exception, match="float8 K/V has no ring yet"):
        fwd.lower(q, k, v).compile()
