"""bench.compare: old / new per cell over both repetitions of bench/ab.sh."""

import json


def _write(path, ms):
    cells = [{"mode": "fwd", "d": 64, "causal": c, "s": 2048, "b": 8, "h": 32, "ms": m}
             for c, m in zip((False, True), ms)]
    path.write_text("".join(json.dumps(r) + "\n" for r in cells))


def test_speedups_per_cell_and_group(tmp_path, capsys, bench_module):
    compare = bench_module("compare")
    _write(tmp_path / "base-1.jsonl", (1.0, 2.0))
    _write(tmp_path / "base-2.jsonl", (1.0, 2.0))
    _write(tmp_path / "new-1.jsonl", (0.5, 2.5))
    _write(tmp_path / "new-2.jsonl", (0.8, 2.0))
    compare.main([str(tmp_path), "base", "new"])
    out = capsys.readouterr().out
    assert "fwd d64 full: 1.250 - 2.000" in out
    assert "fwd d64 causal: 0.800 - 1.000" in out


def test_only_the_cells_both_builds_measured(tmp_path, capsys, bench_module):
    # The old build's file may hold more cells (an earlier run appended to it).
    compare = bench_module("compare")
    for rep in (1, 2):
        _write(tmp_path / f"base-{rep}.jsonl", (1.0, 2.0))
        cell = {"mode": "fwd", "d": 64, "causal": False, "s": 2048, "b": 8, "h": 32, "ms": 0.5}
        (tmp_path / f"new-{rep}.jsonl").write_text(json.dumps(cell) + "\n")
    compare.main([str(tmp_path), "base", "new"])
    out = capsys.readouterr().out
    assert "fwd d64 full: 2.000 - 2.000" in out
    assert "causal" not in out


def _write_both_builds(path, cells_of):
    """base-{1,2}.jsonl and new-{1,2}.jsonl: the records cells_of(label) in each rep."""
    for label in ("base", "new"):
        for rep in (1, 2):
            (path / f"{label}-{rep}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in cells_of(label)))


def test_backends_of_one_run_stay_apart(tmp_path, capsys, bench_module):
    # A paged run times jax_fa4_paged next to its dense baseline, jax_fa4_lengths.
    compare = bench_module("compare")
    paged_ms = {"base": 2.0, "new": 1.0}
    _write_both_builds(tmp_path, lambda label: [
        {"mode": "fwd", "d": 128, "causal": False, "s": 8192, "b": 1, "h": 32,
         "backend": backend, "ms": ms}
        for backend, ms in (("jax_fa4_paged", paged_ms[label]), ("jax_fa4_lengths", 1.0))])
    compare.main([str(tmp_path), "base", "new"])
    out = capsys.readouterr().out
    assert "fwd d128 full jax_fa4_paged: 2.000 - 2.000" in out
    assert "fwd d128 full jax_fa4_lengths: 1.000 - 1.000" in out


def test_generation_records(tmp_path, capsys, bench_module):
    # ab.sh --generate: examples/generate.py's records, tokens/s per batch and model.
    compare = bench_module("compare")
    for label, paged in (("base", 100.0), ("new", 125.0)):
        for rep in (1, 2):
            record = {"config": {"batch": 32}, "device": "H100", "agree": 0.8,
                      "tokens_per_s": {"jax_fa4 paged": paged, "jax.nn cudnn dense": 110.0}}
            (tmp_path / f"{label}-{rep}.jsonl").write_text(json.dumps(record) + "\n")
    compare.main([str(tmp_path), "base", "new"])
    out = capsys.readouterr().out
    assert "jax_fa4 paged" in out and "100.0 tokens/s  1.250  1.250" in out
    assert "110.0 tokens/s  1.000  1.000" in out
    assert "base batch 32: paged / dense time 1.100  1.100" in out
    assert "new batch 32: paged / dense time 0.880  0.880" in out


def test_a_failed_cell_is_named_not_a_crash(tmp_path, capsys, bench_module):
    """bench.run writes a cell that failed as a "mode": "error" record without "ms"
    (compare had raised KeyError on it)."""
    compare = bench_module("compare")
    for name in ("base-1", "base-2", "new-1"):
        _write(tmp_path / f"{name}.jsonl", (1.0, 2.0))
    failed = {"mode": "error", "failed_mode": "fwd", "d": 64, "causal": True, "s": 2048,
              "b": 8, "h": 32, "err": "RuntimeError('boom')"}
    _write(tmp_path / "new-2.jsonl", (0.5,))
    with open(tmp_path / "new-2.jsonl", "a") as f:
        f.write(json.dumps(failed) + "\n")
    compare.main([str(tmp_path), "base", "new"])
    out = capsys.readouterr().out
    assert "failed in new-2.jsonl: mode=fwd d=64 causal=True" in out and "boom" in out
    assert "fwd d64 causal: 1.000 - 1.000" in out  # the run that measured it
    assert "fwd d64 full: 1.000 - 2.000" in out


def test_feature_fields_keep_cells_apart(tmp_path, capsys, bench_module):
    """One file may hold a shape with and without a window (runs appended to it); the key
    had only the shape's fields, so one cell's time overwrote the other's."""
    compare = bench_module("compare")
    shape = {"mode": "fwd", "d": 128, "causal": True, "s": 8192, "b": 2, "h": 16,
             "dtype": "bfloat16"}
    windowed_ms = {"base": 1.0, "new": 0.5}
    _write_both_builds(tmp_path, lambda label: [
        {**shape, "ms": 2.0}, {**shape, "window": 1024, "ms": windowed_ms[label]}])
    compare.main([str(tmp_path), "base", "new"])
    out = capsys.readouterr().out
    assert "fwd d128 causal: 1.000 - 1.000" in out
    assert "fwd d128 causal window=1024: 2.000 - 2.000" in out
