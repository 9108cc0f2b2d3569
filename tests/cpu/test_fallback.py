"""implementation=None on a GPU where the kernels cannot run: cuDNN through jax.nn when
it computes the same call, else the reference, with one warning per reason; a native
module that fails to import on a GPU machine is an error unless allowed.

The GPU side (cuDNN's results) is tests/gpu/test_gpu_fallback.py; here the path choice,
the warning, and the jax.nn mapping run by jax.nn's own XLA implementation.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _api, _fallback, _path, _registry, _segment_plan
from jax_fa4._reference import reference_attention
from jax_fa4._spec import AttentionSpec


class Gpu:
    def __init__(self, compute_capability, device_kind="NVIDIA A100-SXM4-80GB"):
        self.compute_capability = compute_capability
        self.device_kind = device_kind


A100, H100 = Gpu("8.0"), Gpu("9.0", "NVIDIA H100 80GB HBM3")


def sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


Q, KV = sds(2, 16, 4, 64), sds(2, 24, 2, 64)
LENGTHS = sds(2, dtype=jnp.int32)


def plan(q, k, v, **kwargs):
    kwargs = {"causal": False, "softmax_scale": None, "return_lse": False,
              "implementation": None, **kwargs}
    return _api._plan(q, k, v, **kwargs)


@pytest.mark.parametrize("gpu,q,k,kwargs,path,why", [
    # A GPU the kernels do not run on: cuDNN where it computes the call exactly.
    (A100, Q, KV, dict(causal=True, alignment="top_left"), "cudnn", ""),
    (A100, Q, Q, dict(causal=True), "cudnn", ""),  # bottom-right = top-left when Sq == Sk
    (A100, Q, KV, dict(causal=True, window=(5, 0), alignment="top_left",
                       kv_lengths=LENGTHS), "cudnn", ""),
    (A100, Q, KV, dict(q_lengths=LENGTHS), "cudnn", ""),
    (A100, Q, KV, dict(causal=True), "reference", "bottom-right needs Sq == Sk"),
    (A100, Q, Q, dict(causal=True, kv_lengths=LENGTHS), "reference",
     "bottom-right needs Sq == Sk, no lengths"),
    (A100, Q, KV, dict(window=(3, 2)), "reference", "left side only"),
    (A100, Q, KV, dict(softcap=5.0), "reference", "no softcap"),
    (A100, sds(2, 17, 4, 64), sds(2, 17, 2, 64), dict(causal=True), "reference",
     "needs even Sq and Sk; got 17, 17"),
    (A100, Q, KV, dict(return_lse=True), "reference", "no return_lse"),
    (A100, Q, KV, dict(deterministic=True), "reference", "no deterministic=True"),
    (A100, sds(2, 16, 4, 256), sds(2, 24, 2, 256), {}, "reference", "up to 128"),
    # A Hopper GPU and a call without a kernel.
    (H100, sds(2, 16, 4, 64, dtype=jnp.float32), sds(2, 24, 2, 64, dtype=jnp.float32), {},
     "reference", "cuDNN takes bfloat16 or float16, not float32"),
    (H100, sds(2, 16, 4, 320), sds(2, 24, 2, 320), {}, "reference", "up to 256"),
    (H100, sds(70000, 16, 1, 64), sds(70000, 24, 1, 64), {}, "cudnn", ""),
])
def test_a_gpu_the_kernels_cannot_serve_takes_cudnn_or_the_reference(
        built, monkeypatch, gpu, q, k, kwargs, path, why):
    monkeypatch.setattr(_path, "gpu_devices", lambda: (gpu,))
    with pytest.warns(RuntimeWarning) as record:
        assert plan(q, k, k, **kwargs).path == path
    (message,) = [str(w.message) for w in record]
    assert why in message and ("running cuDNN" in message) == (path == "cudnn")
    support = jax_fa4.supports(q, k, k, **kwargs)
    assert not support[0] and support.path == path and why in support[1]


def test_supports_names_the_path_of_a_host_with_other_gpus_beside_a_hopper(
        built, monkeypatch):
    """"cute" would run the kernel on the Hopper, but implementation=None decides for
    every GPU at once and runs cuDNN: supports() says so (its path had said kernel)."""
    monkeypatch.setattr(_path, "gpu_devices", lambda: (H100, A100))
    with pytest.warns(RuntimeWarning, match="they need Hopper"):
        assert plan(Q, KV, KV, causal=True, alignment="top_left").path == "cudnn"
    support = jax_fa4.supports(Q, KV, KV, causal=True, alignment="top_left")
    assert support[0] and support.path == "cudnn" and "they need Hopper" in support[1]


def test_the_cudnn_path_takes_no_kernel_layout(built, monkeypatch):
    """GQA that the kernels cannot serve (a batch past the grid limit) runs cuDNN on the
    caller's layout: pack-GQA is the kernels' (it had marked such a spec packed, and
    without a native module's manifest raised a TypeError)."""
    monkeypatch.setattr(_path, "gpu_devices", lambda: (H100,))
    with pytest.warns(RuntimeWarning, match="running cuDNN"):
        spec = plan(sds(70000, 16, 4, 64), sds(70000, 24, 2, 64), sds(70000, 24, 2, 64))
    assert spec.path == "cudnn" and spec.group_size == 2
    assert not (spec.pack_gqa or spec.split_kernel or spec.long_rows), spec


def test_the_grid_limit_is_a_reason_before_tracing(built, monkeypatch):
    monkeypatch.setattr(_path, "gpu_devices", lambda: (H100,))
    big_batch, big_heads = sds(65536, 4, 1, 64), sds(1, 4, 65536, 64)
    for q, name in ((big_batch, "batch"), (big_heads, "heads Hq")):
        ok, reason = jax_fa4.supports(q, q, q)
        assert not ok and f"the kernels take {name} <= 65535" in reason
        with pytest.raises(NotImplementedError, match=f"{name} <= 65535"):
            jax_fa4.attention(q, q, q, implementation="cute")
    assert jax_fa4.supports(sds(65535, 4, 1, 64), sds(65535, 4, 1, 64),
                            sds(65535, 4, 1, 64)) == (True, "")


def test_segment_kernels_refuse_keys_their_plans_cannot_name(built, monkeypatch):
    """A plan entry keeps its key block in 21 bits: from 2^27 keys (64-key blocks) the
    entries would wrap negative. Such calls are not the kernels' (cuDNN takes the
    lengths), and a band over a group of heads stays unpacked (packed, it would run the
    segment kernel)."""
    monkeypatch.setattr(_path, "gpu_devices", lambda: (H100,))
    limit = _segment_plan.MAX_KEYS
    lengths = sds(1, dtype=jnp.int32)
    q = sds(1, 1, 8, 128)
    for sk, runs in ((limit - 64, True), (limit, False)):
        kv = sds(1, sk, 1, 128)
        ok, reason = jax_fa4.supports(q, kv, kv, kv_lengths=lengths)
        assert ok == runs and (runs or f"fewer than {limit} keys a row" in reason), reason
        if not runs:
            with pytest.raises(NotImplementedError, match="keys a row"):
                jax_fa4.attention(q, kv, kv, kv_lengths=lengths, implementation="cute")
    q = sds(1, 2, 8, 128)  # two rows: one would see every key (no band left)
    for sk, packed in ((limit - 64, True), (limit, False)):
        kv = sds(1, sk, 1, 128)
        spec = plan(q, kv, kv, causal=True)
        assert spec.path == "platform" and spec.pack_gqa == packed, spec


def test_the_backward_refuses_keys_past_int32_while_tracing(built, monkeypatch):
    # Key blocks run along the grid's x (up to 2^31 - 1): more than 65535 of them train
    # (they had been refused); key indices up to an even number of blocks are int32.
    monkeypatch.setattr(_path, "gpu_devices", lambda: (H100,))
    grad = jax.grad(lambda q, k: jax_fa4.attention(q, k, k, implementation="cute")
                    .astype(jnp.float32).sum())
    q = sds(1, 16, 1, 128)
    jax.jit(grad).trace(q, sds(1, 65536 * 128 + 1, 1, 128))
    with pytest.raises(ValueError, match="even number of 128-key blocks < 2.31"):
        jax.jit(grad).trace(q, sds(1, 2**31 - 100, 1, 128))


def test_one_warning_per_reason(built, monkeypatch):
    monkeypatch.setattr(_path, "gpu_devices", lambda: (A100,))
    with pytest.warns(RuntimeWarning):
        plan(Q, KV, KV)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan(Q, KV, KV)  # the same reason: silent
        assert plan(Q, KV, KV, implementation="reference").path == "reference"
    with pytest.warns(RuntimeWarning, match="no softcap"):
        plan(Q, KV, KV, softcap=3.0)


def test_no_gpu_runs_the_reference_silently(built, monkeypatch):
    monkeypatch.setattr(_path, "gpu_devices", lambda: ())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan(sds(2, 16, 4, 64, dtype=jnp.float32),
                    *[sds(2, 24, 2, 64, dtype=jnp.float32)] * 2).path == "reference"
        assert plan(Q, KV, KV).path == "platform"


def test_cudnn_path_is_per_platform(built, monkeypatch):
    # jax.nn's cuDNN path cannot be traced without cuDNN; its XLA implementation stands
    # in, marked by an optimization barrier (which no other path has), to show which
    # branch each platform lowers. (dot_general alone, which the reference has too,
    # had passed with the reference in the CUDA branch.)
    monkeypatch.setattr(_path, "gpu_devices", lambda: (A100,))
    through = functools.partial(_fallback.through_jax_nn, implementation="xla")
    monkeypatch.setattr(_fallback, "through_jax_nn", lambda *a, **kw: jax.lax.
                        optimization_barrier(through(*a, **kw)))
    q = jax.random.normal(jax.random.key(0), (2, 16, 4, 64), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(1), (2, 16, 2, 64), jnp.bfloat16)
    attn = jax.jit(functools.partial(jax_fa4.attention, causal=True))
    with pytest.warns(RuntimeWarning, match="running cuDNN"):
        out = attn(q, k, k)
    expected = jax_fa4.attention(q, k, k, causal=True, implementation="reference")
    np.testing.assert_array_equal(out, expected)
    lowered = {platform: attn.trace(q, k, k).lower(lowering_platforms=(platform,)).as_text()
               for platform in ("cuda", "cpu")}
    assert "jax_fa4_fwd" not in lowered["cuda"]
    assert "optimization_barrier" in lowered["cuda"]
    assert "optimization_barrier" not in lowered["cpu"]


@pytest.mark.parametrize("residual", [False, True])
def test_dot_product_attention_takes_cudnn_where_attention_does(built, monkeypatch, residual):
    # It had asked for the lse in every call, which cuDNN does not give: an A100 ran the
    # reference. With return_residual (the lse), the reference is still the path.
    monkeypatch.setattr(_path, "gpu_devices", lambda: (A100,))
    monkeypatch.setattr(_fallback, "through_jax_nn", functools.partial(
        _fallback.through_jax_nn, implementation="xla"))
    q = jax.random.normal(jax.random.key(0), (2, 16, 4, 64), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(1), (2, 16, 2, 64), jnp.bfloat16)
    expected = jax_fa4.attention(q, k, k, causal=True, implementation="reference")
    with pytest.warns(RuntimeWarning) as caught:
        result = jax_fa4.dot_product_attention(q, k, k, is_causal=True,
                                               return_residual=residual)
    messages = " ".join(str(w.message) for w in caught)
    assert ("running cuDNN" in messages) != residual, messages
    np.testing.assert_array_equal(result[0] if residual else result, expected)


def test_allow_no_native_takes_only_0_or_1(monkeypatch):
    # "true" had been read as unset, silently.
    monkeypatch.setattr(_registry, "_ffi", None)
    monkeypatch.setattr(_registry, "_IMPORT_ERROR", None)
    monkeypatch.setattr(_path, "gpu_devices", lambda: (H100,))
    monkeypatch.setenv(_fallback.ALLOW_NO_NATIVE, "true")
    with pytest.raises(ValueError, match="JAX_FA4_ALLOW_NO_NATIVE takes 1 .* got 'true'"):
        plan(Q, KV, KV)


@pytest.mark.parametrize("failure,allowed", [
    (ImportError("libcuda.so.1: cannot open shared object file"), False),
    (ImportError("libcuda.so.1: cannot open shared object file"), True),
    (None, False),  # not built
])
def test_missing_native_module_on_a_gpu_machine(monkeypatch, failure, allowed):
    monkeypatch.setattr(_registry, "_ffi", None)
    monkeypatch.setattr(_registry, "_IMPORT_ERROR", failure)
    monkeypatch.setattr(_path, "gpu_devices", lambda: (H100,))
    if allowed:
        monkeypatch.setenv(_fallback.ALLOW_NO_NATIVE, "1")
    else:  # the CPU tier may run with it set
        monkeypatch.delenv(_fallback.ALLOW_NO_NATIVE, raising=False)
    cause = "libcuda.so.1: cannot open" if failure else "is not built"
    if not allowed:
        with pytest.raises(RuntimeError, match=f"{cause}.*JAX_FA4_ALLOW_NO_NATIVE=1"):
            plan(Q, KV, KV)
        with pytest.raises(RuntimeError, match=f"{cause}.*JAX_FA4_ALLOW_NO_NATIVE=1"):
            jax_fa4.supports(Q, KV, KV)  # it had answered "cudnn"
    else:
        with pytest.warns(RuntimeWarning, match=cause):
            assert plan(Q, KV, KV).path == "cudnn"
        assert jax_fa4.supports(Q, KV, KV).path == "cudnn"
    # An explicit choice is honoured either way.
    assert plan(Q, KV, KV, implementation="reference").path == "reference"
    with pytest.raises(NotImplementedError, match=cause):
        plan(Q, KV, KV, implementation="cute")


def test_missing_native_module_beside_other_gpus_only_takes_their_path(monkeypatch):
    # Its kernels could not run on an A100: not built, calls there take cuDNN (it had
    # raised, asking for a build).
    monkeypatch.setattr(_registry, "_ffi", None)
    monkeypatch.setattr(_registry, "_IMPORT_ERROR", None)
    monkeypatch.setattr(_path, "gpu_devices", lambda: (A100,))
    with pytest.warns(RuntimeWarning, match="is not built"):
        assert plan(Q, KV, KV).path == "cudnn"


def test_missing_native_module_without_a_gpu_is_quiet(monkeypatch):
    monkeypatch.setattr(_registry, "_ffi", None)
    monkeypatch.setattr(_registry, "_IMPORT_ERROR", ImportError("undefined symbol: x"))
    monkeypatch.setattr(_path, "gpu_devices", lambda: ())
    assert _registry.native_reason() == (
        "native module jax_fa4._ffi failed to import: ImportError('undefined symbol: x')")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan(Q, KV, KV).path == "reference"


def _inputs(b, sq, sk, hq, hkv, d, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(key, (b, s, h, d), jnp.float32)
            for key, s, h in zip(keys, (sq, sk, sk), (hq, hkv, hkv))]


# Lengths past the end, negative and zero: clipped first, as attention does.
LENGTH_VALUES = {"q_lengths": [3, 40], "kv_lengths": [-2, 17]}


@pytest.mark.parametrize("sq,sk,kwargs", [
    (16, 24, dict(causal=True, alignment="top_left")),
    (16, 16, dict(causal=True)),
    (16, 24, dict(causal=True, window=(5, 0), alignment="top_left")),
    (16, 24, dict(q_lengths=True)),
    (16, 24, dict(kv_lengths=True, causal=True, alignment="top_left")),
    (16, 24, dict(q_lengths=True, kv_lengths=True, window=(2, None), causal=True,
                  alignment="top_left")),
    (16, 24, {}),
])
def test_the_jax_nn_mapping_equals_the_reference(sq, sk, kwargs):
    q, k, v = _inputs(2, sq, sk, 4, 2, 64)
    kwargs = {"causal": False, **kwargs}
    lengths = {name: jnp.clip(jnp.array(LENGTH_VALUES[name], jnp.int32), 0, size)
               for name, size in (("q_lengths", sq), ("kv_lengths", sk))
               if kwargs.pop(name, False)}
    spec = AttentionSpec.from_inputs(
        q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
        softmax_scale=None, return_lse=False, **kwargs,
        **{n: jax.ShapeDtypeStruct((2,), jnp.int32) for n in lengths})
    assert _fallback.cudnn_support(spec, sq, sk, hopper=False) == (True, "")
    got = _fallback.through_jax_nn(spec, q, k, v, implementation="xla",
                                   q_lengths=lengths.get("q_lengths"),
                                   kv_lengths=lengths.get("kv_lengths"))
    expected, _ = reference_attention(q, k, v, **spec.reference_options(), **lengths)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_a_driver_without_a_jax_gpu_backend_warns(built, tmp_path, monkeypatch):
    """A jax without its CUDA plugin on a GPU machine had run every call on the CPU's
    reference without a word (only supports() said why). (With the kernels built:
    without them, supports() names that first.)"""
    driver = tmp_path / "version"
    driver.write_text("NVRM version: 580")
    monkeypatch.setattr(_path, "NVIDIA_DRIVER", str(driver))
    monkeypatch.setattr(_path, "gpu_devices", lambda: ())
    monkeypatch.setattr(_path, "gpu_unseen", functools.cache(_path.gpu_unseen.__wrapped__))
    q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match=r"JAX sees no GPU .*jax\[cuda13\]"):
        jax_fa4.attention(q, q, q)
    assert "an NVIDIA driver is installed" in jax_fa4.supports(q, q, q)[1]
    # Chosen on purpose: no warning.
    monkeypatch.setattr(_path, "gpu_unseen", functools.cache(_path.gpu_unseen.__wrapped__))
    monkeypatch.setattr(_fallback, "_warned", set())
    platforms = jax.config.jax_platforms
    jax.config.update("jax_platforms", "cpu")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jax_fa4.attention(q, q, q)
    finally:
        jax.config.update("jax_platforms", platforms)
