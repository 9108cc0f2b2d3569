"""The XLA FFI calls of the 16-bit kernels to the native handlers (jax_fa4._ffi); the
e4m3 forward's is `_float8`'s.

vmap reaches these calls already folded into the batch (_sharding.py); the handlers
also fold any leading dimensions into the batch, so `broadcast_all` is exact should a
call be batched directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import _segment_plan
from jax_fa4._kernel_select import bwd_kernel, fwd_kernel
from jax_fa4._spec import AttentionSpec
from jax_fa4._varying import vary_like

FWD_TARGET = "jax_fa4_fwd"
BWD_TARGET = "jax_fa4_bwd"


def fwd(q, k, v, *segments, spec: AttentionSpec, pages=None, rows_per_position=1,
        unpack=None, q_heads_as_rows=False, appended=None, descale=None):
    """q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) -> out (B, Sq, H, Dv),
    lse (B, H, Sq) fp32; Hkv divides H (GQA/MQA). `segments`: (rows, keys) of
    `_segment_plan` for the segment kernels, from which the plan for the forward's tiles
    is made here; with `rows_per_position` g (pack-GQA), each of the rows stands for g
    consecutive rows of q, and the kernel gets them repeated. With
    spec.split_kernel the kernel writes fp32 partials per split into workspace
    results and its combine kernel merges them (`_split_kv`). With spec.paged, k (P,
    page_size, Hkv, D) and v are caches and `pages` (B, max_pages) int32 their table
    (`_paged`). `unpack(out, lse)` maps the kernel's layout to the caller's (pack-GQA:
    rows_per_position g > 1), on the last three axes of out and two of lse; a split's
    combine writes the caller's layout itself. `q_heads_as_rows`: q is a decode step's
    in the caller's layout (one position, (B, 1, H * g, D)), which the split kernel
    reads as the packed problem's g rows per K/V head. `appended` (paged only): (k_new,
    v_new) (B, S, Hkv, D / Dv), rows the kernel writes into the caches at each batch's
    last S keys before attending; the caches come back too, (out, lse, k, v), written
    in place (XLA aliases them to k and v: donate them, or XLA copies them first).
    `descale`: with spec.kv_float8 (k, v and appended rows in float8_e4m3fn, q bf16),
    the (3, Hkv) float32 table of `_float8.descale_table` (its q row 1), the last
    operand."""
    *lead, sq, heads, _ = q.shape
    dv, g = v.shape[-1], rows_per_position
    split = spec.split_kernel
    if q_heads_as_rows:
        if not (split and g > 1 and sq == 1):
            raise ValueError("q_heads_as_rows needs a split kernel, pack-GQA and one position")
        sq, heads = g, heads // g
    if split and g > 1:
        out_shape, lse_shape = (*lead, sq // g, heads * g, dv), (*lead, heads * g, sq // g)
    else:
        out_shape, lse_shape = (*lead, sq, heads, dv), (*lead, heads, sq)
    # Split partials (fp32, a batch of them per split); unused, empty, without a split.
    parts = (spec.num_splits,) if split else (0,)
    results = (
        jax.ShapeDtypeStruct(out_shape, q.dtype),
        jax.ShapeDtypeStruct(lse_shape, jnp.float32),
        # The "dynamic" schedule's tile counter (kernels/sm90/schedule.py): XLA
        # allocates it (so it joins buffer assignment and command buffers), the handler
        # zeroes it before such a kernel.
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((*lead, *parts, sq, heads, dv) if split else parts,
                             jnp.float32),
        jax.ShapeDtypeStruct((*lead, *parts, heads, sq) if split else parts, jnp.float32),
    )
    aliases = {}
    if appended is not None:
        results += tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k, v))
        aliases = {1: len(results) - 2, 2: len(results) - 1}
    call = jax.ffi.ffi_call(FWD_TARGET, results, vmap_method="broadcast_all",
                            input_output_aliases=aliases)
    # A paged call that appends visits its key blocks upwards: the blocks that take
    # the new rows come last, and their loads' wait for the append warp
    # (kernels/sm90/paged.py) finds it done. Batch 32 over 1152 keys in pages of 64
    # (the generation example's step, L2 flushed): 31.1 -> 29.3 us, the append's share
    # 2.0 -> 0.3 us; batch 1 at 8k keys 22.9 -> 22.3 us (H100, 2026-11-28, alternated
    # twice). Without new rows the plan stays downwards: upwards, that batch-1 step
    # took 22.0 -> 22.2-22.4 us.
    plan = functools.partial(_segment_plan.forward_plan,
                             one_segment=not (spec.has_segment_ids or spec.varlen),
                             ascending=appended is not None)
    extra = _segment_operands(segments, fwd_kernel(spec), plan, rows_per_position) + (
        (pages,) if spec.paged else ()) + (tuple(appended) if appended is not None else ()) + (
        (descale,) if spec.kv_float8 else ())
    out, lse, _counter, _out_part, _lse_part, *caches = call(
        q, k, v, *extra, **spec.ffi_attributes(), unpack_group=np.int32(g if split else 1),
        q_heads_as_rows=q_heads_as_rows)
    if unpack is not None and not split:
        out, lse = unpack(out, lse)
    return vary_like((q, k, v), (out, lse, *caches))


def _segment_operands(segments, kernel, make_plan, rows_per_position=1):
    """The segment kernels' extra operands: rows (each repeated rows_per_position
    times), keys and the plan for `kernel`'s tiles, made from the rows before their
    repetition; none without segments."""
    if not segments:
        return ()
    rows, keys = segments
    plan = make_plan(rows, keys, kernel["tile_m"], kernel["tile_n"], repeat=rows_per_position)
    if rows_per_position > 1:
        rows = jnp.repeat(rows, rows_per_position, axis=-1)
    return rows, keys, plan


def _check_backward_sizes(kernel, sq, sq_pad, sk, head_dim) -> None:
    """The backward's limits (ffi/attention_bwd.cc), refused while tracing rather than at
    the launch: its key indices, up to an even number of key blocks (a pair kernel's
    last may be empty), and its fp32 dq accumulator (sq_pad * D per row) are int32.
    Symbolic sizes (jax.export) are left to the handler."""
    if not isinstance(sq_pad, int) or not isinstance(sk, int):
        return
    tile_n = kernel["tile_n"]
    padded_keys = -(-sk // (2 * tile_n)) * 2 * tile_n
    if padded_keys >= 1 << 31 or sq_pad * head_dim >= 1 << 31:
        raise ValueError(
            f"the backward kernel {kernel['name']} takes Sk rounded up to an even number of "
            f"{tile_n}-key blocks < 2^31 and Sq * D < 2^31; got Sk {sk}, Sq {sq}, "
            f"D {head_dim}")


def bwd(q, k, v, out, dout, lse, dlse, *segments, spec: AttentionSpec, rows_per_position=1):
    """q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), out, dout (B, Sq, H, Dv),
    lse/dlse (B, H, Sq) fp32 -> dq, dk, dv like q, k, v. Needs `bwd_kernel(spec)`.
    `segments` and `rows_per_position` as for `fwd`.

    The kernel's workspaces are extra results: XLA allocates them (so they take part in
    its buffer assignment and in command buffers) and the kernel initializes them. Their
    last dimension follows the kernel's query tile (ffi/kernel_table.cc
    WorkspaceExtents, which the handler checks against these shapes)."""
    kernel = bwd_kernel(spec)
    *lead, sq, heads, head_dim = q.shape
    tile_m = kernel["tile_m"]
    tiles = (sq + tile_m - 1) // tile_m  # symbolic sizes (jax.export) allow this
    sq_pad = tiles * tile_m
    _check_backward_sizes(kernel, sq, sq_pad, k.shape[-3], head_dim)

    def rows(extent, dtype=jnp.float32):
        return jax.ShapeDtypeStruct((*lead, heads, extent), dtype)

    results = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),  # dq
        jax.ShapeDtypeStruct(k.shape, k.dtype),  # dk
        jax.ShapeDtypeStruct(v.shape, v.dtype),  # dv
        rows(sq_pad),  # lse2: lse in base 2, padded
        rows(sq_pad),  # dsum: rowsum(dout * out) - dlse
        rows(sq_pad * head_dim),  # dq_accum: fp32 dq accumulator
        rows(tiles * kernel["dq_parts"], jnp.int32),  # sem: deterministic mode's turn counters
    )
    call = jax.ffi.ffi_call(BWD_TARGET, results, vmap_method="broadcast_all")
    extra = _segment_operands(segments, kernel, _segment_plan.backward_plan,
                              rows_per_position)
    dq, dk, dv, *_workspaces = call(q, k, v, out, dout, lse, dlse, *extra,
                                    **spec.bwd_ffi_attributes())
    return vary_like((q, k, v, out, dout, lse, dlse), (dq, dk, dv))
