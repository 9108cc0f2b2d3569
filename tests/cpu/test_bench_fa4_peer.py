"""bench.fa4_peer: the kernel time it reads from torch.profiler's trace, and argument
checks before torch or FA4 are imported (the timing itself needs a GPU and FA4)."""

import pytest


@pytest.fixture
def fa4_peer(bench_module):
    return bench_module("fa4_peer")


def test_kernel_time_counts_kernels_only(fa4_peer):
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "flash_fwd", "dur": 120.0},
        {"ph": "X", "cat": "kernel", "name": "flash_bwd", "dur": 380.5},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "dur": 4.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 9.0},
        {"ph": "i", "cat": "kernel", "name": "marker"},
    ]}
    assert fa4_peer.kernel_ms(trace) == pytest.approx(0.5005)


@pytest.mark.parametrize("argv,message", [
    (["--causal", "yes"], "--causal takes false, true"),
    (["--hdims", "96"], "head dims must divide 2048"),
    (["--seqlens", "2k"], "comma-separated integers"),
    (["--iterations", "0"], "--iterations must be >= 1"),
])
def test_bad_arguments_stop_before_anything_runs(fa4_peer, capsys, argv, message):
    with pytest.raises(SystemExit):
        fa4_peer.main(argv)
    assert message in capsys.readouterr().err
