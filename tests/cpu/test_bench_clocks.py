"""bench.clocks: the summary of a measurement's clock samples, and the sampler's thread
with a fake reading in place of NVML (which no CPU machine has)."""

import threading
import time

import pytest


@pytest.fixture
def clocks(bench_module):
    return bench_module("clocks")


def _sample(mhz, watts=600.0, temp=60, reasons=0):
    return {"sm_mhz": mhz, "power_w": watts, "temp_c": temp, "reasons": reasons}


def test_summary_counts_busy_samples_only(clocks):
    samples = [_sample(1980, 80.0, 50, reasons=0x1),  # idle: the profiler's setup
               _sample(1755, 690.0, 61, reasons=0x4),  # held by the power cap
               _sample(1830, 650.0, 63), _sample(1980, 700.0, 62, reasons=0x4 | 0x20)]
    summary = clocks.summarize(samples)
    assert summary == {"sm_mhz": [1755, 1830, 1980], "power_w": [690.0, 700.0], "temp_c": 63,
                       "reasons": ["sw_power_cap", "sw_thermal_slowdown"], "samples": 3,
                       "idle_samples": 1}
    assert clocks.describe(summary) == (
        "1755-1980 MHz, 690 W, 63 C, sw_power_cap, sw_thermal_slowdown")


def test_no_busy_sample_is_no_summary(clocks):
    assert clocks.summarize([]) is None
    assert clocks.summarize([_sample(1980, reasons=0x1)]) is None
    assert clocks.describe(None) == "no clock samples"


def test_sampler_reads_while_the_block_runs(clocks):
    reads, inside = [], threading.Event()

    def read():
        reads.append(time.monotonic())
        inside.set()
        return _sample(1700 + len(reads))

    with clocks.ClockSampler(read, period_s=0.001) as sampler:
        assert inside.wait(5)  # the thread samples while the block still runs
        ended = len(reads)
    after = len(reads)
    time.sleep(0.02)
    assert len(reads) == after >= ended >= 1  # and stops with the block
    assert sampler.summary["samples"] == after
    assert sampler.summary["sm_mhz"][0] == 1701


def test_unreadable_samples_are_skipped(clocks):
    with clocks.ClockSampler(lambda: None, period_s=0.001) as sampler:
        time.sleep(0.01)
    assert sampler.summary is None


def test_without_nvml_the_sampler_does_nothing(clocks, monkeypatch):
    monkeypatch.setattr(clocks, "nvml_reader", lambda: None)
    with clocks.ClockSampler() as sampler:
        pass
    assert sampler.summary is None
