"""Refusals of the features, before anything is traced: ValueError for malformed input,
NotImplementedError / supports() naming the feature the kernels lack; the spec's
canonical form; and that a call with a feature never lowers to the kernel.

Inputs are jax.ShapeDtypeStruct (shape and dtype only), as in test_validation.py.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _path
from jax_fa4._spec import AttentionSpec


def sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def ints(*shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


F32 = jnp.float32
Q, KV = sds(2, 16, 4, 64), sds(2, 24, 4, 64)
VQ, VKV = sds(40, 4, 64), sds(50, 2, 64)  # varlen: (total, H, D)
CU = ints(4)
VARLEN = dict(cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=16, max_seqlen_k=24)


class Hopper:
    compute_capability = "9.0"


def tensor(dtype, *shape):
    """A tensor type as StableHLO writes it, e.g. tensor<2x16x4x64xbf16>."""
    return f"tensor<{'x'.join(map(str, shape))}x{dtype}>"


def custom_call(lowered, target):
    """The line of the one custom call to `target` in StableHLO text."""
    calls = re.findall(rf"custom_call @{target}\(.*", lowered)
    assert len(calls) == 1, calls
    return calls[0]


def operand_types(call):
    """The operand types of a custom call line, from its signature `: (...) -> ...`."""
    return re.search(r"\} : \(([^)]*)\) -> ", call).group(1).split(", ")


def attention_operands(kind, batch, sq, sk, heads, heads_kv, head_dim=64):
    """The types of the plain call's operands (bfloat16, D = Dv): q, k, v for "fwd";
    q, k, v, out, dout, lse, dlse for "bwd" (_ffi_calls.fwd / bwd)."""
    q = tensor("bf16", batch, sq, heads, head_dim)
    kv = tensor("bf16", batch, sk, heads_kv, head_dim)
    if kind == "fwd":
        return [q, kv, kv]
    lse = tensor("f32", batch, heads, sq)
    return [q, kv, kv, q, q, lse, lse]


def segment_operands(kind, batch, sq, sk, softcap):
    """The types of the segment kernels' extra operands (_ffi_calls._segment_operands):
    rows (B, 3, Sq), keys (B, Sk) and the plan for the tiles of the bfloat16 d64 segment
    kernel of `kind`, (B, query tiles, 1 + key blocks) forward and (B, key blocks,
    1 + 2 * query tiles) backward (_segment_plan.forward_plan / backward_plan)."""
    kernel, = (entry for entry in jax_fa4.kernels()
               if (entry["kind"], entry["dtype"], entry["head_dim"], entry["segments"],
                   entry["softcap"], entry["split"], entry["paged"])
               == (kind, "bf16", 64, True, softcap, False, False))
    tiles, blocks = -(-sq // kernel["tile_m"]), -(-sk // kernel["tile_n"])
    plan = (batch, tiles, 1 + blocks) if kind == "fwd" else (batch, blocks, 1 + 2 * tiles)
    return [tensor("i32", batch, 3, sq), tensor("i32", batch, sk), tensor("i32", *plan)]


@pytest.fixture
def hopper(built, monkeypatch):
    """The kernel path as on a Hopper GPU (native module built or stood in for)."""
    monkeypatch.setattr(_path, "gpu_devices", lambda: (Hopper(),))


# ---------------------------------------------------------------- malformed input

@pytest.mark.parametrize("k,v,kwargs,match", [
    (sds(2, 24, 3, 64), sds(2, 24, 3, 64), {},
     r"Hq must be a multiple of .*Hkv.*\(2, 24, 3, 64\)"),
    (sds(2, 24, 0, 64), sds(2, 24, 0, 64), {}, r"Hq must be a multiple of"),
    (KV, sds(2, 24, 4, 0), {}, r"head_dim Dv of v must be a static positive integer"),
    (KV, KV, dict(alignment="bottom-right"),
     r"alignment must be one of \('bottom_right', 'top_left'\)"),
    (KV, KV, dict(alignment=None, causal=True), r"alignment must be one of"),
    (KV, KV, dict(window=3), r"window must be a \(left, right\) pair .*; got 3"),
    (KV, KV, dict(window=(1, 2, 3)), r"window must be a \(left, right\) pair"),
    (KV, KV, dict(window=(-1, None)), r"window left side must be >= 0; got -1"),
    (KV, KV, dict(window=(None, -2)), r"window right side must be >= 0; got -2"),
    (KV, KV, dict(window=(1.5, None)),
     r"window left side must be a static Python int or None; got 1.5"),
    (KV, KV, dict(window=(True, None)), r"window left side must be a static Python int"),
    (KV, KV, dict(window=(None, 1), causal=True),
     r"causal=True means a window right side of 0; got window=\(None, 1\)"),
    (KV, KV, dict(softcap=0.0), r"softcap must be > 0 \(or None for no softcap\); got 0.0"),
    (KV, KV, dict(softcap=-1), r"softcap must be > 0"),
    (KV, KV, dict(softcap=float("nan")), r"softcap must be finite"),
    # in float32 it would have been 0 (no softcap on the kernels) or made scale / cap inf
    (KV, KV, dict(softcap=1e-46), r"softcap must be a normal float32"),
    (KV, KV, dict(softcap=1e-40), r"softcap must be a normal float32"),
    (KV, KV, dict(softcap="50"), r"softcap must be a static Python number; got str"),
    (KV, KV, dict(sinks=sds(2, dtype=F32)),
     r"sinks must be a floating-point array of shape \(Hq,\) = \(4,\); "
     r"got float32 array of shape \(2,\)"),
    (KV, KV, dict(sinks=ints(4)), r"sinks must be a floating-point array .*got int32"),
    (KV, KV, dict(sinks=[0.0] * 4), r"sinks must be a floating-point array .*got list"),
    (KV, KV, dict(q_segment_ids=ints(2, 16)),
     r"q_segment_ids and kv_segment_ids must be given together"),
    (KV, KV, dict(kv_segment_ids=ints(2, 24)), r"must be given together"),
    (KV, KV, dict(q_segment_ids=ints(2, 24), kv_segment_ids=ints(2, 24)),
     r"q_segment_ids must be an int32 array of shape \(B, Sq\) = \(2, 16\); "
     r"got int32 array of shape \(2, 24\)"),
    (KV, KV, dict(q_segment_ids=ints(2, 16), kv_segment_ids=ints(2, 24, dtype=jnp.int16)),
     r"kv_segment_ids must be an int32 array of shape \(B, Sk\) = \(2, 24\); got int16"),
    (KV, KV, dict(q_lengths=ints(3)),
     r"q_lengths must be an int32 array of shape \(B,\) = \(2,\)"),
    (KV, KV, dict(kv_lengths=sds(2, dtype=F32)), r"kv_lengths must be an int32 array .*float32"),
    (KV, KV, dict(kv_lengths=[24, 24]), r"kv_lengths must be an int32 array .*got list"),
])
@pytest.mark.parametrize("entry", [jax_fa4.attention, jax_fa4.supports])
def test_malformed_feature_arguments(entry, k, v, kwargs, match):
    with pytest.raises(ValueError, match=match):
        entry(Q, k, v, **kwargs)


CU_SHAPE = r"cu_seqlens_q must be an int32 array of shape \(num_seqs \+ 1,\); "


@pytest.mark.parametrize("q,k,v,kwargs,match", [
    (Q, KV, KV, {}, r"q must have rank 3 \(total, H, D\); got shape \(2, 16, 4, 64\)"),
    (VQ, sds(50, 3, 64), sds(50, 3, 64), {}, r"Hq must be a multiple of"),
    (VQ, VKV, sds(49, 2, 64), {}, r"k and v must have the same sequence length"),
    (VQ, VKV, VKV, dict(cu_seqlens_q=None), CU_SHAPE + "got None"),
    (VQ, VKV, VKV, dict(cu_seqlens_q=ints(0)), CU_SHAPE + r"got int32 array of shape \(0,\)"),
    (VQ, VKV, VKV, dict(cu_seqlens_k=ints(2, 2)), r"cu_seqlens_k must be .*shape \(2, 2\)"),
    (VQ, VKV, VKV, dict(cu_seqlens_k=sds(4, dtype=F32)),
     r"cu_seqlens_k must be an int32 array .*got float32"),
    (VQ, VKV, VKV, dict(cu_seqlens_k=ints(5)),
     r"cu_seqlens_q and cu_seqlens_k must have the same shape .*\(4,\) and \(5,\)"),
    (VQ, VKV, VKV, dict(max_seqlen_q=None), r"max_seqlen_q must be a static Python int; got None"),
    (VQ, VKV, VKV, dict(max_seqlen_k=24.0), r"max_seqlen_k must be a static Python int; got 24.0"),
    (VQ, VKV, VKV, dict(max_seqlen_k=-1), r"max_seqlen_k must be >= 0; got -1"),
    (VQ, VKV, VKV, dict(max_seqlen_q=True), r"max_seqlen_q must be a static Python int"),
    (VQ, VKV, VKV, dict(sinks=sds(2, dtype=F32)),
     r"sinks must be a floating-point array of shape \(Hq,\) = \(4,\)"),
    (VQ, VKV, VKV, dict(window=(None, 2), causal=True),
     r"causal=True means a window right side of 0"),
])
@pytest.mark.parametrize("entry", [jax_fa4.attention_varlen, jax_fa4.supports])
def test_malformed_varlen_arguments(entry, q, k, v, kwargs, match):
    with pytest.raises(ValueError, match=match):
        entry(q, k, v, **{**VARLEN, **kwargs})


def test_traced_static_arguments():
    q = jnp.zeros((1, 4, 2, 8), jnp.float32)
    cases = [
        (lambda q, x: jax_fa4.attention(q, q, q, window=(x, None)), "window left side"),
        (lambda q, x: jax_fa4.attention(q, q, q, softcap=x), "softcap"),
        (lambda q, x: jax_fa4.attention_varlen(
            q[0], q[0], q[0], cu_seqlens_q=jnp.array([0, 4], jnp.int32),
            cu_seqlens_k=jnp.array([0, 4], jnp.int32), max_seqlen_q=x, max_seqlen_k=4),
         "max_seqlen_q"),
    ]
    for fn, name in cases:
        with pytest.raises(ValueError, match=f"{name} must be a static Python .*not a traced"):
            jax.jit(fn)(q, 3)


# ------------------------------------------------- capability gaps: supports and "cute"

# Segment ids and lengths run the segment kernels (kernels/sm90/segments.py).
SEGMENT_CALLS = [
    dict(q_segment_ids=ints(2, 16), kv_segment_ids=ints(2, 24)),
    dict(kv_lengths=ints(2)),
    dict(q_lengths=ints(2), causal=True, alignment="top_left"),
    dict(window=(3, None), q_lengths=ints(2), kv_lengths=ints(2), sinks=sds(4, dtype=F32)),
    dict(window=(3, None), softcap=1.0, kv_lengths=ints(2)),
    dict(softcap=1.0, sinks=sds(4, dtype=F32), q_segment_ids=ints(2, 16),
         kv_segment_ids=ints(2, 24)),
]


@pytest.mark.parametrize("kwargs", SEGMENT_CALLS)
def test_segment_calls_take_the_segment_kernels(hopper, kwargs):
    assert jax_fa4.supports(Q, KV, KV, **kwargs) == (True, "")
    arrays = {n: x for n, x in kwargs.items() if isinstance(x, jax.ShapeDtypeStruct)}
    static = {n: x for n, x in kwargs.items() if n not in arrays}
    for grad in (False, True):
        def f(q, k, v, arrays):
            return jax_fa4.attention(q, k, v, **static, **arrays).astype(F32).sum()

        fn = jax.grad(f, (0, 1, 2)) if grad else f
        lowered = jax.jit(fn).trace(Q, KV, KV, arrays).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "jax_fa4_fwd" in lowered and ("jax_fa4_bwd" in lowered) == grad
        for kind in ("fwd", "bwd") if grad else ("fwd",):
            call = custom_call(lowered, f"jax_fa4_{kind}")
            assert operand_types(call) == (
                attention_operands(kind, 2, 16, 24, 4, 4)
                + segment_operands(kind, 2, 16, 24, softcap="softcap" in kwargs)), call


# (softcap, window_left, window_right) as the kernels receive them (0: no softcap;
# -1: unbounded).
@pytest.mark.parametrize("kwargs,attributes", [
    (dict(causal=True), (0.0, -1, 0)),
    (dict(softcap=2.0, window=(4, 4)), (2.0, 4, 4)),
])
def test_varlen_takes_the_segment_kernels(hopper, kwargs, attributes):
    assert jax_fa4.supports(VQ, VKV, VKV, **VARLEN, **kwargs) == (True, "")
    softcap, left, right = attributes
    for grad in (False, True):
        def f(q, k, v, cu):
            return jax_fa4.attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                            max_seqlen_q=16, max_seqlen_k=24,
                                            **kwargs).astype(F32).sum()

        fn = jax.grad(f, (0, 1, 2)) if grad else f
        lowered = jax.jit(fn).trace(VQ, VKV, VKV, CU).lower(
            lowering_platforms=("cuda",)).as_text()
        assert ("jax_fa4_bwd" in lowered) == grad
        for kind in ("fwd", "bwd") if grad else ("fwd",):
            call = custom_call(lowered, f"jax_fa4_{kind}")
            assert "banded = true" in call and "top_left = false" in call, call
            assert f"softcap = {softcap:e} : f32" in call, call
            assert f"window_left = {left} : i32" in call, call
            assert f"window_right = {right} : i32" in call, call
            # The packed axis is the sequence of one batch row. Hq 4 over Hkv 2 stays
            # unpacked: the d64 segment forward's 64-row tiles hold the 40 rows, so
            # pack-GQA's 2 * 40 rows would not halve the tiles (_pack_gqa.worthwhile).
            assert operand_types(call) == (
                attention_operands(kind, 1, 40, 50, 4, 2)
                + segment_operands(kind, 1, 40, 50, softcap=softcap > 0)), call


def test_short_varlen_runs_pack_gqa(hopper):
    """16 packed query rows, Hq 4 over Hkv 2: pack-GQA's 2 * 16 rows fit the d64 segment
    forward's one 64-row tile (_pack_gqa.worthwhile), so both passes run 2 heads of 32
    rows."""
    q, kv = sds(16, 4, 64), sds(50, 2, 64)
    cu = ints(4)

    def f(q, k, v, cu):
        return jax_fa4.attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                        max_seqlen_q=8, max_seqlen_k=24,
                                        causal=True).astype(F32).sum()

    lowered = jax.jit(jax.grad(f, (0, 1, 2))).trace(q, kv, kv, cu).lower(
        lowering_platforms=("cuda",)).as_text()
    for kind in ("fwd", "bwd"):
        call = custom_call(lowered, f"jax_fa4_{kind}")
        assert operand_types(call) == (
            attention_operands(kind, 1, 32, 50, 2, 2)
            + segment_operands(kind, 1, 32, 50, softcap=False)), call

def test_features_that_mean_the_plain_call_keep_the_kernel(hopper):
    # Canonical spec: a window (None, 0) is causal, alignment without a band is moot,
    # Dv == D and Hq == Hkv are no feature.
    assert jax_fa4.supports(Q, KV, KV, window=(None, 0)) == (True, "")
    assert jax_fa4.supports(Q, KV, KV, window=(None, None), alignment="top_left") == (True, "")
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    lowered = jax.jit(lambda q: jax_fa4.attention(q, q, q, window=(None, 0))).trace(q).lower(
        lowering_platforms=("cuda",)).as_text()
    assert re.search(r"custom_call @jax_fa4_fwd\(.*banded = true", lowered)


@pytest.mark.parametrize("kwargs,band", [
    # (window_left, window_right, top_left) as the kernels receive them (-1: unbounded).
    ({"causal": True}, (-1, 0, False)),
    ({"window": (128, 0)}, (128, 0, False)),
    ({"window": (None, 5)}, (-1, 5, False)),
    ({"window": (7, 9)}, (7, 9, False)),
    ({"causal": True, "window": (3, None)}, (3, 0, False)),
    ({"causal": True, "alignment": "top_left"}, (-1, 0, True)),
    ({"window": (2, 2), "alignment": "top_left"}, (2, 2, True)),
    ({"window": (1 << 40, 4)}, (-1, 4, False)),  # beyond any sequence: unbounded
])
def test_bands_take_the_banded_kernels(hopper, kwargs, band):
    # Q has 16 rows and KV 24: top-left is a different band from bottom-right.
    assert jax_fa4.supports(Q, KV, KV, **kwargs) == (True, "")
    grad = jax.grad(lambda q, k, v: jnp.sum(jax_fa4.attention(q, k, v, **kwargs)),
                    argnums=(0, 1, 2))
    lowered = jax.jit(grad).trace(Q, KV, KV).lower(lowering_platforms=("cuda",)).as_text()
    left, right, top_left = band
    for kind in ("fwd", "bwd"):
        call = custom_call(lowered, f"jax_fa4_{kind}")
        # A band alone is the banded kernel's attributes: no segment operands.
        assert operand_types(call) == attention_operands(kind, 2, 16, 24, 4, 4), call
        assert "banded = true" in call, call
        assert f"top_left = {str(top_left).lower()}" in call, call
        assert f"window_left = {left} : i32" in call, call
        assert f"window_right = {right} : i32" in call, call


def test_sinks_take_the_kernels(hopper):
    # Sinks are applied to the kernels' out and lse: the forward and backward kernels
    # run, and on the CPU the same jitted function (reference standing in for the
    # kernels, then the sinks) equals the reference with sinks, values and gradients.
    keys = jax.random.split(jax.random.key(3), 5)
    q, k, v = (jax.random.normal(key, (2, 40, 4, 64), jnp.float32).astype(jnp.bfloat16)
               for key in keys[:3])
    sinks = jax.random.normal(keys[3], (4,), jnp.float32)
    weights = jax.random.normal(keys[4], (2, 40, 4, 64), jnp.float32)

    def loss(implementation, q, k, v, sinks):
        out, lse = jax_fa4.attention(q, k, v, causal=True, sinks=sinks, return_lse=True,
                                     implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) * weights) + jnp.sum(jnp.tanh(lse))

    grad = jax.jit(jax.value_and_grad(functools.partial(loss, None), argnums=(0, 1, 2, 3)))
    lowered = grad.trace(q, k, v, sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_fa4_fwd" in lowered and "jax_fa4_bwd" in lowered
    got = grad(q, k, v, sinks)
    want = jax.value_and_grad(functools.partial(loss, "reference"), argnums=(0, 1, 2, 3))(
        q, k, v, sinks)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-3)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-2, atol=2e-2, err_msg=name)


# ------------------------------------------------------------------- canonical spec

def _spec(**kwargs):
    return AttentionSpec.from_inputs(Q, KV, KV, softmax_scale=None, return_lse=False,
                                     **{"causal": False, **kwargs})


def test_spec_canonical_band():
    causal_left = _spec(causal=True, window=(3, None))
    assert causal_left == _spec(causal=True, window=(3, 0)) == _spec(window=(3, 0))
    assert (causal_left.causal, causal_left.window) == (True, (3, None))
    assert _spec(window=(None, 0)) == _spec(causal=True) == _spec(causal=True, window=[None, None])
    assert _spec(alignment="top_left") == _spec()
    assert _spec(causal=True, alignment="top_left").alignment == "top_left"
    assert _spec(window=(np.int64(2), 1)).window == (2, 1)
    hash(_spec(window=(1, 2), softcap=3, sinks=sds(4, dtype=F32)))


def test_spec_records_features():
    spec = AttentionSpec.from_inputs(
        sds(2, 16, 8, 192), sds(2, 24, 2, 192), sds(2, 24, 2, 128), causal=False,
        softmax_scale=None, return_lse=True, softcap=30, sinks=sds(8, dtype=jnp.float32),
        q_segment_ids=ints(2, 16), kv_segment_ids=ints(2, 24), kv_lengths=ints(2))
    assert (spec.head_dim, spec.head_dim_v, spec.group_size) == (192, 128, 4)
    assert spec.softmax_scale == pytest.approx(192 ** -0.5)  # 1 / sqrt(D), not Dv
    assert (spec.softcap, spec.has_sinks, spec.has_segment_ids) == (30.0, True, True)
    assert (spec.has_q_lengths, spec.has_kv_lengths, spec.varlen) == (False, True, False)
    varlen = AttentionSpec.from_varlen_inputs(VQ, VKV, VKV, causal=True, softmax_scale=0.1,
                                              return_lse=False, **VARLEN)
    assert varlen.varlen
    # max_seqlen_q / max_seqlen_k are not read: calls differing only in them share a spec.
    assert varlen == AttentionSpec.from_varlen_inputs(
        VQ, VKV, VKV, causal=True, softmax_scale=0.1, return_lse=False,
        **{**VARLEN, "max_seqlen_q": 1, "max_seqlen_k": 1})
    assert varlen.group_size == 2
