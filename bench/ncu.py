"""One cell's kernels under Nsight Compute, jax_fa4 next to its peers, in one report.

    python -m bench.ncu --hdim 128 --seqlen 512 --causal true            # forward
    python -m bench.ncu --hdim 128 --seqlen 16384 --causal false --pass bwd

Runs itself under `ncu` (clocks left alone, as bench.run's CUPTI times are taken; caches
flushed before each kernel, ncu's default):
each backend's call is compiled and warmed up outside the profiled range, then one
call per backend is profiled (every kernel it launches; a backward's call is the
whole vjp, so its forward kernels come first). Writes `$OUT/ncu-<cell>.ncu-rep` and
prints, per kernel: time, launch shape, how evenly the SMs were busy (cycles active
min / mean / max against the elapsed cycles), issue slots and tensor pipe busy,
eligible warps per scheduler, and the largest warp stall reasons (cycles per issued
instruction). Shapes as bench.run's standard cells (16k tokens a batch, 2048 / D heads).
"""

import argparse
import csv
import ctypes
import io
import os
import shutil
import subprocess
import sys

_CHILD = "BENCH_NCU_CHILD"
_SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "ComputeWorkloadAnalysis",
             "SchedulerStats", "WarpStateStats")
_METRICS = ("sm__cycles_active.min", "sm__cycles_active.avg", "sm__cycles_active.max",
            "sm__cycles_elapsed.max", "sm__inst_executed.sum")
# (column, raw metric name or a predicate over names, format) of the printed table.
_COLUMNS = (
    ("us", "gpu__time_duration.sum", lambda v: f"{v / 1e3:.1f}"),
    ("grid", "launch__grid_size", lambda v: f"{v:.0f}"),
    ("block", "launch__block_size", lambda v: f"{v:.0f}"),
    ("regs", "launch__registers_per_thread", lambda v: f"{v:.0f}"),
    ("smem KB", "launch__shared_mem_per_block_dynamic", lambda v: f"{v / 1024:.0f}"),
    ("inst M", "sm__inst_executed.sum", lambda v: f"{v / 1e6:.1f}"),
    ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active", lambda v: f"{v:.0f}"),
    ("tensor %", lambda n: "pipe_tensor" in n and n.endswith("pct_of_peak_sustained_active"),
     lambda v: f"{v:.0f}"),
    ("eligible", "smsp__warps_eligible.avg.per_cycle_active", lambda v: f"{v:.2f}"),
)
_STALL = "smsp__average_warps_issue_stalled_"
_STALL_END = "_per_issue_active.ratio"


def _profiled(fn):
    """fn() inside the profiler's range (ncu --profile-from-start off)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    try:
        return fn()
    finally:
        cuda.cuProfilerStop()


def _child(args):
    import jax
    import jax.numpy as jnp

    from bench.run import HIDDEN, TOKENS, cell_call

    d, s = args.hdim, args.seqlen
    causal = args.causal == "true"
    for backend in args.backends.split(","):
        call, inputs = cell_call(backend, TOKENS // s, s, HIDDEN // d, d, causal,
                                 jnp.bfloat16, args.pass_)
        call = jax.jit(call)
        for _ in range(3):
            jax.block_until_ready(call(*inputs))
        print(f"profiling {backend}", flush=True)
        _profiled(lambda: jax.block_until_ready(call(*inputs)))


def _value(row, key):
    """The metric `key` of a row, or the largest of those whose names `key` accepts
    (the tensor pipes: wgmma kernels busy the gmma one); None where absent."""
    names = [key] if isinstance(key, str) else [n for n in row if key(n)]
    values = []
    for name in names:
        try:
            values.append(float(row[name].replace(",", "")))
        except (KeyError, ValueError):
            continue
    return max(values, default=None)


def _table(report):
    """Rows of the report's raw page, one per kernel, as {metric: text}."""
    raw = subprocess.run(["ncu", "--import", report, "--page", "raw", "--csv",
                          "--print-units", "base"], check=True, capture_output=True,
                         text=True).stdout
    rows = list(csv.DictReader(io.StringIO(raw)))
    return rows[1:]  # the first row holds the units


def _print(rows):
    from bench.timing import short_name

    print("kernel".ljust(40) + "".join(c.rjust(9) for c, _, _ in _COLUMNS)
          + "   SM cycles active min/mean/max of elapsed")
    for row in rows:
        cells = []
        for _, key, fmt in _COLUMNS:
            v = _value(row, key)
            cells.append(("-" if v is None else fmt(v)).rjust(9))
        elapsed = _value(row, "sm__cycles_elapsed.max") or 1.0
        busy = "/".join(f"{(_value(row, f'sm__cycles_active.{a}') or 0) / elapsed:.2f}"
                        for a in ("min", "avg", "max"))
        print(short_name(row["Kernel Name"], 40).ljust(40) + "".join(cells) + "   " + busy)
        stalls = sorted(((v, n[len(_STALL):-len(_STALL_END)]) for n in row
                         if n.startswith(_STALL) and n.endswith(_STALL_END)
                         and "not_issued" not in n
                         and (v := _value(row, n)) is not None), reverse=True)
        print("    stalls (cycles per issued instruction): "
              + ", ".join(f"{name} {v:.2f}" for v, name in stalls[:6]))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdim", type=int, required=True)
    ap.add_argument("--seqlen", type=int, required=True)
    ap.add_argument("--causal", choices=("false", "true"), required=True)
    ap.add_argument("--pass", dest="pass_", default="fwd", choices=("fwd", "bwd", "bwd_det"))
    ap.add_argument("--backends", default="jax_fa4,jax_cudnn")
    args = ap.parse_args()
    if os.environ.get(_CHILD):
        return _child(args)
    if not shutil.which("ncu"):
        sys.exit("ncu (Nsight Compute) is not on PATH")
    out = os.environ.get("OUT", ".")
    cell = f"{args.pass_}-d{args.hdim}-s{args.seqlen}-{'causal' if args.causal == 'true' else 'full'}"
    report = os.path.join(out, f"ncu-{cell}")
    command = ["ncu", "--profile-from-start", "off", "--clock-control", "none", "-f",
               "-o", report, "--metrics", ",".join(_METRICS)]
    for section in _SECTIONS:
        command += ["--section", section]
    command += [sys.executable, "-m", "bench.ncu", *sys.argv[1:]]
    # Without JAX's preallocated pool, ncu saves and restores (between its replay
    # passes) only the memory in use: minutes less a cell.
    subprocess.run(command, check=True, env={**os.environ, _CHILD: "1",
                                             "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    print(f"\n{cell} ({report}.ncu-rep)")
    _print(_table(report + ".ncu-rep"))


if __name__ == "__main__":
    main()
