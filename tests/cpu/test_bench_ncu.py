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


SOURCE = (
    '"Kernel Name","kernel_cutlass_kernel_kernelssm90bwdBwdSm90_object_at__x",\n'
    '"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier",'
    '"stall_long_sb","stall_long_sb (Not Issued)"\n'
    '"0x7f00","      MEMBAR.ALL.CTA","10","0","10","10"\n'
    '"0x7f10","      FENCE.VIEW.ASYNC.S","20","0","15","15"\n'
    '"0x7f20","@!P0  BAR.ARV R3, 0xa0","60","0","60","60"\n'
    '"0x7f30","      BAR.SYNC.DEFER_BLOCKING R4, 0xa0","10","10","0","0"\n'
    '"0x7f40","      EXIT","0","0","0","0"\n'
    '"Kernel Name","kernel_cutlass_kernel_kernelssm90bwdBwdSm90_object_at__y",\n'
    '"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier"\n'
    '"0x100","      EXIT","0","0"\n'
)


def test_source_page_splits_per_kernel(ncu):
    blocks = ncu._source_blocks(SOURCE)
    assert [len(rows) for _, rows in blocks] == [5, 1]
    assert blocks[0][1][2]["Source"].strip() == "@!P0  BAR.ARV R3, 0xa0"


def test_printed_source_lines(ncu, capsys):
    ncu._print_source(ncu._source_blocks(SOURCE), top=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith("100 warp samples over 5 SASS instructions")
    # opcodes without their predicate guard, largest share first
    assert lines[2] == ("  by opcode: BAR.ARV 60.0%, FENCE.VIEW.ASYNC.S 20.0%, "
                        "MEMBAR.ALL.CTA 10.0%, BAR.SYNC.DEFER_BLOCKING 10.0%, EXIT 0.0%")
    # the two busiest instructions: offset from the kernel's first, reasons, predecessor
    top = lines[4:6]
    assert top[0].split()[:3] == ["60.00%", "20", "@!P0"]
    assert "(long_sb 100%)" in top[0] and top[0].endswith("| FENCE.VIEW.ASYNC.S")
    assert top[1].split()[:3] == ["20.00%", "10", "FENCE.VIEW.ASYNC.S"]
    assert "(long_sb 75%)" in top[1]
    # then the next kernel, which has no samples
    assert lines[6:] == ["", "kernel_kernelssm90bwdBwdSm90: no warp samples"]


@pytest.mark.parametrize("argv,message", [
    # cuDNN has no deterministic backward: the child had raised a TypeError under ncu
    (["--pass", "bwd_det"], "--pass bwd_det takes the backends with a deterministic"),
    (["--backends", "jax_fa4,flash"], "unknown backends flash"),
])
def test_bad_arguments_stop_before_ncu(ncu, monkeypatch, capsys, argv, message):
    monkeypatch.setattr("sys.argv", ["bench.ncu", "--hdim", "128", "--seqlen", "2048",
                                     "--causal", "false", *argv])
    with pytest.raises(SystemExit):
        ncu.main()
    assert message in capsys.readouterr().err
