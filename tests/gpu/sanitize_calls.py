"""Small calls of every kernel the build has, for compute-sanitizer (tests/gpu/sanitize.sh).

Each forward kernel gets one call that selects it, each backward kernel jax.grad of that
call in both dq modes (atomic, deterministic). The split forwards (split-KV) get the calls
of their variant with splitting forced, down to runs of one key block and runs left
empty; every other call is traced with splitting off. The paged forwards get
paged_attention over a cache of 32-key pages in random order, with page ids and lengths
out of range, appending its 200 query rows' keys and values (k_new, v_new). The float8-KV
forwards (kv_dtype e4m3) get their variant's call with k and v (and the caches) in e4m3,
and no varlen case (attention_varlen takes no float8). The
segment kernels get one more call each, with runtime indices out of range (cu_seqlens past the packed length, decreasing
or negative; lengths negative or past S), which the kernels must survive without an
out-of-bounds access. The keys-as-M split tiles get decode steps (one position; no
varlen case: its packed rows are no decode step). Sizes are small (the sanitizers are slow) but leave partial tiles
and several query tiles and key blocks per problem, and the bands have masked edges.
The persistent forwards (not segment or banded long-row ones) get their call once more
with more heads, so that every CTA runs several tiles.

    python tests/gpu/sanitize_calls.py              # run every call on the GPU, timed
    python tests/gpu/sanitize_calls.py --list       # print the calls, check their kernels
    python tests/gpu/sanitize_calls.py --dry-run    # and lower each for CUDA (no GPU needed)
    python tests/gpu/sanitize_calls.py --only d128_banded

Each call is traced first and must build the FFI calls of its kernel and no others
(else it is reported and not run); the dry run also lowers it for CUDA. Run without a
tool, the driver times the calls uninstrumented: the baseline of the sanitizer runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4 import _ffi_calls, _float8, _kernel_select, _path, _split_kv
from kernels import config

# Sq and Sk fill no tile or block of any kernel (tile_m 64..192, tile_n 64..128) and
# span at least two. Two KV heads for four query heads is GQA; at Sq = 200 pack-GQA
# gains too little to be chosen (_pack_gqa.worthwhile), so the plain kernels run.
BATCH, SEQ_Q, SEQ_K, HEADS_Q, HEADS_KV = 2, 200, 300, 4, 2
# The keys-as-M split tiles (8 query rows) take decode steps: one position, whose 2
# query heads per KV head pack into 2 rows.
DECODE_Q = 1
# The banded long-row tiles take rows that may see LONG_BAND_KEYS keys: Sk past it, in
# no block or tile boundary; the one without a mask LONG_FULL_ROWS queries and keys:
# Sq = Sk past it, inside a 192-row tile and an 80-key block.
LONG_K = _path.LONG_BAND_KEYS + 100
LONG_FULL = _path.LONG_FULL_ROWS + 52
# paged_attention: pages of PAGE keys, PAGES table entries per batch, a spare page.
PAGE, PAGES = 32, 10
# attention_varlen's packed lengths.
TOTAL_Q, TOTAL_K = 400, 600
SOFTCAP = 5.0
# The persistent forwards' second call (kernels/config.py Tile.schedule "static" or
# "dynamic": a CTA per SM, or two, taking tiles in turn): 2 x 32 heads of 600 rows are
# 320 tiles of 128 rows (256 of 192, 640 of 64) for 132 SMs, so each CTA runs several
# and what carries across its tiles runs too: the Q ring, the tile counter's handoff,
# the O store waited for in the next tile (Tile.defer_o_read).
MANY_HEADS_Q, MANY_HEADS_KV, SEQ_MANY = 32, 16, 600
PERSISTENT = frozenset(c.name for c in config.FWD_MANIFEST if c.tile.schedule != "tile")

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "e4m3": jnp.float8_e4m3fn}
FLOAT8 = ("e4m3",)  # forwards through their own FFI target (jax_fa4/_float8.py)


@dataclasses.dataclass(frozen=True)
class Call:
    kernel: dict  # the manifest entry the call must reach
    case: str  # what the call holds, for the progress lines
    options: dict  # static keyword arguments of attention / attention_varlen
    arrays: dict  # its int32 runtime arrays: segment ids, lengths or cu_seqlens
    varlen: bool = False
    paged: bool = False  # paged_attention over a cache (operands builds it)
    deterministic: bool | None = None  # None: the forward alone; else jax.grad's dq mode
    seq_q: int = SEQ_Q
    seq_k: int = SEQ_K
    heads: tuple[int, int] = (HEADS_Q, HEADS_KV)  # query and K/V heads

    def __str__(self):
        mode = {None: "", False: ", grad atomic", True: ", grad deterministic"}
        return f"{self.case}{mode[self.deterministic]}"


def _ids(length, documents):
    """Sorted segment ids of `documents` equal parts (the packed documents of one row)."""
    return np.arange(length, dtype=np.int32) * documents // length


# The main call of each variant (causal, softcap, segments) of the manifest: the
# features that select it, on bands with both masked edges and blocks skipped whole.
MAIN = {
    (False, False, False): ("no mask", {}, {}, False),
    (True, False, False): ("causal, window (150, 0)", {"causal": True, "window": (150, None)},
                           {}, False),
    (True, True, False): ("softcap, window (70, 20) top-left",
                          {"softcap": SOFTCAP, "window": (70, 20), "alignment": "top_left"},
                          {}, False),
    (True, False, True): (
        "segment ids and lengths, causal", {"causal": True},
        {"q_segment_ids": np.stack([_ids(SEQ_Q, 3), _ids(SEQ_Q, 5)]),
         "kv_segment_ids": np.stack([_ids(SEQ_K, 3), _ids(SEQ_K, 5)]),
         "q_lengths": np.array([170, SEQ_Q], np.int32),
         "kv_lengths": np.array([SEQ_K, 231], np.int32)}, False),
    # Rows before the first and after the last sequence; an empty query sequence.
    (True, True, True): (
        "varlen, softcap, causal", {"softcap": SOFTCAP, "causal": True},
        {"cu_seqlens_q": np.array([5, 105, 105, 300, 390], np.int32),
         "cu_seqlens_k": np.array([0, 150, 190, 400, 580], np.int32)}, True),
}

# The main call of the keys-as-M variants (decode steps), without and with segments
# (a band on packed rows takes the segment variant: no band without).
DECODE_MAIN = {
    False: ("decode, no mask", {}, {}, False),
    True: ("decode, lengths, causal", {"causal": True},
           {"kv_lengths": np.array([SEQ_K, 231], np.int32)}, False),
}

# The main call of the banded long-row variants: the band's left edge inside the keys (the
# first blocks skipped whole), its right edge on the diagonal.
LONG_MAIN = ("causal, window (LONG_BAND_KEYS, 0)",
             {"causal": True, "window": (_path.LONG_BAND_KEYS, None)}, {}, False)

# Runtime indices out of range, for the segment kernels: each gets one, in turn. Any
# int32 value is defined (attention's and attention_varlen's docs), and whatever the
# caller passes, the kernels must stay inside their buffers.
OUT_OF_RANGE = (
    ("varlen, cu_seqlens past the packed length",
     {"cu_seqlens_q": np.array([0, 150, 380, 520], np.int32),
      "cu_seqlens_k": np.array([0, 250, 700, 900], np.int32)}, True),
    ("varlen, decreasing cu_seqlens",
     {"cu_seqlens_q": np.array([0, 300, 120, 400], np.int32),
      "cu_seqlens_k": np.array([0, 500, 200, 600], np.int32)}, True),
    ("varlen, negative cu_seqlens",
     {"cu_seqlens_q": np.array([-60, -10, 200, 400], np.int32),
      "cu_seqlens_k": np.array([-200, 100, -50, 600], np.int32)}, True),
    ("lengths negative and past S",
     {"q_lengths": np.array([-5, 2 * SEQ_Q], np.int32),
      "kv_lengths": np.array([5 * SEQ_K, -1], np.int32)}, False),
)


def plan(kernels: list[dict]) -> list[tuple[dict, list[Call]]]:
    """Each of `kernels` (manifest entries) with its calls."""
    result = []
    turn = {"fwd": 0, "bwd": 0}  # segment kernels so far, per kind: whose OUT_OF_RANGE is next
    for kernel in kernels:
        decode = kernel.get("keys_as_m", False)
        seq_q = DECODE_Q if decode else SEQ_Q
        if kernel.get("paged"):
            options = {"causal": True} | ({"softcap": SOFTCAP} if kernel["softcap"] else {})
            # Ids below 0 and past the cache, a length past the table, a negative one.
            table = np.random.default_rng(0).permutation(BATCH * PAGES + 1)[:BATCH * PAGES]
            table = table.reshape(BATCH, PAGES).astype(np.int32)
            table[0, 2], table[1, 9] = -3, 10 ** 6
            arrays = {"page_table": table, "kv_lengths": np.array([10 ** 6, 231], np.int32)}
            result.append((kernel, [Call(kernel, "paged cache, ids and lengths out of range",
                                         options, arrays, paged=True, seq_q=seq_q)]))
            continue
        long_band = kernel.get("long_rows", False) and kernel["banded"]
        long_full = kernel.get("long_rows", False) and not kernel["banded"]
        seq_q = LONG_FULL if long_full else seq_q
        seq_k = LONG_K if long_band else LONG_FULL if long_full else SEQ_K
        cases = [DECODE_MAIN[kernel["segments"]] if decode else LONG_MAIN if long_band
                 else MAIN[kernel["banded"], kernel["softcap"], kernel["segments"]]]
        if kernel["segments"]:
            float8_kv = kernel.get("kv_dtype", kernel["dtype"]) != kernel["dtype"]
            choices = [c for c in OUT_OF_RANGE if not ((float8_kv or decode) and c[2])]
            case, arrays, varlen = choices[turn[kernel["kind"]] % len(choices)]
            turn[kernel["kind"]] += 1
            # A band as well, and the softcap that selects a softcap variant.
            options = {"causal": True} | ({"softcap": SOFTCAP} if kernel["softcap"] else {})
            cases.append((case, options, arrays, varlen))
        modes = (None,) if kernel["kind"] == "fwd" else (False, True)
        calls = [Call(kernel, case, _with_bounds(options, varlen), arrays, varlen,
                      deterministic=mode, seq_q=seq_q, seq_k=seq_k)
                 for case, options, arrays, varlen in cases for mode in modes]
        if kernel["name"] in PERSISTENT and not (kernel["segments"] or long_band):
            case, options, arrays, _ = cases[0]
            many = LONG_FULL if long_full else SEQ_MANY
            calls.append(Call(kernel, f"{case}, several tiles a CTA", options, arrays,
                              seq_q=many, seq_k=many,
                              heads=(MANY_HEADS_Q, MANY_HEADS_KV)))
        result.append((kernel, calls))
    return result



def _with_bounds(options: dict, varlen: bool) -> dict:
    """attention_varlen's static max_seqlen_q / max_seqlen_k: the packed lengths bound
    every sequence (the kernels size their grid from those anyway)."""
    return {**options, "max_seqlen_q": TOTAL_Q, "max_seqlen_k": TOTAL_K} if varlen else options


def operands(call: Call):
    """q, k, v in the call's kernel dtype and head dims, from a seed of their own."""
    kernel = call.kernel
    d, dv = kernel["head_dim"], kernel["head_dim_v"]
    hq, hkv = call.heads
    if call.varlen:
        shapes = (TOTAL_Q, hq, d), (TOTAL_K, hkv, d), (TOTAL_K, hkv, dv)
    elif call.paged:  # k and v are the caches
        pages = BATCH * PAGES + 1
        shapes = ((BATCH, call.seq_q, hq, d), (pages, PAGE, hkv, d), (pages, PAGE, hkv, dv))
    else:
        shapes = ((BATCH, call.seq_q, hq, d), (BATCH, call.seq_k, hkv, d),
                  (BATCH, call.seq_k, hkv, dv))
    rng = np.random.default_rng(zlib.crc32(f"{kernel['name']} {call.case}".encode()))
    dtypes = [DTYPES[kernel["dtype"]]] + 2 * [DTYPES[kernel.get("kv_dtype", kernel["dtype"])]]
    return [rng.standard_normal(s, np.float32).astype(t) for s, t in zip(shapes, dtypes)]


def function(call: Call, implementation):
    """f(q, k, v, arrays): the call's attention, or its jax.grad in q, k, v."""
    attention = jax_fa4.attention_varlen if call.varlen else jax_fa4.attention

    def forward(q, k, v, arrays):
        if call.paged:  # appending rows of q as its tokens' keys and values
            heads_kv = k.shape[2]
            new = (q[:, :, :heads_kv].astype(k.dtype),
                   q[:, :, heads_kv:2 * heads_kv, :v.shape[-1]].astype(v.dtype))
            out, lse, *_ = jax_fa4.paged_attention(
                q, k, v, **call.options, **arrays, k_new=new[0], v_new=new[1],
                return_lse=True, implementation=implementation)
            return out, lse
        return attention(q, k, v, **call.options, **arrays, return_lse=True,
                         implementation=implementation, deterministic=bool(call.deterministic))

    if call.deterministic is None:
        return forward  # out and lse are results: allocations of their own, for memcheck

    def loss(*args):  # lse joins it, so the backward gets a cotangent of lse too
        out, lse = forward(*args)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    return jax.grad(loss, argnums=(0, 1, 2))


@contextlib.contextmanager
def ffi_kernels():
    """Collects (kind, kernel name) of each FFI call built meanwhile: `_ffi_calls` (and
    `_float8`, float8 forwards) builds them all, each from the spec that names its
    kernel."""
    built = set()

    def recording(build, kind):
        def wrapper(*args, spec, **keywords):
            find = _kernel_select.fwd_kernel if kind == "fwd" else _kernel_select.bwd_kernel
            built.add((kind, find(spec)["name"]))
            return build(*args, spec=spec, **keywords)
        return wrapper

    fwd, bwd, fp8 = _ffi_calls.fwd, _ffi_calls.bwd, _float8._kernel
    _ffi_calls.fwd, _ffi_calls.bwd = recording(fwd, "fwd"), recording(bwd, "bwd")
    _float8._kernel = recording(fp8, "fwd")  # the float8 forward's own FFI call
    try:
        yield built
    finally:
        _ffi_calls.fwd, _ffi_calls.bwd, _float8._kernel = fwd, bwd, fp8


@contextlib.contextmanager
def splitting(split: bool):
    """Split-KV forced for a split kernel's call (any grid splits, into runs of a block
    or more) and off for the others: `_split_kv`'s thresholds, read while tracing."""
    saved = _split_kv.FILL, _split_kv.MIN_BLOCKS_PER_SPLIT
    _split_kv.FILL, _split_kv.MIN_BLOCKS_PER_SPLIT = (float("inf"), 1) if split else (0.0, 1)
    try:
        yield
    finally:
        _split_kv.FILL, _split_kv.MIN_BLOCKS_PER_SPLIT = saved


def trace(call: Call, q, k, v, implementation):
    """(the call traced, '' when it builds the FFI calls of its kernel and no others,
    else which it builds): the forward kernel's, or under jax.grad, the forward and the
    backward kernel of the variant."""
    # JAX keeps the traces of the inner functions (the custom_vjp, the sharding rules),
    # where the FFI calls are built: an earlier call with the same spec and shapes would
    # leave nothing to record.
    jax.clear_caches()
    with ffi_kernels() as built, splitting(call.kernel.get("split", False)):
        traced = jax.jit(function(call, implementation)).trace(q, k, v, call.arrays)
    name = call.kernel["name"]
    # Names differ only in their kind prefix (kernels/config.py).
    expected = {("fwd", "fwd" + name.removeprefix(call.kernel["kind"]))}
    if call.deterministic is not None:
        expected.add(("bwd", name))
    return traced, "" if built == expected else f"builds {sorted(built)}"


def lowering_problem(traced, call: Call) -> str:
    """'' when the call lowers for CUDA to one forward custom call (and one backward
    under jax.grad), else what it lowers to."""
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    fwd = "jax_fa4_fwd_fp8" if call.kernel["dtype"] in FLOAT8 else "jax_fa4_fwd"
    expected = {fwd: 1, "jax_fa4_bwd": int(call.deterministic is not None)}
    found = {target: text.count(f"custom_call @{target}(") for target in expected}
    return "" if found == expected else f"lowers to custom calls {found}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", metavar="SUBSTRING",
                        help="only the kernels whose name contains SUBSTRING")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true",
                      help="print the calls and check that each reaches its kernel; run nothing")
    mode.add_argument("--dry-run", action="store_true",
                      help="--list, and lower each call for CUDA (no GPU needed)")
    args = parser.parse_args()
    dry = args.list or args.dry_run
    if dry:
        jax.config.update("jax_platforms", "cpu")  # lowering for CUDA needs no GPU

    # Planned for all kernels, then picked: --only reproduces the calls of a full run.
    todo = [(kernel, calls) for kernel, calls in plan(jax_fa4.kernels())
            if args.only in kernel["name"]]
    if not todo:
        print(f"sanitize_calls: no kernel of the {len(jax_fa4.kernels())} built has "
              f"{args.only!r} in its name")
        return 1
    # The dry run takes the kernel path of any platform (the kernel where the call is
    # lowered for CUDA): "cute" refuses to trace without a Hopper GPU.
    implementation = None if dry else "cute"
    start, count, failed = time.perf_counter(), 0, 0
    for i, (kernel, kernel_calls) in enumerate(todo, 1):
        tic = time.perf_counter()
        for call in kernel_calls:
            q, k, v = operands(call)
            traced, why = trace(call, q, k, v, implementation)
            if args.dry_run and not why:
                why = lowering_problem(traced, call)
            if dry or why:
                print(f"  {kernel['name']}: {call}: {why or 'ok'}", flush=True)
            count += 1
            failed += bool(why)
            if not (dry or why):
                jax.block_until_ready(traced.lower().compile()(q, k, v, call.arrays))
        if not dry:
            print(f"[{i}/{len(todo)}] {kernel['name']}: {len(kernel_calls)} calls in "
                  f"{time.perf_counter() - tic:.1f} s", flush=True)
    print(f"sanitize_calls: {len(todo)} kernels, {count} calls "
          f"{'checked' if dry else 'run'} in {time.perf_counter() - start:.1f} s; "
          f"{failed} do not reach their kernel", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
