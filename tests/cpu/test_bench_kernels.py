"""bench.run --kernels: how a call's kernels are named and printed (the CUPTI
measurement itself needs a GPU)."""

import pytest


@pytest.fixture
def bench(bench_module):
    return bench_module("run"), bench_module("timing")


@pytest.mark.parametrize("name, short", [
    ("kernel_cutlass_kernel_kernelssm90fwdFwdSm90_object_at__CopyAtom_ThrID10_TVLayout",
     "kernel_kernelssm90fwdFwdSm90"),
    ("kernel_cutlass_postprocess_kernelssm90bwdBwdSm90_object_at__Tensor",
     "postprocess_kernelssm90bwdBwdSm90"),
    ("loop_reduce_fusion", "loop_reduce_fusion"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1",
     "cudnn_generated_fort_native_sdpa_sm90_flash_fpro"),
])
def test_short_names_keep_what_tells_kernels_apart(bench, name, short):
    assert bench[1].short_name(name) == short


def test_kernel_line_totals_in_microseconds_in_launch_order(bench):
    line = bench[0].kernel_line("jax_fa4", [("loop_transpose_fusion", 0.0011),
                                   ("kernel_kernelssm90fwdFwdSm90", 0.0104),
                                   ("loop_reduce_fusion", 0.0018)])
    assert line == ("#   jax_fa4: 13.3 us = loop_transpose_fusion 1.1; "
                    "kernel_kernelssm90fwdFwdSm90 10.4; loop_reduce_fusion 1.8")


@pytest.mark.parametrize("iterations", [1, 3])
def test_kernel_times_takes_each_kernels_median(bench, monkeypatch, iterations):
    """kernel_times reads the profiler's per-call lists (one list, not a list of them,
    for one iteration), here a stand-in for CUPTI's."""
    from jax.experimental.mosaic.gpu import profiler

    timing = bench[1]
    calls = [[("kernel_cutlass_kernel_kernelssm90fwdFwdSm90_object_at__x", t),
              ("loop_reduce_fusion", 0.002)] for t in (0.010, 0.012, 0.011)][:iterations]

    def fake_measure(fn, *, aggregate, iterations):
        assert not aggregate and iterations == len(calls)
        return lambda *args: (fn(*args), calls[0] if iterations == 1 else calls)

    monkeypatch.setattr(profiler, "measure", fake_measure)
    times = timing.kernel_times(lambda x: x + 1, 1.0, iterations=iterations)
    assert times == [("kernel_kernelssm90fwdFwdSm90", 0.010 if iterations == 1 else 0.011),
                     ("loop_reduce_fusion", 0.002)]


def test_documents_must_divide_every_sequence_length(bench, monkeypatch, capsys):
    """Uneven documents would be a different problem on each backend and in the FLOP
    count: refused before anything runs."""
    monkeypatch.setattr("sys.argv", ["bench.run", "--documents", "3", "--seqlens",
                                     "2048,4096", "--backends", "jax_fa4"])
    with pytest.raises(SystemExit):
        bench[0].main()
    assert "divides every --seqlens" in capsys.readouterr().err


def test_cold_timing_keeps_the_calls_own_kernels(bench, monkeypatch):
    """--flush-l2: of the flushed call's kernels, those of the call alone (by name, from
    the end: the 256 MB read runs first and may share a name with one of them) are
    summed; the read's are left out."""
    timing = bench[1]
    runs = iter([
        [("loop_reduce_fusion", 0.002), ("kernel_kernelssm90fwdFwdSm90", 0.1)],  # alone
        [("loop_reduce_fusion", 0.05), ("loop_reduce_fusion", 0.003),
         ("kernel_kernelssm90fwdFwdSm90", 0.1)],
    ])
    monkeypatch.setattr(timing, "kernel_times", lambda fn, *args, iterations: next(runs))
    assert timing.cold_cupti_ms(lambda q: q, 1.0, iterations=5) == pytest.approx(0.103)


def test_cold_timing_refuses_a_call_it_cannot_find(bench, monkeypatch):
    timing = bench[1]
    runs = iter([[("kernel_kernelssm90fwdFwdSm90", 0.1)], [("input_reduce_fusion", 0.05)]])
    monkeypatch.setattr(timing, "kernel_times", lambda fn, *args, iterations: next(runs))
    with pytest.raises(RuntimeError, match="not found"):
        timing.cold_cupti_ms(lambda q: q, 1.0, iterations=5)


@pytest.mark.parametrize("iterations", [1, 3])
def test_cupti_median_of_one_or_more_iterations(bench, monkeypatch, iterations):
    # The profiler gives one float for one iteration: the median of it had raised.
    from jax.experimental.mosaic.gpu import profiler

    times = [0.5, 0.7, 0.6][:iterations]
    monkeypatch.setattr(profiler, "measure", lambda fn, *, iterations: lambda *args: (
        fn(*args), times[0] if iterations == 1 else times))
    assert bench[1]._cupti_ms(lambda x: x, 1.0, iterations=iterations) == (
        0.5 if iterations == 1 else 0.6)


def test_flops_of_each_pass(bench_module):
    flops = bench_module("flops")
    fwd = flops.attention_flops(1, 1, 8, 8, 64, True, "fwd")
    assert fwd == 2 * 32 * 128
    # the deterministic backward does the backward's work (it had counted as a forward)
    assert flops.attention_flops(1, 1, 8, 8, 64, True, "bwd_det") == 2.5 * fwd
    with pytest.raises(ValueError, match="mode"):
        flops.attention_flops(1, 1, 8, 8, 64, True, "backward")
    with pytest.raises(ValueError, match="causal sliding window"):
        flops.visible_pairs(8, 8, False, window_left=2)


def test_the_anchor_is_a_peer_on_an_h100_only(bench, capsys):
    run = bench[0]
    row = {"jax_fa4": {"ms": 1.0, "tflops": 500.0}, "jax_cudnn": {"ms": 1.2, "tflops": 400.0}}
    anchors = {(64, 2048, False, "bwd"): 520.0}
    for mode, is_peer, ratio in (("bwd", True, "0.96"), ("bwd", False, "1.25"),
                                 ("bwd_det", True, "0.96")):
        run.print_row(row, row, ["jax_fa4", "jax_cudnn"], anchors, mode, 64, False, 2048,
                      is_peer)
        assert capsys.readouterr().out.split(" | ")[-2:] == [ratio, "520 |\n"]


def test_no_gpu_is_refused_before_anything_runs(bench, monkeypatch, capsys):
    # Without a GPU every jax_fa4 cell had failed into the JSON file only, the table
    # showing "-", and the run had gone on through the whole matrix.
    monkeypatch.setattr("sys.argv", ["bench.run", "--hdims", "64", "--seqlens", "128"])
    with pytest.raises(SystemExit):
        bench[0].main()
    assert "JAX sees no GPU" in capsys.readouterr().err
