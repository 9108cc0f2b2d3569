"""bench.fa4_peer: the kernel time it reads from torch.profiler's trace (per call of a
back-to-back run), and argument checks before torch or FA4 are imported (the timing
itself needs a GPU and FA4)."""

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


def _kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_back_to_back_calls_split_by_start_order(fa4_peer):
    # The export need not list events in start order; a memset between calls is not
    # a kernel and does not shift the split.
    trace = {"traceEvents": [
        _kernel("bwd", 300.0, 40.0), _kernel("fwd", 0.0, 10.0), _kernel("bwd", 20.0, 30.0),
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 100.0, "dur": 5.0},
        _kernel("fwd", 200.0, 12.0),
    ]}
    assert fa4_peer.per_call_ms(trace, 2) == pytest.approx([0.040, 0.052])


@pytest.mark.parametrize("events,message", [
    ([_kernel("fwd", 0.0, 1.0), _kernel("bwd", 5.0, 1.0), _kernel("fwd", 9.0, 1.0)],
     "3 GPU kernels recorded over 2 calls"),
    ([], "0 GPU kernels recorded over 2 calls"),
    ([_kernel("fwd", 0.0, 1.0), _kernel("bwd", 5.0, 1.0), _kernel("bwd", 9.0, 1.0),
      _kernel("fwd", 12.0, 1.0)], "the calls launched different kernels"),
])
def test_calls_that_differ_are_refused(fa4_peer, events, message):
    with pytest.raises(RuntimeError, match=message):
        fa4_peer.per_call_ms({"traceEvents": events}, 2)


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
