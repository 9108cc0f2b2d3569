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


def test_cudnn_steps_count_its_split_reduction(cold_decode):
    # cuDNN's split-KV decode runs its sdpa kernel and a reduction: both are the step.
    sdpa = "_ZN5cudnn6fusion4sdpa"
    reduction = "_ZN5cudnn6fusion21lean_reduction_kernel"
    run = [("input_reduce_fusion", 0.1), (sdpa, 0.0087), (reduction, 0.0028)] * 2
    assert cold_decode.step_times(run, 2) == [[0.0087, 0.0028]] * 2


@pytest.mark.parametrize("flush", ["clean", "dirty"])
def test_the_flush_runs_inside_every_step(cold_decode, flush):
    # A read of a loop-invariant buffer had been hoisted out of the loop by XLA: one
    # flush for all the steps. (Compiled here for the CPU; the GPU's loop-invariant
    # code motion is XLA's too.)
    import re

    import jax
    import jax.numpy as jnp

    def step(q, k, v):
        return q * k, k, v

    q = jnp.ones((8,), jnp.float32)
    run = cold_decode.flushed_loop(step, q, 5, flush)
    text = jax.jit(run).lower(jnp.ones((1 << 16,), jnp.float32), q, q).compile().as_text()
    computations = {block.split(" ", 1)[0].lstrip("%"): block
                    for block in text.split("\n\n") if block.startswith(("%", "ENTRY"))}
    body_name = re.search(r" while\(.*body=%([\w.\-]+)", text).group(1)
    body = computations[body_name]
    # The flush's pass over its 65536 values: a fusion taking the whole buffer, in
    # the loop's body (and not before the loop).
    passes = re.compile(r"= f32\[(?:65536)?\]\S* fusion\(")
    assert passes.search(body), body
    assert not passes.search(computations["ENTRY"]), computations["ENTRY"]
