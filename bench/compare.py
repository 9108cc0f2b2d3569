"""Speedup (old / new time) per cell from bench/ab.sh's JSON lines (or any bench.run
outputs).

    python -m bench.compare OUT base new        # reads OUT/{base,new}-{1,2}.jsonl

Prints, per cell, old ms and the speedup old / new of each repetition (> 1: new is
faster), then the range of speedups per head dim and mask. Records of the generation
example (`ab.sh --generate`) compare tokens/s per batch and model instead, and show
each run's paged / dense time. A cell that failed in a run (bench.run's "error"
records) is named with its error, and has no ratio from that run.
"""

import argparse
import json
import pathlib

# A run may time several backends (jax_fa4_paged next to jax_fa4_lengths, say).
KEY = ("mode", "d", "causal", "s", "b", "h", "backend")
# bench.run's optional fields (a record has those its run set): cells that differ in one
# are different cells, e.g. the same shape with and without a window appended to one file.
FEATURES = ("dtype", "kv_dtype", "h_kv", "window", "softcap", "documents", "sq",
            "page_size", "dv", "timing")
# Feature values a label leaves out: the runs' defaults.
DEFAULTS = {"dtype": "bfloat16", "timing": "cupti"}


def _cell(r: dict) -> tuple:
    """A record's cell: KEY's values, then (name, value) of each feature it has."""
    return (tuple(r.get(k) for k in KEY)
            + tuple((f, r[f]) for f in FEATURES if r.get(f) is not None))


def _features(cell: tuple) -> str:
    """The features of a cell as a label, e.g. " window=1024 dv=128" (dtype and timing
    only where they are not the runs' DEFAULTS)."""
    return "".join(f" {f}={v}" for f, v in cell[len(KEY):] if DEFAULTS.get(f) != v)


def _load(path: pathlib.Path) -> dict:
    cells = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("mode") == "error":
            cell = {**r, "mode": r.get("failed_mode")}
            print(f"  failed in {path.name}: " + " ".join(
                f"{k}={cell.get(k)}" for k in KEY) + _features(_cell(cell))
                + f": {r.get('err', '')}")
        elif "tokens_per_s" in r:  # examples/generate.py: seconds per token, a time
            for model, rate in r["tokens_per_s"].items():
                cells[("generate", r["config"]["batch"], model)] = 1 / rate
        else:
            cells[_cell(r)] = r["ms"]
    return cells


def _ratios(reps, cell) -> list[float]:
    """old / new time of `cell` in each repetition that measured it in both builds."""
    return [old[cell] / fresh[cell] for old, fresh in reps if cell in old and cell in fresh]


def _generation(reps, old_label, new_label):
    """The example's cells: tokens/s of old, old / new time per repetition, and each
    run's paged / dense time (the ratio the example prints)."""
    cells = sorted(k for k in reps[0][0].keys() & reps[0][1].keys() if k[0] == "generate")
    for cell in cells:
        _, batch, model = cell
        print(f"  batch {batch:<4} {model:22} {1 / reps[0][0][cell]:10.1f} tokens/s  "
              + "  ".join(f"{x:.3f}" for x in _ratios(reps, cell)))
    for side, label in enumerate((old_label, new_label)):
        for batch in sorted({batch for _, batch, _ in cells}):
            runs = [{model: t for (kind, b, model), t in rep[side].items()
                     if (kind, b) == ("generate", batch)} for rep in reps]
            print(f"  {label} batch {batch}: paged / dense time " + "  ".join(
                f"{_paged_over_dense(run):.3f}" for run in runs if len(run) == 2))


def _paged_over_dense(times: dict) -> float:
    paged = next(t for name, t in times.items() if "paged" in name)
    dense = next(t for name, t in times.items() if "dense" in name)
    return paged / dense


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("old")
    ap.add_argument("new", nargs="+")
    args = ap.parse_args(argv)
    folder = pathlib.Path(args.folder)
    for new in args.new:
        reps = [(_load(folder / f"{args.old}-{r}.jsonl"), _load(folder / f"{new}-{r}.jsonl"))
                for r in (1, 2)]
        print(f"{new} vs {args.old} (speedup old / new per repetition)")
        _generation(reps, args.old, new)
        groups = {}
        # The cells both builds measured (an old run may cover more than this one).
        for cell in sorted(reps[0][0].keys() & reps[0][1].keys(), key=str):
            if cell[0] == "generate":
                continue
            ratios = _ratios(reps, cell)
            mode, d, causal, s, _, _, backend = cell[:len(KEY)]
            mask = "causal" if causal else "full"
            name = ("" if backend in (None, "jax_fa4") else f" {backend}") + _features(cell)
            print(f"  {mode:7} d{d:<4} {mask:6} s{s:<6} "
                  f"{reps[0][0][cell]:8.4f} ms  " + "  ".join(f"{x:.3f}" for x in ratios)
                  + name)
            groups.setdefault((mode, d, mask + name), []).extend(ratios)
        for (mode, d, mask), ratios in groups.items():
            print(f"  {mode} d{d} {mask}: {min(ratios):.3f} - {max(ratios):.3f}")


if __name__ == "__main__":
    main()
