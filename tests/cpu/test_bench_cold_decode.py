"""bench.cold_decode: argument checks before anything runs, and how a run's kernels
are summed per step (the timing itself needs a GPU)."""

import pytest


@pytest.fixture
def cold_decode(bench_module):
    return bench_module("cold_decode")


@pytest.mark.parametrize("argv, message", [
    (["--keys", "0"], "--keys must be >= 1"),
    (["--heads", "6", "--heads-kv", "4"], "--heads-kv must divide --heads"),
    (["--backends", "paged,flash"], "unknown backends flash"),
])
def test_bad_arguments_stop_before_running(argv, message, capsys, cold_decode):
    with pytest.raises(SystemExit):
        cold_decode.parse(argv)
    assert message in capsys.readouterr().err


def test_needs_a_gpu(cold_decode):
    import jax
    if jax.default_backend() == "gpu":
        pytest.skip("runs on CPU only")
    with pytest.raises(SystemExit, match="needs a GPU"):
        cold_decode.main([])


def test_steps_group_each_steps_attention_kernels(cold_decode):
    # Names as bench.timing.kernel_times shortens them.
    split = "kernel_kernelssm90fwdFwdSm90"
    combine = "kernel_kernelssm90combineSplitCombine"
    run = [("loop_add_fusion", 0.1), (split, 0.010), (combine, 0.002),
           ("input_reduce_fusion", 0.1), (split, 0.012), (combine, 0.003),
           ("input_reduce_fusion", 0.1), (split, 0.020), (combine, 0.002)]
    steps = cold_decode.step_times(run, 3)
    assert steps == [[0.010, 0.002], [0.012, 0.003], [0.020, 0.002]]
    assert cold_decode.summary(steps) == "   15.00 us a step (kernels 12.00 + 2.00)"
    cudnn = [("cudnn_generated_fort_native_sdpa_sm80_flash_fpro", 0.03)] * 3
    assert cold_decode.summary(cold_decode.step_times(cudnn, 3)) == "   30.00 us a step"
    with pytest.raises(RuntimeError, match="3 attention kernels in 2 steps"):
        cold_decode.step_times(cudnn, 2)
