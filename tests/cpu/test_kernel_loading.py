"""The export ABI of module loading that ffi/kernel_table.cc relies on to load each kernel
per device (kernels/export.py check_loaders); no CuTe-DSL or GPU needed."""

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

# The loader part of an exported header, in the shape check_loaders expects: the module
# struct, and the two entry points with the structs that pack their arguments.
HEADER = """
typedef struct {
    cudaLibrary_t module;
} k_Kernel_Module_t;
void _mlir_k_cuda_init(void **);
void _mlir_k_cuda_load_to_device(void **);
static inline void k_Kernel_Module_Load(k_Kernel_Module_t *module) {
    struct { cudaLibrary_t **lib; cudaError_t *err; } initArgs = {&lib, &err};
    _mlir_k_cuda_init((void **)(&initArgs));
    struct { cudaLibrary_t **lib; int32_t *dev; cudaError_t *err; } loadArgs = {&lib, &dev, &err};
    _mlir_k_cuda_load_to_device((void **)(&loadArgs));
}
"""


@pytest.fixture
def export(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from kernels import export

    return export


def test_accepts_the_loader_abi(export):
    export.check_loaders(pathlib.Path("k.h"), HEADER, "k")


@pytest.mark.parametrize("old, new", [
    ("cudaLibrary_t module;", "CUlibrary module;"),
    ("void _mlir_k_cuda_init(void **);", ""),
    ("int32_t *dev;", "int64_t *dev;"),
    ("int32_t *dev; ", ""),
    ("(&loadArgs)", "(&otherArgs)"),
])
def test_rejects_a_changed_loader_abi(export, old, new):
    assert old in HEADER
    with pytest.raises(RuntimeError, match="k.h"):
        export.check_loaders(pathlib.Path("k.h"), HEADER.replace(old, new), "k")


def test_table_loads_one_device_at_a_time(export):
    # The header's own loader loads onto every device; the table must not call it.
    for cfg in (next(c for c in export.MANIFEST if c.kind == kind) for kind in ("fwd", "bwd")):
        entry = export._entry(cfg)
        assert f"_mlir_{cfg.name}_cuda_load_to_device, &module.module, device" in entry
        assert "Kernel_Module_Load" not in entry
