"""bench.context_parallel's device counts (the runs themselves need 2 or more GPUs)."""

import pytest


@pytest.fixture
def context_parallel(bench_module):
    return bench_module("context_parallel")


def test_device_counts_default_to_all_and_come_sorted(context_parallel):
    assert context_parallel._counts(None, 4) == [4]
    assert context_parallel._counts("4,2,2", 4) == [2, 4]


@pytest.mark.parametrize("text", ["1,2", "2,8"])
def test_device_counts_outside_two_to_local_are_refused(context_parallel, text):
    with pytest.raises(ValueError, match="--devices"):
        context_parallel._counts(text, 4)
