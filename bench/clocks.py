"""The GPU's SM clock, power, temperature and clock event reasons while a measurement
runs, read through NVML (the driver's libnvidia-ml, by ctypes) by a thread every few ms.

Kernel times depend on the clock the GPU holds, and that depends on what ran before: a
GPU idle between calls starts each at its boost clock, one under sustained load settles
where its power limit lets it. Recording the clock beside each time says which of the
two a cell measured:

    with ClockSampler() as clocks:
        ...                      # the timed calls
    clocks.summary               # {"sm_mhz": [min, median, max], ...} or None

NVML numbers its GPUs in PCI order; the sampled GPU is the first of
CUDA_VISIBLE_DEVICES (an index or a UUID), else index 0, which is the GPU the process
uses wherever CUDA's order is PCI order too (GPUs of one kind). Without NVML (no driver,
another OS) the summary is None and nothing else changes.
"""

import ctypes
import functools
import os
import statistics
import threading

# nvmlClocksEventReasons bits, named as NVML names them.
EVENT_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
                 0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
                 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
                 0x100: "display_clock_setting"}
_CLOCK_SM, _TEMPERATURE_GPU = 1, 0


class _Nvml:
    """One GPU's readings through libnvidia-ml."""

    def __init__(self, lib, device):
        self._lib, self._device = lib, device
        # Renamed from "throttle" to "event" reasons in CUDA 12.2's NVML; older drivers
        # have only the throttle name.
        self._reasons = (getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
                         or lib.nvmlDeviceGetCurrentClocksThrottleReasons)

    def read(self) -> dict | None:
        mhz, mw, temp = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        reasons = ctypes.c_ulonglong()
        lib, dev = self._lib, self._device
        if (lib.nvmlDeviceGetClockInfo(dev, _CLOCK_SM, ctypes.byref(mhz))
                or lib.nvmlDeviceGetPowerUsage(dev, ctypes.byref(mw))
                or lib.nvmlDeviceGetTemperature(dev, _TEMPERATURE_GPU, ctypes.byref(temp))
                or self._reasons(dev, ctypes.byref(reasons))):
            return None
        return {"sm_mhz": mhz.value, "power_w": mw.value / 1e3, "temp_c": temp.value,
                "reasons": reasons.value}


@functools.cache
def nvml_reader():
    """The read function of the process's GPU, or None where NVML cannot be used."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2():
            return None
        device = ctypes.c_void_p()
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        if first.isdigit():
            status = lib.nvmlDeviceGetHandleByIndex_v2(int(first), ctypes.byref(device))
        else:
            status = lib.nvmlDeviceGetHandleByUUID(first.encode(), ctypes.byref(device))
        return None if status else _Nvml(lib, device).read
    except (OSError, AttributeError):
        return None


def summarize(samples: list[dict]) -> dict | None:
    """The readings of one measurement, over the samples taken while the GPU was busy
    (NVML's gpu_idle reason clear: gaps between calls, the profiler's setup): SM clock
    [min, median, max] MHz, power [median, max] W, the highest temperature, the event
    reasons seen, and how many samples were busy and idle. None without a busy sample."""
    busy = [s for s in samples if not s["reasons"] & 0x1]
    if not busy:
        return None
    mhz = [s["sm_mhz"] for s in busy]
    watts = [s["power_w"] for s in busy]
    seen = functools.reduce(lambda a, s: a | s["reasons"], busy, 0)
    return {"sm_mhz": [min(mhz), statistics.median(mhz), max(mhz)],
            "power_w": [round(statistics.median(watts), 1), round(max(watts), 1)],
            "temp_c": max(s["temp_c"] for s in busy),
            "reasons": [name for bit, name in EVENT_REASONS.items() if seen & bit],
            "samples": len(busy), "idle_samples": len(samples) - len(busy)}


def describe(summary: dict | None) -> str:
    """A summary in a few words, e.g. "1755-1980 MHz, 688 W, 61 C, sw_power_cap"."""
    if summary is None:
        return "no clock samples"
    lo, _, hi = summary["sm_mhz"]
    reasons = ", ".join(summary["reasons"]) or "no event reason"
    return (f"{lo}-{hi} MHz, {summary['power_w'][0]:.0f} W, {summary['temp_c']} C, "
            f"{reasons}")


class ClockSampler:
    """Samples `read` (default: NVML's) every `period_s` from entering the block to
    leaving it; afterwards `summary` holds `summarize`'s dict (None without a reading
    taken while the GPU was busy: no NVML, or calls shorter than the period)."""

    def __init__(self, read=None, period_s: float = 0.005):
        self._read = read if read is not None else nvml_reader()
        self._period = period_s
        self._samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = None
        self.summary = None

    def _loop(self):
        while not self._stop.wait(self._period):
            sample = self._read()
            if sample is not None:
                self._samples.append(sample)

    def __enter__(self):
        if self._read is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self.summary = summarize(self._samples)
        return False
