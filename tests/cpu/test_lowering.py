"""Path selection seen in the HLO lowered for CUDA on this CPU machine (forward and
backward kernel calls, the backward's workspace results), and registration.

`built` uses the real native module when it is built, else a stand-in with the manifest
of kernels/config.py (lowering needs no registered handler). Tests marked `native` need
the real module.
"""

import functools
import importlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxlib import xla_client

import jax_fa4
from jax_fa4 import _api, _path, _registry

# Attributes print in alphabetical order; keys_as_m, long_rows, num_splits,
# q_heads_as_rows and softcap sit between the ones read here.
CALL = re.compile(r"stablehlo\.custom_call @jax_fa4_fwd\(.*?"
                  r"banded = (true|false), keys_as_m = (?:true|false), kv_float8 = false, "
                  r"long_rows = (?:true|false), num_splits = \d+ : i32, "
                  r"q_heads_as_rows = (?:true|false), softcap = \S+ : f32, "
                  r"softmax_scale = (\S+) : f32")
BWD_CALL = re.compile(r"stablehlo\.custom_call @jax_fa4_bwd\(.*?banded = (true|false), "
                      r"deterministic = (true|false), softcap = \S+ : f32, "
                      r"softmax_scale = (\S+) : f32.*?-> \((.*)\)$", re.MULTILINE)


def fwd_calls(fn, *args, platform="cuda"):
    """[(banded, softmax_scale)] of each jax_fa4_fwd call in fn lowered for `platform`."""
    # A fresh function each time: jit caches traces per function, and the path is
    # chosen while tracing.
    traced = jax.jit(lambda *a: fn(*a)).trace(*args)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    return [(c == "true", np.float32(s)) for c, s in CALL.findall(text)]


def bwd_calls(fn, *args, platform="cuda"):
    """[(causal, deterministic, softmax_scale, result types)] of each jax_fa4_bwd call."""
    traced = jax.jit(lambda *a: fn(*a)).trace(*args)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    return [(c == "true", d == "true", np.float32(s), re.findall(r"tensor<([^>]*)>", results))
            for c, d, s, results in BWD_CALL.findall(text)]


def grad_of_sum(attn):
    """jax.grad (all of q, k, v) of a scalar of attn's output."""
    return jax.grad(lambda *a: jnp.sum(attn(*a).astype(jnp.float32)), argnums=(0, 1, 2))


def bwd_tile_m(dtype, d: int, *, banded: bool) -> int:
    """Query rows per tile of the backward kernel a plain call (no softcap, no segments)
    of this dtype, square head dim d and band runs (from the built manifest)."""
    name = "bf16" if dtype == jnp.bfloat16 else "fp16"
    (kernel,) = [k for k in jax_fa4.kernels()
                 if k["kind"] == "bwd" and k["dtype"] == name and k["head_dim"] == d
                 and k["head_dim_v"] == d and k["banded"] == banded
                 and not k["softcap"] and not k["segments"]]
    return kernel["tile_m"]


def sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


class FakeGpu:
    def __init__(self, compute_capability):
        self.compute_capability = compute_capability


@pytest.mark.parametrize("dtype,d,causal,scale", [
    (jnp.bfloat16, 128, False, None),
    (jnp.float16, 64, True, 0.3),
    (jnp.bfloat16, 256, True, 1.7),
])
def test_default_lowers_to_the_kernel_for_cuda(built, dtype, d, causal, scale):
    q, kv = sds(2, 17, 4, d, dtype=dtype), sds(2, 113, 4, d, dtype=dtype)
    attn = functools.partial(jax_fa4.attention, causal=causal, softmax_scale=scale)
    expected_scale = np.float32(d ** -0.5 if scale is None else scale)
    assert fwd_calls(attn, q, kv, kv) == [(causal, expected_scale)]
    assert fwd_calls(attn, q, kv, kv, platform="cpu") == []


@pytest.mark.parametrize("q,kwargs", [
    (sds(2, 17, 4, 128, dtype=jnp.float32), {}),
    (sds(2, 17, 4, 320), {}),
    (sds(2, 17, 4, 128), dict(softmax_scale=-1.0)),
    (sds(2, 17, 4, 128), dict(softmax_scale=0.0)),
])
def test_default_falls_back_statically(built, q, kwargs):
    kv = sds(2, 33, 4, q.shape[-1], dtype=q.dtype)
    assert fwd_calls(functools.partial(jax_fa4.attention, **kwargs), q, kv, kv) == []


def test_only_hopper_gpus_get_the_kernel(built, monkeypatch):
    # Other GPUs take the fallback (tests/cpu/test_fallback.py), decided statically.
    q = sds(1, 8, 2, 64)
    monkeypatch.setattr(_path, "gpu_devices", lambda: (FakeGpu("8.0"),))
    with pytest.warns(RuntimeWarning, match="need Hopper"):
        assert _api._plan(q, q, q, causal=False, softmax_scale=None, return_lse=False,
                          implementation=None).path == "cudnn"
    monkeypatch.setattr(_path, "gpu_devices", lambda: (FakeGpu("9.0"),))
    assert len(fwd_calls(jax_fa4.attention, q, q, q)) == 1


def test_cute_lowers_to_the_kernel(built, monkeypatch):
    monkeypatch.setattr(_path, "gpu_devices", lambda: (FakeGpu("9.0"),))
    q = sds(1, 8, 2, 64, dtype=jnp.float16)
    attn = functools.partial(jax_fa4.attention, causal=True, implementation="cute")
    assert fwd_calls(attn, q, q, q) == [(True, np.float32(0.125))]


def test_vmap_and_grad_lower_to_the_kernel(built):
    stacked, q = sds(3, 2, 16, 4, 64), sds(2, 16, 4, 64)
    attn = functools.partial(jax_fa4.attention, causal=True)
    assert len(fwd_calls(jax.vmap(attn), stacked, stacked, stacked)) == 1
    assert len(fwd_calls(jax.vmap(attn, in_axes=(0, None, None)), stacked, q, q)) == 1

    def loss(q, k, v):
        out, lse = attn(q, k, v, return_lse=True)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    assert len(fwd_calls(jax.value_and_grad(loss), q, q, q)) == 1
    # Plain grad: the backward kernel needs the forward's out and lse.
    assert len(fwd_calls(jax.grad(loss), q, q, q)) == 1
    assert len(bwd_calls(jax.grad(loss), q, q, q)) == 1


@pytest.mark.parametrize("dtype,d,causal,deterministic,scale,sq", [
    (jnp.bfloat16, 128, False, False, None, 17),
    (jnp.float16, 64, True, True, 0.3, 129),
    (jnp.bfloat16, 64, True, False, 1.7, 64),
    (jnp.float16, 256, False, True, None, 65),
])
def test_grad_lowers_to_both_kernels(built, dtype, d, causal, deterministic, scale, sq):
    q, kv = sds(2, sq, 4, d, dtype=dtype), sds(2, 113, 4, d, dtype=dtype)
    attn = functools.partial(jax_fa4.attention, causal=causal, softmax_scale=scale,
                             deterministic=deterministic)
    grad = grad_of_sum(attn)
    expected_scale = np.float32(d ** -0.5 if scale is None else scale)
    assert fwd_calls(grad, q, kv, kv) == [(causal, expected_scale)]
    # dq, dk, dv, then the workspaces of the kernel's query tiles (tile_m rows) and 2
    # consumers: lse2 and dsum (B, H, Sq_pad), dq_accum (B, H, Sq_pad * D), sem (B, H,
    # Sq_pad / tile_m * 2).
    tile_m = bwd_tile_m(dtype, d, banded=causal)
    sq_pad = -(-sq // tile_m) * tile_m
    ty = "bf16" if dtype == jnp.bfloat16 else "f16"
    results = [f"2x{sq}x4x{d}x{ty}", f"2x113x4x{d}x{ty}", f"2x113x4x{d}x{ty}",
               f"2x4x{sq_pad}xf32", f"2x4x{sq_pad}xf32", f"2x4x{sq_pad * d}xf32",
               f"2x4x{2 * sq_pad // tile_m}xi32"]
    assert bwd_calls(grad, q, kv, kv) == [(causal, deterministic, expected_scale, results)]
    assert bwd_calls(grad, q, kv, kv, platform="cpu") == []


@pytest.mark.parametrize("heads_kv", [2, 1])
def test_gqa_lowers_to_the_kernels_with_kv_heads(built, heads_kv):
    # 8 query heads on 2 (GQA) or 1 (MQA) key/value heads: k and v go in with their own
    # heads, and the backward kernel returns dk, dv with them (it sums each group).
    q, kv = sds(2, 70, 8, 128), sds(2, 113, heads_kv, 128)
    grad = grad_of_sum(functools.partial(jax_fa4.attention, causal=True))
    assert len(fwd_calls(grad, q, kv, kv)) == 1
    (call,) = bwd_calls(grad, q, kv, kv)
    kv_type = f"2x113x{heads_kv}x128xbf16"
    assert call[3][:3] == ["2x70x8x128xbf16", kv_type, kv_type]
    dq, dk, dv = jax.eval_shape(grad, q, kv, kv)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, kv.shape, kv.shape)


def test_grad_without_a_backward_kernel_uses_the_reference(built, monkeypatch):
    # A module built with forward kernels only (e.g. a partial developer build).
    forward_only = tuple(e for e in _registry._MANIFEST if e["kind"] == "fwd")
    monkeypatch.setattr(_registry, "_MANIFEST", forward_only)
    q = sds(2, 17, 4, 256)
    grad = grad_of_sum(functools.partial(jax_fa4.attention, causal=True))
    assert len(fwd_calls(grad, q, q, q)) == 1
    assert bwd_calls(grad, q, q, q) == []


def test_forced_kernels_refuse_a_grad_without_a_backward_kernel(built, monkeypatch):
    # implementation="cute" had differentiated with the reference unseen, so GPU tests of
    # the backward kernels could pass without running one.
    forward_only = tuple(e for e in _registry._MANIFEST if e["kind"] == "fwd")
    monkeypatch.setattr(_registry, "_MANIFEST", forward_only)
    monkeypatch.setattr(_path, "gpu_devices", lambda: (FakeGpu("9.0"),))
    q = sds(2, 17, 4, 128)
    grad = grad_of_sum(functools.partial(jax_fa4.attention, implementation="cute"))
    with pytest.raises(NotImplementedError, match="no backward kernel was built"):
        jax.jit(grad).trace(q, q, q)


def test_vmap_of_grad_folds_into_the_batch(built):
    stacked, kv = sds(3, 2, 17, 4, 64), sds(3, 2, 80, 4, 64)
    grad = grad_of_sum(functools.partial(jax_fa4.attention, causal=True))
    (call,) = bwd_calls(jax.vmap(grad), stacked, kv, kv)
    tile_m = bwd_tile_m(jnp.bfloat16, 64, banded=True)
    sq_pad = -(-17 // tile_m) * tile_m
    assert call[3][:4] == ["6x17x4x64xbf16", "6x80x4x64xbf16", "6x80x4x64xbf16",
                           f"6x4x{sq_pad}xf32"]


def kernel_operand_types(fn, *args):
    """The operand types of each jax_fa4_fwd / jax_fa4_bwd call in fn lowered for CUDA,
    and whether the lowering has a loop (a lax.map)."""
    text = jax.jit(lambda *a: fn(*a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @jax_fa4_(?:fwd|bwd)\(.*?\) \{.*?\} : \(([^)]*)\)", text)
    return [re.findall(r"tensor<([^>]*)>", c) for c in calls], "stablehlo.while" in text


@pytest.mark.parametrize("elements,batch,calls_batch,loop", [
    (3, 30000, 30000, True),  # 90000 > 65535 (a grid dimension): one element a call
    (4, 30000, 60000, True),  # two elements a call
    (2, 30000, 60000, False),  # all of them
])
def test_vmap_folds_no_more_than_a_grid_takes(built, elements, batch, calls_batch, loop):
    # Each element's batch passed the per-call checks; the vmapped axes folded into it
    # must not pass the grid's 65535 (a launch error at run time).
    q = sds(elements, batch, 16, 4, 64)
    grad = grad_of_sum(functools.partial(jax_fa4.attention, causal=True))
    calls, looped = kernel_operand_types(jax.vmap(grad), q, q, q)
    assert [c[0] for c in calls] == [f"{calls_batch}x16x4x64xbf16"] * 2  # fwd, bwd
    assert looped == loop


def test_vmap_folds_no_more_than_a_split_out_view_takes(built, monkeypatch):
    # A decode-shaped call whose split kernel's 32-bit out view holds one element's
    # out (16384 x 16 x 32 x 128 = 2^30) but not two folded together.
    monkeypatch.setattr(_path, "gpu_devices", lambda: (FakeGpu("9.0"),))
    q, kv = sds(2, 16384, 16, 32, 128), sds(2, 16384, 512, 8, 128)
    calls, looped = kernel_operand_types(jax.vmap(jax_fa4.attention), q, kv, kv)
    (call,) = calls
    assert call[0].startswith("16384x") and looped


def test_register_targets_once(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target",
                        lambda name, stages, platform: calls.append((name, platform)))
    stand_in = types.SimpleNamespace(registrations=lambda: {"jax_fa4_fwd": {}, "other": {}})
    monkeypatch.setattr(_registry, "_ffi", stand_in)
    _registry._register_targets()
    _registry._register_targets()
    assert calls == [("jax_fa4_fwd", "CUDA"), ("other", "CUDA")]


@pytest.mark.native
def test_import_registers_once(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda *a, **k: calls.append(a))
    importlib.reload(_registry)
    importlib.reload(jax_fa4)
    assert calls == []
    if "CUDA" not in xla_client._custom_callback_handler:
        # Without a CUDA backend, XLA queues CUDA registrations until one appears.
        pending = [entry[0] for entry in xla_client._custom_callback.get("CUDA", [])]
        assert pending.count("jax_fa4_fwd") == 1
        assert pending.count("jax_fa4_fwd_fp8") == 1
        assert pending.count("jax_fa4_bwd") == 1


@pytest.mark.native
def test_manifest_matches_kernel_config(expected_manifest):
    assert jax_fa4.kernels() == expected_manifest
    kinds = [entry["kind"] for entry in expected_manifest]
    # 40 split forwards, 24 paged ones (segment variants, head dims 64, 128, 256), 6
    # float8 ones (head dims 64, 128, 256, full and banded), 9 float8-KV ones (split:
    # dense, segments, paged; head dims 64, 128, 256), 6 keys-as-M split tiles (bf16
    # and float8 K/V at head dim 128; dense, segments, paged), 6 long-row tiles (bf16
    # and fp16: banded at head dims 64 and 256, without a mask at 128)
    assert (kinds.count("fwd"), kinds.count("bwd")) == (141, 50)
    assert sum(entry["dtype"] == "e4m3" for entry in expected_manifest) == 6
    assert sum(entry["kv_dtype"] == "e4m3" != entry["dtype"]
               for entry in expected_manifest) == 12
    assert sum(entry.get("keys_as_m", False) for entry in expected_manifest) == 6
    assert sum(entry.get("long_rows", False) for entry in expected_manifest) == 6


def test_top_left_self_attention_keeps_the_kernel(built):
    # With Sq == Sk (and no lengths) top-left and bottom-right are the same band, which
    # is what the Flax / Equinox adapters rely on for causal self-attention.
    x = sds(2, 64, 4, 64)
    top_left = functools.partial(jax_fa4.attention, causal=True, alignment="top_left")
    assert fwd_calls(top_left, x, x, x) == [(True, np.float32(64 ** -0.5))]
    assert "top_left = false" in jax.jit(top_left).trace(x, x, x).lower(
        lowering_platforms=("cuda",)).as_text()
    # With Sq != Sk the banded kernel takes the top-left band.
    kv = sds(2, 80, 4, 64)
    assert fwd_calls(top_left, x, kv, kv) == [(True, np.float32(64 ** -0.5))]
    assert "top_left = true" in jax.jit(top_left).trace(x, kv, kv).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window": (8, 8)}])
def test_softcap_lowers_to_the_banded_softcap_kernels(built, kwargs):
    # Softcap is built into the banded variant only: without a mask it runs there with
    # an unbounded band (window sides -1). The cap travels as an attribute, forward and
    # backward, and no reference is traced for CUDA.
    x = sds(2, 64, 4, 64)
    attn = functools.partial(jax_fa4.attention, softcap=30.0, **kwargs)
    assert fwd_calls(attn, x, x, x) == [(True, np.float32(64 ** -0.5))]
    assert [call[:2] for call in bwd_calls(grad_of_sum(attn), x, x, x)] == [(True, False)]
    text = jax.jit(grad_of_sum(attn)).trace(x, x, x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("softcap = 3.000000e+01 : f32") == 2
    if not kwargs:
        assert text.count("window_left = -1 : i32, window_right = -1 : i32") == 2


@pytest.mark.parametrize("d,dv,kd,kdv", [(80, 80, 96, 96), (32, 32, 64, 64),
                                         (64, 128, 128, 128), (192, 128, 192, 128),
                                         (160, 96, 192, 128), (192, 192, 256, 256)])
def test_head_dims_run_the_least_kernel_that_holds_them(built, monkeypatch, d, dv, kd, kdv):
    # (D, Dv) runs the built (kd, kdv) >= it with the least kd + kdv: its own kernel
    # when built (192/128), else zero-padded, with the softmax scale of the true D;
    # forward and backward.
    q, k, v = sds(2, 40, 4, d), sds(2, 24, 4, d), sds(2, 24, 4, dv)
    monkeypatch.setattr(_path, "gpu_devices", lambda: (FakeGpu("9.0"),))
    assert jax_fa4.supports(q, k, v) == (True, "")
    assert fwd_calls(jax_fa4.attention, q, k, v) == [(False, np.float32(d ** -0.5))]
    text = jax.jit(grad_of_sum(jax_fa4.attention)).trace(q, k, v).lower(
        lowering_platforms=("cuda",)).as_text()
    operands = (rf"tensor<2x40x4x{kd}xbf16>, tensor<2x24x4x{kd}xbf16>, "
                rf"tensor<2x24x4x{kdv}xbf16>, tensor<2x40x4x{kdv}xbf16>")
    assert re.search(rf"@jax_fa4_bwd\(.* : \({operands}", text)
    out = jax.eval_shape(jax_fa4.attention, q, k, v)
    assert out.shape == (2, 40, 4, dv)


@pytest.mark.native
def test_module_md5_names_the_loaded_build():
    import hashlib
    import pathlib

    digest = hashlib.md5(pathlib.Path(_registry._ffi.__file__).read_bytes()).hexdigest()
    assert _registry.module_md5() == digest[:8]


def test_module_md5_without_a_module(monkeypatch):
    monkeypatch.setattr(_registry, "_ffi", None)
    assert _registry.module_md5() is None
