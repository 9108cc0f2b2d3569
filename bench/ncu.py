r"""One cell's kernels under Nsight Compute, jax_fa4 next to its peers, in one report.

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

    python -m bench.ncu --hdim 128 --seqlen 8192 --causal false --pass bwd \
        --backends jax_fa4 --source kernelssm90bwd

With --source REGEX, only the kernels whose names match REGEX are profiled, with warp
state sampling per SASS instruction, and for each the printout adds where its warps
wait: the share of all samples by opcode, and the instructions holding the most
samples (`--top`, default 30) with their stall reasons and the instruction before
each (a warp is sampled on the instruction it waits to issue). The report keeps the
full source view: `ncu -i REPORT --page source --print-source sass`.
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
# The source page's columns (ncu --page source --csv): every warp sample on a SASS
# instruction, and per stall reason (stall_*; the "(Not Issued)" ones are a subset).
_SAMPLES = "Warp Stall Sampling (All Samples)"
_SOURCE_SECTIONS = ("SourceCounters", "WarpStateStats")


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

    from bench.flops import HIDDEN, TOKENS
    from bench.run import cell_call

    d, s = args.hdim, args.seqlen
    causal = args.causal == "true"
    for backend in args.backends.split(","):
        # bench.run's standard cell: 16k tokens a batch, at least one sequence
        call, inputs = cell_call(backend, max(1, TOKENS // s), s, HIDDEN // d, d, causal,
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


def _source_blocks(text):
    """Nsight Compute's source page as CSV (one block per kernel: a "Kernel Name" row,
    then the column names, then a row per SASS instruction) -> [(kernel, rows as
    {column: text})]."""
    blocks = []
    lines = list(csv.reader(io.StringIO(text)))
    i = 0
    while i < len(lines):
        if lines[i] and lines[i][0] == "Kernel Name":
            kernel, header, rows = lines[i][1], lines[i + 1], []
            i += 2
            while i < len(lines) and lines[i] and lines[i][0] != "Kernel Name":
                rows.append(dict(zip(header, lines[i])))
                i += 1
            blocks.append((kernel, rows))
        else:
            i += 1
    return blocks


def _count(row, column):
    try:
        return float(row.get(column, "").replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(instruction):
    """SASS opcode with its modifiers, without a predicate guard (@P0, @!UP1)."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def _print_source(blocks, top):
    from bench.timing import short_name

    for kernel, rows in blocks:
        total = sum(_count(r, _SAMPLES) for r in rows)
        if not rows or total == 0:
            print(f"\n{short_name(kernel, 60)}: no warp samples")
            continue
        reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
        base = int(rows[0]["Address"], 16)
        print(f"\n{short_name(kernel, 60)}: {total:.0f} warp samples over {len(rows)} "
              "SASS instructions")
        by_op = {}
        for r in rows:
            op = _opcode(r["Source"])
            by_op[op] = by_op.get(op, 0.0) + _count(r, _SAMPLES)
        ops = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
        print("  by opcode: " + ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in ops))
        print("  share  offset  instruction (stall reasons: share of its samples) | before it")
        order = sorted(range(len(rows)), key=lambda i: -_count(rows[i], _SAMPLES))
        for i in order[:top]:
            r = rows[i]
            n = _count(r, _SAMPLES)
            if n == 0:
                break
            why = sorted(((_count(r, c), c[len("stall_"):]) for c in reasons), reverse=True)
            why = " ".join(f"{name} {100 * v / n:.0f}%" for v, name in why[:2] if v > 0)
            before = rows[i - 1]["Source"].strip() if i else ""
            print(f"  {100 * n / total:5.2f}%  {int(r['Address'], 16) - base:6x}  "
                  f"{r['Source'].strip()[:56]:56s} ({why}) | {before[:40]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdim", type=int, required=True)
    ap.add_argument("--seqlen", type=int, required=True)
    ap.add_argument("--causal", choices=("false", "true"), required=True)
    ap.add_argument("--pass", dest="pass_", default="fwd", choices=("fwd", "bwd", "bwd_det"))
    ap.add_argument("--backends", default="jax_fa4,jax_cudnn")
    ap.add_argument("--source", metavar="REGEX",
                    help="profile only these kernels, with per-instruction warp samples")
    ap.add_argument("--top", type=int, default=30,
                    help="with --source: instructions listed per kernel")
    args = ap.parse_args()
    from bench.backends import BACKENDS, DETERMINISTIC

    backends = args.backends.split(",")
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        ap.error(f"unknown backends {', '.join(unknown)}; known: {', '.join(BACKENDS)}")
    if args.pass_ == "bwd_det" and set(backends) - set(DETERMINISTIC):
        ap.error(f"--pass bwd_det takes the backends with a deterministic backward: "
                 f"{', '.join(DETERMINISTIC)}")
    if args.hdim < 1 or args.seqlen < 1:
        ap.error("--hdim and --seqlen must be >= 1")
    if os.environ.get(_CHILD):
        return _child(args)
    if not shutil.which("ncu"):
        sys.exit("ncu (Nsight Compute) is not on PATH")
    out = os.environ.get("OUT", ".")
    cell = f"{args.pass_}-d{args.hdim}-s{args.seqlen}-{'causal' if args.causal == 'true' else 'full'}"
    report = os.path.join(out, f"ncu-{cell}")
    command = ["ncu", "--profile-from-start", "off", "--clock-control", "none", "-f",
               "-o", report, "--metrics", ",".join(_METRICS)]
    for section in _SECTIONS + (_SOURCE_SECTIONS if args.source else ()):
        command += ["--section", section]
    if args.source:
        command += ["-k", f"regex:{args.source}", "--import-source", "no"]
    command += [sys.executable, "-m", "bench.ncu", *sys.argv[1:]]
    # Without JAX's preallocated pool, ncu saves and restores (between its replay
    # passes) only the memory in use: minutes less a cell.
    subprocess.run(command, check=True, env={**os.environ, _CHILD: "1",
                                             "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    print(f"\n{cell} ({report}.ncu-rep)")
    _print(_table(report + ".ncu-rep"))
    if args.source:
        page = subprocess.run(["ncu", "--import", report + ".ncu-rep", "--page", "source",
                               "--csv", "--print-source", "sass"], check=True,
                              capture_output=True, text=True).stdout
        _print_source(_source_blocks(page), args.top)


if __name__ == "__main__":
    main()
