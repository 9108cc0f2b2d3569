"""bench.ncu: the table it prints from Nsight Compute's raw page (ncu itself needs a
GPU)."""

import subprocess

import pytest

RAW = (
    '"ID","Kernel Name","gpu__time_duration.sum","launch__grid_size",'
    '"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",'
    '"sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",'
    '"sm__cycles_active.min","sm__cycles_active.avg","sm__cycles_active.max",'
    '"sm__cycles_elapsed.max",'
    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_not_issued_per_issue_active.ratio"\n'
    '"","","ns","","%","%","cycle","cycle","cycle","cycle","","",""\n'
    '"0","kernel_cutlass_kernel_kernelssm90fwdFwdSm90_object_at__x","100,900","132",'
    '"0","47.5","90","96","97","100","0.85","1.25","9.1"\n'
)


@pytest.fixture
def ncu(bench_module, monkeypatch):
    module = bench_module("ncu")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout=RAW))
    return module


def test_table_skips_the_units_row(ncu):
    rows = ncu._table("report.ncu-rep")
    assert len(rows) == 1 and rows[0]["launch__grid_size"] == "132"


def test_printed_row(ncu, capsys):
    ncu._print(ncu._table("report.ncu-rep"))
    lines = capsys.readouterr().out.splitlines()
    kernel = lines[1].split()
    # time in us, grid, the busiest tensor pipe (gmma, not the idle hmma), SM balance
    assert kernel[0] == "kernel_kernelssm90fwdFwdSm90"
    assert kernel[1:3] == ["100.9", "132"]
    assert "48" in kernel and kernel[-1] == "0.90/0.96/0.97"
    # stall reasons largest first, without the not-issued total
    assert lines[2].endswith("long_scoreboard 1.25, barrier 0.85")
