r"""Attention throughput of jax_fa4 next to the other JAX backends, on one GPU.

    python -m bench.run                                   # the standard table
    python -m bench.run --hdims 128 --seqlens 8192 --backends jax_fa4,jax_cudnn
    python -m bench.run --passes fwd,bwd,bwd_det          # forward and both backwards
    python -m bench.run --hdims 128 --heads 32 --heads-kv 8   # GQA 32 / 8
    python -m bench.run --seqlens 16384 --causal true --window 1024   # sliding window
    python -m bench.run --hdims 128 --softcap 30 --backends jax_fa4   # softcap (jax_fa4 only)
    python -m bench.run --hdims 192 --hdim-v 128          # D 192 / Dv 128 (MLA-style)
    python -m bench.run --seqlens 16384 --documents 8     # packed documents (+ jax_fa4_varlen)
    python -m bench.run --seqlens 8192 --seqlen-q 1 --batch 64 --heads 32 --heads-kv 8 \
        --causal false                                     # decode step (pack-GQA)
    python -m bench.run --seqlens 131072 --seqlen-q 1 --batch 1 --heads 32 --heads-kv 8 \
        --causal false --page-size 64       # decode over a paged cache (+ jax_fa4_paged,
                                            # and jax_fa4_lengths: the dense cache)
    python -m bench.run --hdims 128 --seqlens 512 --kernels   # and each kernel's time
    python -m bench.run --hdims 128 --seqlens 512 --flush-l2  # L2 emptied before each call
    python -m bench.run --hdims 128,256 --passes fwd --backends jax_fa4,jax_fa4_fp8,jax_cudnn
                                                          # float8 (e4m3) forward
    python -m bench.run --hdims 128 --seqlens 131072 --seqlen-q 1 --batch 1 --heads 32 \
        --heads-kv 8 --causal false --page-size 64 --passes fwd \
        --backends jax_fa4,jax_fa4_kv8,jax_fa4_paged,jax_fa4_paged_kv8,jax_cudnn
                                                          # float8 KV cache decode

Shapes follow ../shared/anchors: 16k tokens per batch (batch = 16384 / seqlen), hidden
2048 (heads = 2048 / head_dim). Every backend runs in this process and is timed on the
GPU (CUPTI kernel time, bench/timing.py). Prints a table (ms, TFLOP/s, jax_fa4 over the
best peer) and appends one JSON line per measurement, with the fields of the anchors
file, to --out. The stored upstream FlashAttention-4 (PyTorch) anchor (H100, bf16, L2
left warm) is shown beside the standard cells and, on an H100, counts as a peer, as the
targets and README's tables (bench.plot) count it; the header says which.

Passes: fwd; bwd, the backward (jax_fa4: atomic dq accumulation); bwd_det, the
deterministic backward of the backends that have one (bench/backends.py DETERMINISTIC),
whose ratio compares it with the best peer's bwd.
"""

import argparse
import datetime
import functools
import json
import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp

from bench.backends import BACKENDS, DETERMINISTIC, FP8, KV_FP8, PAGED
from bench.clocks import describe
from bench.flops import HIDDEN, TOKENS, attention_flops
from bench.timing import kernel_times, make_timer
from jax_fa4 import _registry

ANCHORS = pathlib.Path(__file__).with_name("anchors_h100.jsonl")
ANCHOR_BACKEND = "fa4_cute"
# The GPU the anchors ran on (SXM; a PCIe or NVL H100 is another GPU).
ANCHOR_DEVICE = "NVIDIA H100 80GB HBM3"
PASSES = ("fwd", "bwd", "bwd_det")


def load_anchors():
    table = {}
    if ANCHORS.exists():
        for line in ANCHORS.read_text().splitlines():
            r = json.loads(line)
            if r.get("backend") == ANCHOR_BACKEND and "tflops" in r:
                table[(r["d"], r["s"], r["causal"], r["mode"])] = r["tflops"]
    return table


def provenance(iterations: int) -> dict:
    """What a record needs to be reproduced beyond its cell: the software stack (jax,
    jaxlib, the backend's platform version, cuDNN where jax reports it), the source
    (git commit, and whether the tree differed from it) and the timed iterations."""
    import jaxlib

    record = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
              "platform": jax.devices()[0].client.platform_version,
              "iterations": iterations}
    try:
        from jax._src.lib import cuda_versions
        record["cudnn"] = cuda_versions.cudnn_get_version()
    except Exception:  # no CUDA plugin, or a jax without this internal
        pass
    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        git = functools.partial(subprocess.run, cwd=root, capture_output=True, text=True,
                                check=True)
        record["commit"] = git(["git", "rev-parse", "HEAD"]).stdout.strip()
        record["dirty"] = bool(git(["git", "status", "--porcelain", "--untracked-files=no"])
                               .stdout.strip())
    except (OSError, subprocess.CalledProcessError):  # a copy of the tree without .git
        pass
    return record


def cell_call(backend, b, s, h, d, causal, dtype, mode, h_kv=None, window_left=None,
              softcap=None, documents=None, seqlen_q=None, dv=None, page_size=None):
    """(call, args) of one pass of one backend on one cell (h query heads, h_kv
    key/value heads, default h; a causal sliding window over window_left + 1 keys;
    scores capped at softcap; rows packed with `documents` equal documents, as segment
    ids; v and out of head_dim dv, default d; K and V as a cache of page_size pages for
    the PAGED backends). A backward's call is the whole vjp, which re-runs the forward;
    mode "fwd_train" is that forward alone (jax.vjp's, which keeps the residuals: for
    cuDNN its training kernel, which also writes the softmax statistics)."""
    keys = jax.random.split(jax.random.key(0), 4)
    dv = dv or d
    q = jax.random.normal(keys[0], (b, seqlen_q or s, h, d), dtype)
    dout = jax.random.normal(keys[1], (b, seqlen_q or s, h, dv), dtype)
    k = jax.random.normal(keys[2], (b, s, h_kv or h, d), dtype)
    v = jax.random.normal(keys[3], (b, s, h_kv or h, dv), dtype)
    options = {"deterministic": True} if mode == "bwd_det" else {}
    training = mode in ("fwd_train", "bwd", "bwd_det")
    if window_left is not None:
        options["window_left"] = window_left
    if softcap is not None:
        options["softcap"] = softcap
    if documents:
        options["documents"] = documents
    if backend in PAGED:
        options["page_size"] = page_size
    if backend in FP8:
        if training:
            raise NotImplementedError(f"{backend} is forward only")
        q, k, v = (x.astype(jnp.float8_e4m3fn) for x in (q, k, v))
    if backend in KV_FP8:
        if training:
            raise NotImplementedError(f"{backend} is forward only")
        k, v = (x.astype(jnp.float8_e4m3fn) for x in (k, v))
    attn = BACKENDS[backend](causal, **options)
    if mode == "fwd":
        return attn, (q, k, v)
    if mode == "fwd_train":
        return (lambda q, k, v: jax.vjp(attn, q, k, v)), (q, k, v)

    def call(q, k, v, dout):
        return jax.vjp(attn, q, k, v)[1](dout)

    return call, (q, k, v, dout)


def measure(timer, backend, b, s, h, d, causal, dtype, iterations, mode, fwd_ms=None,
            h_kv=None, window_left=None, softcap=None, documents=None, seqlen_q=None,
            dv=None, page_size=None, kernels=False):
    """{"ms", "tflops"} of one pass of `cell_call`'s cell. The backward is timed as a
    whole vjp minus `fwd_ms`, the time of the vjp's own forward (mode "fwd_train"): for
    jax_fa4 and upstream FA4 the inference kernel, which writes the LSE anyway; for
    cuDNN its training kernel (subtracting its inference kernel had charged its backward
    0.9-2.7% more). "clocks": the GPU's SM clock and power over the timed calls
    (bench.clocks; absent without NVML). With `kernels`, also "kernels": [(name, ms)] of
    each GPU kernel of one call (a backward's list starts with the forward's kernels)."""
    call, args = cell_call(backend, b, s, h, d, causal, dtype, mode, h_kv=h_kv,
                           window_left=window_left, softcap=softcap, documents=documents,
                           seqlen_q=seqlen_q, dv=dv, page_size=page_size)
    ms, clocks = timer(call, *args, iterations=iterations)
    if mode in ("bwd", "bwd_det"):
        ms -= fwd_ms
    dv = dv or d
    flops = attention_flops(b, h, seqlen_q or s, s, d, causal,
                            "bwd" if mode in ("bwd", "bwd_det") else "fwd",
                            dv=dv, window_left=window_left, documents=documents or 1)
    result = {"ms": ms, "tflops": flops / ms / 1e9}
    if clocks is not None:
        result["clocks"] = clocks
    if kernels:
        result["kernels"] = kernel_times(call, *args, iterations=iterations)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--hdim-v", type=int,
                    help="head_dim of v and out; default: each of --hdims")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="false,true", help="comma-separated false, true")
    ap.add_argument("--heads", type=int, help="query heads; default 2048 / head_dim")
    ap.add_argument("--heads-kv", type=int,
                    help="key/value heads (GQA / MQA when fewer than --heads); default all")
    ap.add_argument("--window", type=int,
                    help="causal sliding window: each query sees itself and the WINDOW "
                         "keys before it (needs --causal true)")
    ap.add_argument("--softcap", type=float,
                    help="logit soft-capping at this value (backends without it: '-')")
    ap.add_argument("--documents", type=int,
                    help="pack each row with this many equal documents (segment ids)")
    ap.add_argument("--seqlen-q", type=int,
                    help="query rows per sequence (decode-like: 1); default the key length "
                         "(needs --causal false: jax.nn aligns causal top-left)")
    ap.add_argument("--batch", type=int, help="batch size; default 16384 / seqlen")
    ap.add_argument("--page-size", type=int,
                    help="jax_fa4_paged reads K and V as a cache of pages of this many keys")
    ap.add_argument("--backends",
                    help="comma-separated; default all (jax_fa4_varlen with --documents only)")
    ap.add_argument("--passes", default="fwd",
                    help="comma-separated fwd, bwd, bwd_det (the backwards need fwd)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--flush-l2", action="store_true",
                    help="empty L2 (a 256 MB read) before every timed call, as in a model "
                         "where other tensors pass through L2 between two attention calls "
                         "(timing \"cupti-cold\"); by default calls run back to back")
    ap.add_argument("--kernels", action="store_true",
                    help="also time each GPU kernel of a call (CUPTI): a line per backend "
                         "under each row, and \"kernels\" in the JSON lines")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench.jsonl"))
    args = ap.parse_args()

    backends = (args.backends.split(",") if args.backends else
                [be for be in BACKENDS if (args.documents or be != "jax_fa4_varlen")
                 and (args.page_size or be not in PAGED + ("jax_fa4_lengths",))
                 and be not in FP8])
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        ap.error(f"unknown backends {sorted(unknown)}; known: {sorted(BACKENDS)}")
    requested = set(args.passes.split(","))
    if not requested <= set(PASSES):
        ap.error(f"--passes takes {', '.join(PASSES)}")
    # In PASSES order: a backward's time subtracts the forward's, and bwd_det's ratio
    # uses the peers' bwd.
    passes = [p for p in PASSES if p in requested | {"fwd"}]
    masks = args.causal.split(",")
    if not set(masks) <= {"false", "true"}:
        ap.error(f"--causal takes false, true; got {args.causal!r}")
    if args.window is not None and (masks != ["true"] or args.window < 0):
        ap.error("--window takes a non-negative size, with --causal true")
    if args.softcap is not None and not args.softcap > 0:
        ap.error("--softcap takes a value > 0")
    if args.documents is not None and (args.documents < 1 or any(
            int(s) % args.documents for s in args.seqlens.split(","))):
        # Uneven documents would be a different problem on each backend (segment ids,
        # cu_seqlens across rows, jax.nn's reshape into a batch) and in the FLOP count.
        ap.error("--documents takes a count >= 1 that divides every --seqlens")
    if args.page_size is not None and (args.page_size < 1 or passes != ["fwd"]):
        ap.error("--page-size takes a size >= 1, with the forward pass only")
    if args.seqlen_q is not None and (masks != ["false"] or args.seqlen_q < 1
                                      or args.documents):
        ap.error("--seqlen-q takes a length >= 1, with --causal false and no --documents")
    if jax.default_backend() != "gpu":  # every cell would fail, or time the CPU reference
        ap.error(f"bench.run times GPU kernels; JAX sees no GPU (devices: {jax.devices()})")
    dtype = getattr(jnp, args.dtype)
    device = jax.devices()[0].device_kind
    # The anchors are H100 bf16 runs of the standard shapes (all heads, 2048 / head_dim
    # of them) with L2 left warm: shown only for those, and as a peer (the targets'
    # upstream FA4) only on an H100.
    standard = not (args.heads or args.heads_kv or args.window is not None or args.softcap
                    or args.documents or args.seqlen_q or args.batch or args.hdim_v
                    or args.page_size or args.flush_l2 or args.dtype != "bfloat16")
    anchors = load_anchors() if standard else {}
    anchor_is_peer = device == ANCHOR_DEVICE
    module = _registry.module_md5()  # which build: the native module's md5
    stack = provenance(args.iterations)
    method, timer = make_timer(cold=args.flush_l2)
    if args.kernels and method != "cupti":
        ap.error("--kernels needs CUPTI timing, which is unavailable here")
    shape = "".join([f", head_dim of v {args.hdim_v}" if args.hdim_v else "",
                     f", {args.heads} query heads" if args.heads else "",
                     f", {args.heads_kv} K/V heads" if args.heads_kv else "",
                     f", sliding window {args.window}" if args.window is not None else "",
                     f", softcap {args.softcap:g}" if args.softcap else "",
                     f", {args.documents} documents per row" if args.documents else "",
                     f", {args.seqlen_q} query rows" if args.seqlen_q else "",
                     f", pages of {args.page_size}" if args.page_size else "",
                     f", batch {args.batch}" if args.batch else ""])
    print(f"# {device}, jax {jax.__version__}, {args.dtype}, timing: {method}{shape}")
    header = ["pass", "d", "causal", "s"] + [f"{be} ms / TFLOP/s" for be in backends]
    header += ["fa4/best peer" + (" (anchor included)" if anchors and anchor_is_peer
                                  else " (this run)"), f"{ANCHOR_BACKEND} (H100 anchor)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))

    today = datetime.date.today().isoformat()  # the plots' titles name the run's dates
    with open(args.out, "a") as out:
        for d in (int(x) for x in args.hdims.split(",")):
            for causal in (c == "true" for c in masks):
                for s in (int(x) for x in args.seqlens.split(",")):
                    b, h = args.batch or max(1, TOKENS // s), args.heads or HIDDEN // d
                    h_kv = args.heads_kv or h
                    if h % h_kv:
                        ap.error(f"--heads-kv {h_kv} must divide the {h} query heads")
                    fwd, train, rows = {}, {}, {}
                    for mode in passes:
                        row = rows[mode] = {}
                        for be in backends:
                            if mode == "bwd_det" and be not in DETERMINISTIC:
                                continue
                            dt = "float8_e4m3fn" if be in FP8 else args.dtype
                            rec = dict(backend=be, dtype=dt, b=b, s=s, h=h, d=d, date=today,
                                       module=module, **stack,
                                       **({"kv_dtype": "float8_e4m3fn"} if be in KV_FP8
                                          else {}),
                                       causal=causal, mode=mode, timing=method, device=device,
                                       **({"h_kv": h_kv} if h_kv != h else {}),
                                       **({"window": args.window}
                                          if args.window is not None else {}),
                                       **({"softcap": args.softcap} if args.softcap else {}),
                                       **({"documents": args.documents}
                                          if args.documents else {}),
                                       **({"sq": args.seqlen_q} if args.seqlen_q else {}),
                                       **({"page_size": args.page_size}
                                          if args.page_size and be in PAGED else {}),
                                       **({"dv": args.hdim_v} if args.hdim_v else {}))
                            cell = (b, s, h, d, causal, dtype)
                            features = (h_kv, args.window, args.softcap, args.documents,
                                        args.seqlen_q, args.hdim_v, args.page_size)
                            try:
                                if mode != "fwd" and be not in fwd:
                                    raise RuntimeError("no forward time to subtract")
                                if mode != "fwd" and be not in train:
                                    # the vjp's own forward, once for both backwards
                                    train[be] = measure(timer, be, *cell, args.iterations,
                                                        "fwd_train", None, *features)["ms"]
                                rec.update(measure(timer, be, *cell, args.iterations, mode,
                                                   train.get(be), *features, args.kernels))
                                if mode != "fwd":
                                    rec["fwd_train_ms"] = train[be]
                                row[be] = rec
                                if mode == "fwd":
                                    fwd[be] = rec["ms"]
                            except Exception as e:  # a peer that cannot run a cell is reported
                                rec.update(mode="error", err=repr(e)[:300], failed_mode=mode)
                                print(f"# {be} {mode} d{d} causal={causal} s{s} failed: "
                                      f"{rec['err']}", flush=True)
                            out.write(json.dumps(rec) + "\n")
                        # The peers have one backward: bwd_det compares with it.
                        peer_row = rows.get("bwd", {}) if mode == "bwd_det" else row
                        print_row(row, peer_row, backends, anchors, mode, d, causal, s,
                                  anchor_is_peer)
                        for be, rec in row.items():
                            if "kernels" in rec:
                                print(kernel_line(be, rec["kernels"]), flush=True)
                        if any("clocks" in rec for rec in row.values()):
                            print("#   clocks: " + "; ".join(
                                f"{be} {describe(rec.get('clocks'))}"
                                for be, rec in row.items()), flush=True)


def kernel_line(backend, kernels) -> str:
    """One backend's kernels of a cell: total, then each kernel's ms in launch order."""
    parts = "; ".join(f"{name} {ms * 1e3:.1f}" for name, ms in kernels)
    total = sum(ms for _, ms in kernels)
    return f"#   {backend}: {total * 1e3:.1f} us = {parts}"


def print_row(row, peer_row, backends, anchors, mode, d, causal, s, anchor_is_peer):
    cells = [f"{row[be]['ms']:.3f} / {row[be]['tflops']:.0f}" if be in row else "-"
             for be in backends]
    peers = [peer_row[be]["tflops"] for be in peer_row if not be.startswith("jax_fa4")]
    # The anchors have one backward: bwd_det compares with it.
    anchor = anchors.get((d, s, causal, "bwd" if mode == "bwd_det" else mode))
    if anchor and anchor_is_peer:
        peers.append(anchor)
    ratio = f"{row['jax_fa4']['tflops'] / max(peers):.2f}" if "jax_fa4" in row and peers else "-"
    cells += [ratio, f"{anchor:.0f}" if anchor else "-"]
    print(f"| {mode} | {d} | {causal} | {s} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
