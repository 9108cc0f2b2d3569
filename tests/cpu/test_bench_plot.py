"""bench.plot: which JSON lines are standard cells, which value a cell keeps, and that
both plots are written."""

import json

import pytest


@pytest.fixture
def plot(bench_module):
    return bench_module("plot")


def _line(**fields):
    base = dict(backend="jax_fa4", dtype="bfloat16", b=8, s=2048, h=16, d=128,
                causal=False, mode="fwd", tflops=600.0, date="2026-11-24")
    return json.dumps({**base, **fields})


def test_standard_cells_and_the_last_file_wins(plot, tmp_path):
    older, newer = tmp_path / "2026-11-22-h100.jsonl", tmp_path / "2026-11-24-h100.jsonl"
    older.write_text("\n".join([
        _line(tflops=500.0, date="2026-11-22"),
        _line(backend="jax_cudnn", causal=True, tflops=550.0, date="2026-11-22"),
    ]))
    newer.write_text("\n".join([
        _line(),
        _line(h_kv=8, tflops=1.0),  # GQA: not a standard cell
        _line(window=1024, tflops=2.0),
        _line(b=1, tflops=3.0),  # not 16k tokens per batch
        _line(dtype="float16", tflops=4.0),
        _line(mode="error", err="RuntimeError()"),
        _line(mode="bwd_det", d=64, h=32, tflops=390.0),
    ]))
    cells = plot.standard_cells([newer, older])  # sorted by name inside
    assert cells == {
        ("jax_fa4", "fwd", 128, False, 2048): (600.0, "2026-11-24"),
        ("jax_cudnn", "fwd", 128, True, 2048): (550.0, "2026-11-22"),
        ("jax_fa4", "bwd_det", 64, False, 2048): (390.0, "2026-11-24"),
    }


def test_draws_both_passes(plot, tmp_path):
    cells = {("jax_fa4", mode, d, causal, s): (100.0 + s / 100, "2026-11-24")
             for mode in ("fwd", "bwd", "bwd_det") for d in (64, 128)
             for causal in (False, True) for s in (512, 2048)}
    written = plot.draw(cells, tmp_path / "plots")
    assert [p.name for p in written] == ["forward.png", "backward.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_tables_show_each_backend_and_bold_only_a_5_percent_lead(plot):
    cells = {("jax_fa4", "fwd", 128, False, 2048): (630.0, ""),
             ("jax_cudnn", "fwd", 128, False, 2048): (600.0, ""),
             ("fa4_cute", "fwd", 128, False, 2048): (500.0, ""),
             ("jax_fa4", "bwd", 128, False, 2048): (500.0, ""),
             ("jax_fa4", "bwd_det", 128, False, 2048): (450.0, ""),
             ("jax_cudnn", "bwd", 128, False, 2048): (480.0, "")}
    text = plot.tables(cells)
    assert "| 128 | 630 / 600 / 500 (**1.05**) |" in text
    assert "| 128 | 500 / 450 / 480 / - (1.04) |" in text  # no FA4 cell: its column says -
    assert "| 128 causal | - / - / - (-) |" in text
    # A lead that rounds to 1.05 without reaching it had been bold.
    cells[("jax_fa4", "fwd", 128, False, 2048)] = (628.0, "")
    assert "| 128 | 628 / 600 / 500 (1.047) |" in plot.tables(cells)


def test_a_cell_the_latest_run_failed_keeps_no_older_value(plot, tmp_path):
    older, newer = tmp_path / "2026-11-22-h100.jsonl", tmp_path / "2026-11-24-h100.jsonl"
    older.write_text("\n".join([_line(tflops=500.0), _line(causal=True, tflops=400.0)]))
    newer.write_text("\n".join([
        json.dumps({**json.loads(_line(mode="error")), "failed_mode": "fwd",
                    "err": "RuntimeError()"}),
        _line(causal=True, tflops=900.0, timing="wall"),  # not GPU time: left out
    ]))
    assert plot.standard_cells([older, newer]) == {
        ("jax_fa4", "fwd", 128, True, 2048): (400.0, "2026-11-24")}


def test_fp8_table_holds_e4m3_against_the_faster_bf16(plot, tmp_path):
    run = tmp_path / "2026-11-27-h100.jsonl"
    run.write_text("\n".join([
        _line(backend="jax_fa4_fp8", dtype="float8_e4m3fn", s=16384, b=1, tflops=900.0),
        _line(s=16384, b=1, tflops=700.0),
        _line(backend="jax_cudnn", s=16384, b=1, tflops=720.0),
        _line(backend="jax_fa4_fp8", dtype="float8_e4m3fn", s=16384, b=1, causal=True,
              mode="error", err="x"),
    ]))
    lines = plot.fp8_table([run]).splitlines()
    assert lines[2] == "| head_dim, mask | 16384 |"
    assert lines[4] == "| 128 | 900 / 700 / 720 (1.25) |"
    assert lines[5] == "| 128 causal | - / - / - (-) |"


def test_kv8_table_holds_float8_kv_against_bf16(plot, tmp_path):
    run = tmp_path / "2026-11-27-h100.jsonl"
    decode = dict(s=131072, b=1, h=32, h_kv=8, d=128, sq=1)
    run.write_text("\n".join([
        _line(**decode, ms=0.2), _line(backend="jax_fa4_kv8", **decode, ms=0.1),
        _line(backend="jax_fa4_paged", **decode, ms=0.25),
        _line(backend="jax_cudnn", **decode, ms=0.21),
        _line(s=16384, b=1, ms=1.0),  # not a decode step: left out
    ]))
    lines = plot.kv8_table([run]).splitlines()
    # K/V of the float8 call: 2 * 1 * 131072 * 8 * 128 bytes in 0.1 ms.
    assert lines[4] == ("| 1, 128k | 0.2000 / 0.1000 (2.00x) | - | 0.2100 | 2.68 TB/s |")
    assert len(lines) == 5


def test_readme_shows_the_tables_the_committed_results_make(plot):
    """README's standard, float8 and float8-KV tables are bench.plot's, line for line,
    from bench/results (its head_dim 256 backward rows had stayed those of an earlier
    run in the same file)."""
    results = plot.RESULTS
    readme = (results.parents[1] / "README.md").read_text()
    expected = [plot.tables(plot.standard_cells(sorted(results.glob("*.jsonl")))),
                plot.fp8_table(sorted((results / "fp8").glob("*.jsonl"))),
                plot.kv8_table(sorted((results / "kv8").glob("*.jsonl")))]
    for text in expected:
        for line in text.splitlines():
            if line.startswith("| "):
                assert line in readme, line


def test_cold_l2_lines_are_not_standard_cells_and_devices_are_named(plot, tmp_path):
    path = tmp_path / "2026-12-03-h200.jsonl"
    device = "NVIDIA H200"
    path.write_text("\n".join([_line(timing="cupti", device=device),
                               _line(timing="cupti-cold", tflops=580.0, device=device)]))
    assert plot.standard_cells([path]) == {
        ("jax_fa4", "fwd", 128, False, 2048): (600.0, "2026-11-24")}
    assert plot.devices([path]) == ["H200"]
