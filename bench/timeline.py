"""Where one call's time goes on one GPU: a profiler trace of the call, its kernels
sorted into attention (jax_fa4's CuTe-DSL kernels), NCCL (collectives: the ring's hops)
and other (XLA's fusions, copies), with how much of the NCCL time ran under an attention
kernel. `python -m bench.context_parallel --timeline` prints it per ring."""

import dataclasses
import glob
import tempfile

import jax
from jax.profiler import ProfileData


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Milliseconds on one GPU, from its first kernel's start to its last one's end."""

    span: float
    idle: float  # no kernel running
    attention: float
    nccl: float
    nccl_under_attention: float  # NCCL kernels running while an attention kernel runs
    other: float

    def __str__(self):
        return (f"span {self.span:.2f} ms: attention {self.attention:.2f}, NCCL "
                f"{self.nccl:.2f} ({self.nccl_under_attention:.2f} under attention), other "
                f"{self.other:.2f}, idle {self.idle:.2f}")


def _kind(kernel_name: str) -> str:
    if "nccl" in kernel_name.lower():
        return "nccl"
    return "attention" if kernel_name.startswith("kernel_cutlass_") else "other"


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(merged):
    return sum(end - start for start, end in merged)


def _overlap(a, b):
    i = j = 0
    total = 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline(fn, *args, device: int = 0) -> Timeline:
    """The Timeline of one call of the jitted, warmed-up fn on GPU `device`."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(fn(*args))
        path, = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        profile = ProfileData.from_file(path)
    plane = next(p for p in profile.planes if p.name.endswith(f"GPU:{device}"))
    kinds = {"attention": [], "nccl": [], "other": []}
    for line in plane.lines:
        if line.name.startswith("Stream"):  # kernels and copies, once each
            for event in line.events:
                kinds[_kind(event.name)].append((event.start_ns, event.end_ns))
    merged = {kind: _union(spans) for kind, spans in kinds.items()}
    busy = _union([span for spans in kinds.values() for span in spans])
    if not busy:
        raise RuntimeError(f"no kernels on GPU {device} in the trace")
    ms = 1e-6
    return Timeline(span=(busy[-1][1] - busy[0][0]) * ms,
                    idle=(busy[-1][1] - busy[0][0] - _length(busy)) * ms,
                    attention=_length(merged["attention"]) * ms,
                    nccl=_length(merged["nccl"]) * ms,
                    nccl_under_attention=_overlap(merged["nccl"], merged["attention"]) * ms,
                    other=_length(merged["other"]) * ms)
