"""Which path a call takes, and the kernel layout it runs in.

The path: the kernel ("cute"), the kernel per platform ("platform": the kernel where
lowered for CUDA, the reference elsewhere), cuDNN through jax.nn where the kernels
cannot run on a GPU (`_fallback`), or the pure-JAX reference. The layout, on the kernel
paths: pack-GQA (`_pack_gqa`) and split-KV (`_split_kv`). `plan` takes a validated spec
to the final one. Whether a built kernel covers a spec is `_kernel_select`'s answer;
whether this machine runs it, and what runs instead, is decided here.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax

from jax_fa4 import (_fallback, _float8, _kernel_select, _pack_gqa, _registry,
                     _segment_plan, _split_kv)
from jax_fa4._spec import AttentionSpec

NVIDIA_DRIVER = "/proc/driver/nvidia/version"
NO_JAX_GPU = (
    "jax_fa4: this machine has an NVIDIA driver, but JAX sees no GPU (a jax installed "
    "without its CUDA plugin: pip install 'jax[cuda13]'); attention runs the pure-JAX "
    "reference on the CPU. Set JAX_PLATFORMS=cpu to run on the CPU on purpose.")


def plan(spec: AttentionSpec, implementation, sizes: tuple, warn: bool = True) -> AttentionSpec:
    """A validated spec with its path, then its packing, then its split, then its
    long-row tile: each step reads the one before it (the split counts the grid the
    packing left). sizes: `sizes`'s; warn: `choose`'s."""
    return with_long_rows(with_split(with_packing(
        choose(spec, implementation, sizes, warn), *sizes[2:]), sizes), sizes)


def sizes(q, k, *, varlen: bool) -> tuple:
    """(batch, query heads, Sq, Sk) as the kernels see them (varlen: one packed row)."""
    if varlen:
        return 1, q.shape[1], q.shape[0], k.shape[0]
    return q.shape[0], q.shape[2], q.shape[1], k.shape[1]


def choose(spec: AttentionSpec, implementation, sizes: tuple,
           warn: bool = True) -> AttentionSpec:
    """The spec with its path; warns of a fallback where a GPU is, unless `warn` is off
    (a probe whose caller runs, and warns of, another call)."""
    if implementation == "reference":
        return spec.with_path("reference")
    if implementation == "cute":
        if _kernel_select.kernel_dtype(spec) is None:
            raise NotImplementedError(
                f"implementation='cute' takes bfloat16, float16 or float8_e4m3fn inputs; "
                f"got {spec.dtype}")
        ok, reason = kernel_runs_here(spec, sizes)
        if not ok:
            raise NotImplementedError(reason)
        return spec.with_path("cute")
    path, reason, why = decide(spec, sizes)
    # No GPU: the reference is this machine's path, no fallback.
    if warn and path != "platform" and gpu_devices():
        _fallback.warn_once(reason + (f"; {why}" if why else ""), path)
    if gpu_unseen():
        _fallback.warn_message_once(NO_JAX_GPU)
    return spec.with_path(path)


@functools.cache
def gpu_unseen() -> bool:
    """Whether an NVIDIA GPU is installed but JAX has no GPU backend, unless the process
    chose its platforms without one (JAX_PLATFORMS=cpu): every call would otherwise run
    the reference on the CPU without a word."""
    chosen = jax.config.jax_platforms
    if chosen and not any(p in chosen for p in ("cuda", "gpu")):
        return False
    return not gpu_devices() and os.path.exists(NVIDIA_DRIVER)


def decide(spec: AttentionSpec, sizes: tuple) -> tuple[str, str, str]:
    """(path, why not the kernel, why not cuDNN) of implementation=None, with no side
    effect (`supports` asks it too): "platform" where the kernels take the call and
    every GPU here is a Hopper, else "reference" without a GPU, else cuDNN or the
    reference (`fallback`). Raises RuntimeError beside a Hopper GPU where the native
    module failed to import, unless that is allowed."""
    ok, reason = kernel_support(spec, sizes)
    if ok and not non_hopper_gpus():
        return "platform", "", ""
    if not gpu_devices():
        return "reference", reason, ""
    # A GPU the kernels cannot serve: decided statically, since a per-platform switch
    # would send any GPU to the kernel. A missing module is an error only where a Hopper
    # would run it (elsewhere its kernels could not run anyway).
    if (not ok and _registry.native_reason() and not _fallback.native_allowed()
            and any(is_hopper(d) for d in gpu_devices())):
        raise RuntimeError(
            f"jax_fa4: {_registry.native_reason()}, on a machine with a GPU "
            f"({describe(gpu_devices())}); reinstall jax_fa4, or set "
            f"{_fallback.ALLOW_NO_NATIVE}=1 to run without the kernels (cuDNN or the "
            "pure-JAX reference, with a warning)")
    if ok:
        reason = f"they need Hopper (sm_90) GPUs; visible: {describe(gpu_devices())}"
    path, why = fallback(spec, sizes)
    return path, reason, why


def fallback(spec: AttentionSpec, sizes: tuple) -> tuple[str, str]:
    """("cudnn" or "reference", why not cuDNN) for a call the kernels do not take: cuDNN
    needs a GPU and a call it computes exactly."""
    if not gpu_devices():
        return "reference", ""
    ok, why = _fallback.cudnn_support(spec, sizes[2], sizes[3],
                                      hopper=all(map(is_hopper, gpu_devices())))
    return ("cudnn", "") if ok else ("reference", why)


def with_packing(spec: AttentionSpec, seqlen_q: int, seqlen_k: int) -> AttentionSpec:
    """Pack-GQA (`_pack_gqa`) on the kernel paths, where it needs fewer query tiles and
    its kernels were built."""
    if (spec.path not in ("cute", "platform") or spec.group_size == 1
            or not isinstance(seqlen_q, int) or spec.out_dtype is not None):
        return spec  # a symbolic Sq (jax.export) keeps the plain layout; float8 has none
    packed = dataclasses.replace(spec, pack_gqa=True)
    if packed.segment_kernel and not _segment_plan.positions_support(seqlen_q, seqlen_k)[0]:
        return spec  # a packed band runs the segment kernel, whose plans it would outgrow
    fwd, bwd = _kernel_select.fwd_kernel, _kernel_select.bwd_kernel
    if (_pack_gqa.worthwhile(spec.group_size, seqlen_q, fwd(spec)["tile_m"])
            and fwd(packed) is not None and (bwd(packed) is not None or bwd(spec) is None)):
        return packed
    return spec


def with_split(spec: AttentionSpec, sizes: tuple, always: bool = False) -> AttentionSpec:
    """Split-KV (`_split_kv`) on the kernel paths, for static sizes whose grid leaves SMs
    idle or whose query rows fit one split tile (`always`: any), where the split kernel
    was built. The grid is counted as the kernel sees it: pack-GQA runs each group's
    query heads as rows of one key/value head."""
    batch, heads, seqlen_q, seqlen_k = sizes
    if spec.path not in ("cute", "platform") or not all(
            isinstance(n, int) for n in sizes):
        return spec
    split = _kernel_select.fwd_kernel(dataclasses.replace(spec, split_kernel=True))
    if split is None or not _split_kv.out_view_fits(batch, heads, seqlen_q, spec.head_dim_v):
        return spec
    if spec.pack_gqa:
        heads, seqlen_q = heads // spec.group_size, seqlen_q * spec.group_size
    # Rows that fit the decode tile (keys as the wgmma's M) run it where it was built.
    decode = _kernel_select.fwd_kernel(dataclasses.replace(spec, split_kernel=True,
                                                           keys_as_m=True))
    keys_as_m = (_split_kv.KEYS_AS_M and decode is not None
                 and seqlen_q <= decode["tile_m"])
    if keys_as_m:
        split = decode
    ctas = batch * heads * -(-seqlen_q // split["tile_m"])
    key_blocks = -(-seqlen_k // split["tile_n"])
    splits = _split_kv.num_splits(ctas, key_blocks,
                                  _split_kv.slots(sm_count(), split, spec.kv_float8))
    if splits == 1 and not always and not _split_kv.split_kernel_unsplit(
            seqlen_q, key_blocks, split["tile_m"]):
        return spec
    return dataclasses.replace(spec, split_kernel=True, num_splits=splits, keys_as_m=keys_as_m)


# Keys a row of a band sees, from which dense banded calls take the long-row tile
# (kernels/config.py _LONG_ROWS: 192 rows at d64, 80-key blocks at d256, where shorter
# bands take 64-key ones). Against the 128-row tile, d64 causal
# (H100, 2026-11-27, alternated twice in one call): 1.06x at 4k keys, 1.13-1.19x at 8k
# and 16k, level at 2k, 0.85-0.87x at 512 and 1k; a window of 1024 keys 0.93x.
LONG_BAND_KEYS = 4096
# Queries and keys from which calls without a mask take the long-row tile (d128: 192
# rows, 80-key blocks): 1.03-1.04x from 2k (kernels/config.py _LONG_ROWS). Below, the
# last 192-row tile and 80-key block add more padded work than the taller tile saves
# (512: 0.88x).
LONG_FULL_ROWS = 2048


def with_long_rows(spec: AttentionSpec, sizes: tuple) -> AttentionSpec:
    """The long-row tile on the kernel paths for a dense call (no split, segments or
    pages), where it was built: banded, when its rows may see LONG_BAND_KEYS keys or
    more (a band open on one side sees up to Sk keys, a window up to left + right + 1);
    without a mask, from LONG_FULL_ROWS queries and keys."""
    seqlen_q, seqlen_k = sizes[2:]
    if (spec.path not in ("cute", "platform") or not isinstance(seqlen_k, int)
            or not isinstance(seqlen_q, int)
            or spec.split_kernel or spec.segment_kernel or spec.paged):
        return spec
    if spec.banded:
        left, right = spec.window_left, 0 if spec.causal else spec.window_right
        keys = seqlen_k if left is None or right is None else min(seqlen_k, left + right + 1)
        if keys < LONG_BAND_KEYS:
            return spec
    elif min(seqlen_q, seqlen_k) < LONG_FULL_ROWS:
        return spec
    long_rows = dataclasses.replace(spec, long_rows=True)
    return spec if _kernel_select.fwd_kernel(long_rows) is None else long_rows


def sm_count() -> int:
    """SMs of the first Hopper GPU; an H100 SXM's 132 when none is visible (a kernel
    path lowered without one)."""
    hopper = [d for d in gpu_devices() if is_hopper(d)]
    return getattr(hopper[0], "core_count", 132) if hopper else 132


def kernel_support(spec: AttentionSpec, sizes: tuple) -> tuple[bool, str]:
    """Whether a built kernel covers the call (devices aside)."""
    ok, reason = _kernel_select.kernel_support(spec)
    if ok:
        ok, reason = _kernel_select.grid_support(*sizes[:2])
    if ok and spec.segment_kernel:
        ok, reason = _segment_plan.positions_support(*sizes[2:])
    if ok:
        ok, reason = _float8.v_view_support(spec, sizes)
    return ok, reason


def kernel_runs_here(spec: AttentionSpec, sizes: tuple) -> tuple[bool, str]:
    ok, reason = kernel_support(spec, sizes)
    if not ok:
        return ok, reason
    if not any(is_hopper(d) for d in gpu_devices()):
        hint = (" (an NVIDIA driver is installed: a jax without its CUDA plugin? pip "
                "install 'jax[cuda13]')" if gpu_unseen() else "")
        return False, f"no Hopper (sm_90) GPU visible to JAX{hint}; devices: {jax.devices()}"
    return True, ""


@functools.cache
def gpu_devices() -> tuple:
    # Cached: backends do not change within a process, and probing a missing backend
    # raises on every call. Called through this module's globals, so tests can replace
    # it with fake devices.
    try:
        return tuple(jax.devices("gpu"))
    except RuntimeError:
        return ()


def is_hopper(device) -> bool:
    return str(getattr(device, "compute_capability", "")).startswith("9.")


def describe(devices) -> str:
    return ", ".join(f"{getattr(d, 'device_kind', 'GPU')} (compute capability "
                     f"{getattr(d, 'compute_capability', '?')})" for d in devices)


def non_hopper_gpus() -> bool:
    return any(not is_hopper(d) for d in gpu_devices())
