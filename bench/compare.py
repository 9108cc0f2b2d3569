"""New / old time per cell from bench/ab.sh's JSON lines (or any bench.run outputs).

    python -m bench.compare OUT base new        # reads OUT/{base,new}-{1,2}.jsonl

Prints, per cell, old ms and the speedup old / new of each repetition (> 1: new is
faster), then the range of speedups per head dim and mask.
"""

import argparse
import json
import pathlib

# A run may time several backends (jax_fa4_paged next to jax_fa4_lengths, say).
KEY = ("mode", "d", "causal", "s", "b", "h", "backend")


def _load(path: pathlib.Path) -> dict:
    cells = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        cells[tuple(r.get(k) for k in KEY)] = r["ms"]
    return cells


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
        groups = {}
        # The cells both builds measured (an old run may cover more than this one).
        for cell in sorted(reps[0][0].keys() & reps[0][1].keys(), key=str):
            ratios = [old[cell] / fresh[cell] for old, fresh in reps
                      if cell in old and cell in fresh]
            mode, d, causal, s, _, _, backend = cell
            mask = "causal" if causal else "full"
            name = "" if backend in (None, "jax_fa4") else f" {backend}"
            print(f"  {mode:7} d{d:<4} {mask:6} s{s:<6} "
                  f"{reps[0][0][cell]:8.4f} ms  " + "  ".join(f"{x:.3f}" for x in ratios)
                  + name)
            groups.setdefault((mode, d, mask + name), []).extend(ratios)
        for (mode, d, mask), ratios in groups.items():
            print(f"  {mode} d{d} {mask}: {min(ratios):.3f} - {max(ratios):.3f}")


if __name__ == "__main__":
    main()
