"""Markers shared by tests/cpu and tests/gpu.

gpu: needs a CUDA GPU and the built native module; skipped elsewhere. Each GPU test
    has a time limit (GPU_TEST_TIMEOUT_S, through pytest-timeout, part of the `test`
    extra): a kernel that hangs (the deterministic backward's semaphore wait) fails
    its test instead of stalling the suite.
native: needs the built native module jax_fa4._ffi (no GPU); skipped in a source
    checkout that was not built, unless JAX_FA4_REQUIRE_NATIVE=1 (set by `run.sh test`,
    hence CI), which turns a missing module into an error.
"""

import os

# The GPU tests compile a few hundred small reference programs; XLA's GEMM autotuning
# of each would add compile time and does not change what they check (float32
# references, and our kernels, which XLA does not tune). Read when the backend starts.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()
# Under pytest-xdist each worker is a process of its own with one GPU client: with
# JAX's default pool (75% of the GPU's memory each) every worker but the first fails
# its first allocation, and so does every test it runs.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

# Seconds per GPU test. The slowest cases (the 2^31-element test, command-buffer
# subprocesses) take about a minute on an H100; a hang is cut off by a thread that dumps
# the stacks and ends the worker, since a blocked CUDA call never returns to a signal.
GPU_TEST_TIMEOUT_S = 600

# The kernels and the reference are 32-bit; keep 64-bit types out of every test.
jax.config.update("jax_enable_x64", False)
# Sharding tests partition over 8 CPU devices (the reference stands in for the kernel).
# Must be set before any backend starts; it only affects the CPU platform.
CPU_DEVICES = 8
jax.config.update("jax_num_cpu_devices", CPU_DEVICES)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the built native module")
    config.addinivalue_line("markers", "native: needs the built native module jax_fa4._ffi")
    # Registered by pytest-xdist when installed; declared here so plain runs know it.
    config.addinivalue_line("markers", "xdist_group: cases --dist loadgroup keeps on one worker")


def pytest_report_header(config):
    import jax_fa4
    from jax_fa4 import _registry

    built = _registry.native_reason() or f"native module built, {len(jax_fa4.kernels())} kernels"
    return f"jax_fa4 from {os.path.dirname(jax_fa4.__file__)} ({built}); jax {jax.__version__}"


def pytest_collection_modifyitems(config, items):
    from jax_fa4 import _path, _registry

    backend = jax.default_backend()
    # The kernels are built for sm_90a only: elsewhere the GPU tests would fail, not test.
    hopper = backend == "gpu" and any(_path.is_hopper(d) for d in jax.devices())
    not_built = _registry.native_reason()
    if not_built and os.environ.get("JAX_FA4_REQUIRE_NATIVE") == "1":
        raise pytest.UsageError(f"JAX_FA4_REQUIRE_NATIVE=1 but {not_built}")
    if backend != "gpu" and os.environ.get("JAX_FA4_REQUIRE_GPU") == "1":
        raise pytest.UsageError(f"JAX_FA4_REQUIRE_GPU=1 but jax.default_backend() is "
                                f"{backend!r}")
    # JAX_FA4_NO_TIMEOUT=1: no limit (a debugger, a long sanitizer run), with the
    # plugin or without it.
    no_limit = os.environ.get("JAX_FA4_NO_TIMEOUT") == "1"
    timeout = config.pluginmanager.hasplugin("timeout") and not no_limit
    if not timeout and not no_limit and backend == "gpu":
        raise pytest.UsageError("the GPU tests need pytest-timeout (pip install "
                                "pytest-timeout, or set JAX_FA4_NO_TIMEOUT=1)")
    for item in items:
        if "gpu" in item.keywords and timeout:
            item.add_marker(pytest.mark.timeout(GPU_TEST_TIMEOUT_S, method="thread"))
        if "gpu" in item.keywords and backend != "gpu":
            item.add_marker(pytest.mark.skip(
                reason=f"needs a GPU; jax.default_backend() is {backend!r}"))
        elif "gpu" in item.keywords and not hopper:
            item.add_marker(pytest.mark.skip(
                reason=f"needs a Hopper GPU (sm_90); found {_path.describe(jax.devices())}"))
        elif ("gpu" in item.keywords or "native" in item.keywords) and not_built:
            item.add_marker(pytest.mark.skip(reason=not_built))
