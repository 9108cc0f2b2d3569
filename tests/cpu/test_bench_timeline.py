"""bench/timeline.py's bookkeeping: kernels sorted by kind, intervals merged and
intersected (the trace itself needs a GPU)."""

import pytest


@pytest.fixture
def timeline(bench_module):
    return bench_module("timeline")


def test_kernels_are_sorted_into_attention_nccl_and_other(timeline):
    assert timeline._kind("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "nccl"
    assert timeline._kind("kernel_cutlass_kernel_kernelssm90fwdFwdSm90_object_at_") == (
        "attention")
    assert timeline._kind("loop_select_fusion_4") == "other"


def test_overlapping_intervals_count_once(timeline):
    merged = timeline._union([(10, 12), (0, 5), (3, 8), (12, 13)])
    assert merged == [[0, 8], [10, 13]]
    assert timeline._length(merged) == 11


def test_overlap_is_the_time_both_run(timeline):
    nccl = [[0, 8], [10, 12]]
    attention = [[4, 11], [20, 30]]
    assert timeline._overlap(nccl, attention) == 5  # 4..8 and 10..11
    assert timeline._overlap(nccl, [[30, 40]]) == 0
