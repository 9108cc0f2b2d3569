r"""Upstream FlashAttention-4 (PyTorch) on the standard cells, timed as bench.run times
jax_fa4 and cuDNN: the GPU kernels' own durations (CUPTI, here through torch.profiler),
--iterations calls run back to back, the median of their per-call sums, the backward as
the whole forward-and-backward less the training forward. Run it in the session that
runs bench.run, on the same GPU:

    python -m bench.fa4_peer --out $OUT/fa4.jsonl
    python -m bench.fa4_peer --hdims 128 --seqlens 512,16384 --causal true

Back to back matters: JAX's profiler (bench.timing) queues its calls one after another,
so the GPU runs them under sustained load at the clocks its power limit allows. With
--isolated each call is profiled alone, the GPU idle between calls (the timing of
2026-12-05's cells, "cupti-torch"), which lets long calls run at higher clocks: that
day FA4's backward came out 1.05-1.15x the anchors' from 8k tokens, and jax_fa4's own
backward kernels under Nsight Compute (one kernel at a time) 1.07-1.12x faster than
bench.run times them.

The stored anchors (anchors_h100.jsonl, ../shared/anchors) timed FA4 with CUDA events
around 20 calls, which also counts the gaps between launches: against bench.run's CUPTI
kernel time that had favoured jax_fa4, most at 512 tokens. Needs torch and upstream
FA4 (`flash_attn.cute`; ../shared/anchors/README.md says how to install it on the GPU
machine); imports no JAX, so that JAX does not take the GPU's memory.

Writes bench.run's JSON lines (backend "fa4_cute", timing "cupti-torch-back-to-back",
or "cupti-torch" with --isolated) to --out and prints a line per cell. `python -m
bench.plot --tables` takes the latest file's lines, so appending them to a matrix run's
file puts same-session FA4 cells in README's tables.
"""

import argparse
import datetime
import json
import os
import pathlib
import statistics
import tempfile

from bench.clocks import ClockSampler, describe
from bench.flops import HIDDEN, TOKENS, attention_flops

BACKEND = "fa4_cute"
TIMING = "cupti-torch-back-to-back"
TIMING_ISOLATED = "cupti-torch"


def _kernels(trace: dict) -> list[dict]:
    """The GPU kernels of a Chrome trace (torch.profiler's export): events of category
    "kernel"; memsets and copies are left out, as bench.timing's CUPTI kernel time
    leaves them."""
    return [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") == "kernel"]


def kernel_ms(trace: dict) -> float:
    """The summed duration, ms, of the GPU kernels in a trace."""
    return sum(e["dur"] for e in _kernels(trace)) / 1e3


def per_call_ms(trace: dict, calls: int) -> list[float]:
    """Each call's summed kernel duration, ms, from a trace of `calls` identical calls
    run back to back: the kernels in start order, split into `calls` equal runs, as
    JAX's profiler splits them (every call must launch the same kernels)."""
    kernels = sorted(_kernels(trace), key=lambda e: e["ts"])
    if not kernels or len(kernels) % calls:
        raise RuntimeError(f"{len(kernels)} GPU kernels recorded over {calls} calls: "
                           "not the same kernels each call")
    n = len(kernels) // calls
    runs = [kernels[i * n:(i + 1) * n] for i in range(calls)]
    names = [e["name"] for e in runs[0]]
    if any([e["name"] for e in run] != names for run in runs[1:]):
        raise RuntimeError("the calls launched different kernels")
    return [sum(e["dur"] for e in run) / 1e3 for run in runs]


def _timed(fn, iterations: int, isolated: bool, warmup: int = 3) -> tuple[float, dict | None]:
    """Median over `iterations` calls of fn's kernel time: the calls back to back in one
    profiled run, or (isolated) each profiled alone; and bench.clocks' summary of the
    GPU's clocks over them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):  # FA4 compiles each configuration at its first call
        fn()
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")

        def profiled(calls):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            prof.export_chrome_trace(path)
            return json.loads(pathlib.Path(path).read_text())

        with ClockSampler() as clocks:
            if isolated:
                times = [kernel_ms(profiled(1)) for _ in range(iterations)]
            else:
                times = per_call_ms(profiled(iterations), iterations)
    if not any(times):
        raise RuntimeError("no GPU kernels were recorded")
    return statistics.median(times), clocks.summary


def measure(b, s, h, d, causal, iterations, isolated=False) -> dict:
    """{mode: ms} of FA4's forward, its training forward and its backward on one cell,
    and "clocks": {mode: bench.clocks' summary} of the forward's and the backward's
    calls (the backward's: the forward-and-backward calls)."""
    import torch
    from flash_attn.cute import flash_attn_func

    def attend(q, k, v):
        out = flash_attn_func(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            attend(q, k, v)

    def both():
        torch.autograd.grad(attend(q, k, v), (q, k, v), dout)

    fwd, fwd_clocks = _timed(forward, iterations, isolated)
    train, _ = _timed(lambda: attend(q, k, v), iterations, isolated)  # keeps what bwd reads
    both_ms, both_clocks = _timed(both, iterations, isolated)
    return {"fwd": fwd, "bwd": both_ms - train, "fwd_train": train,
            "clocks": {"fwd": fwd_clocks, "bwd": both_clocks}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="512,2048,8192,16384")
    ap.add_argument("--causal", default="false,true", help="comma-separated false, true")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--isolated", action="store_true",
                    help="profile each call alone, the GPU idle between calls (the timing "
                         "of the 2026-12-05 cells), instead of back to back")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fa4.jsonl"))
    args = ap.parse_args(argv)
    masks = args.causal.split(",")
    if not set(masks) <= {"false", "true"}:
        ap.error(f"--causal takes false, true; got {args.causal!r}")
    try:
        hdims = [int(x) for x in args.hdims.split(",")]
        seqlens = [int(x) for x in args.seqlens.split(",")]
    except ValueError:
        ap.error("--hdims and --seqlens take comma-separated integers")
    if args.iterations < 1 or min(hdims + seqlens) < 1 or any(HIDDEN % d for d in hdims):
        ap.error(f"sizes and --iterations must be >= 1; head dims must divide {HIDDEN}")
    import flash_attn
    import torch

    if not torch.cuda.is_available():
        ap.error("bench.fa4_peer times GPU kernels; torch sees no GPU")
    device = torch.cuda.get_device_name()
    stack = {"torch": torch.__version__, "flash_attn": getattr(flash_attn, "__version__", None),
             "iterations": args.iterations}
    timing = TIMING_ISOLATED if args.isolated else TIMING
    print(f"# {device}, torch {torch.__version__}, FA4 {stack['flash_attn']}, timing: {timing}")
    today = datetime.date.today().isoformat()
    with open(args.out, "a") as out:
        for d in hdims:
            for causal in (m == "true" for m in masks):
                for s in seqlens:
                    b, h = max(1, TOKENS // s), HIDDEN // d
                    cell = dict(backend=BACKEND, dtype="bfloat16", b=b, s=s, h=h, d=d,
                                causal=causal, date=today, timing=timing, device=device,
                                **stack)
                    try:
                        ms = measure(b, s, h, d, causal, args.iterations, args.isolated)
                    except Exception as e:  # a cell FA4 cannot run is reported
                        rec = dict(cell, mode="error", failed_mode="fwd", err=repr(e)[:300])
                        out.write(json.dumps(rec) + "\n")
                        print(f"# d{d} causal={causal} s{s} failed: {rec['err']}", flush=True)
                        continue
                    line = []
                    for mode in ("fwd", "bwd"):
                        flops = attention_flops(b, h, s, s, d, causal, mode)
                        rec = dict(cell, mode=mode, ms=ms[mode],
                                   tflops=flops / ms[mode] / 1e9,
                                   **({"fwd_train_ms": ms["fwd_train"]} if mode == "bwd"
                                      else {}))
                        if ms["clocks"][mode] is not None:
                            rec["clocks"] = ms["clocks"][mode]
                        out.write(json.dumps(rec) + "\n")
                        line.append(f"{mode} {ms[mode]:.3f} ms {rec['tflops']:.0f} TFLOP/s "
                                    f"({describe(ms['clocks'][mode])})")
                    print(f"d{d} causal={causal} s{s}: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
