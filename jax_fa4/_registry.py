"""The native module `jax_fa4._ffi`: load it if it was built, register its FFI targets.

The module holds the XLA FFI handlers (as capsules) and the manifest of the kernels it
was built with. A source checkout without `pip install .` has no module, and a built one
can fail to load (a missing library, another platform): everything else in jax_fa4
still works, and `native_reason` says which and why (`_path` refuses to run without it
beside a Hopper GPU unless allowed).
"""

from __future__ import annotations

import hashlib

import jax

NOT_BUILT = "native module jax_fa4._ffi is not built (pip install .)"

try:
    # Not `from jax_fa4 import _ffi`: while the package initialises, a missing module
    # then raises a plain ImportError about a partially initialised package instead of
    # ModuleNotFoundError for jax_fa4._ffi, and native_reason could not say "not built".
    import jax_fa4._ffi as _ffi
    _IMPORT_ERROR = None
except ImportError as error:
    _ffi = None
    _IMPORT_ERROR = error

# Attribute set on the extension module once its targets are registered. It lives on
# the extension module because `importlib.reload` re-runs this file but never
# re-creates an extension module, and XLA must not see the same target twice.
_REGISTERED_FLAG = "_jax_fa4_targets_registered"


def native_reason() -> str:
    """Empty when the native module is loaded, else why the kernel path is unavailable:
    not built, or the import's own error."""
    if _ffi is not None:
        return ""
    absent = (isinstance(_IMPORT_ERROR, ModuleNotFoundError)
              and _IMPORT_ERROR.name == f"{__package__}._ffi")
    if _IMPORT_ERROR is None or absent:
        return NOT_BUILT
    return f"native module jax_fa4._ffi failed to import: {_IMPORT_ERROR!r}"


def module_md5() -> str | None:
    """The first 8 hex digits of the loaded native module's md5, the build id the docs
    and measurements name; None without a module."""
    if _ffi is None or not getattr(_ffi, "__file__", None):
        return None
    with open(_ffi.__file__, "rb") as f:
        return hashlib.md5(f.read()).hexdigest()[:8]


def manifest() -> list[dict]:
    """One dict per compiled kernel (see `jax_fa4.kernels`); [] without the module."""
    return [dict(entry) for entry in _MANIFEST]


def head_dims(entry: dict) -> tuple[int, int]:
    """(D, Dv) of a manifest entry."""
    return entry["head_dim"], entry.get("head_dim_v", entry["head_dim"])


def find_kernel(kind: str, dtype: str, dims: tuple[int, int], banded: bool,
                softcap: bool = False, segments: bool = False,
                split: bool = False, paged: bool = False,
                kv_dtype: str | None = None, keys_as_m: bool = False,
                long_rows: bool = False) -> dict | None:
    """The manifest entry of the compiled kernel of this kind ("fwd" or "bwd"), head
    dims (D, Dv) and configuration, None if there is none. kv_dtype: of k and v, when
    not dtype (a float8 KV cache); keys_as_m: the split kernel's decode tile; long_rows:
    the dense forward's tile for rows that see many keys."""
    key = (kind, dtype, kv_dtype or dtype, dims, banded, softcap, segments, split, paged,
           keys_as_m, long_rows)
    for entry in _MANIFEST:
        if (entry["kind"], entry["dtype"], entry.get("kv_dtype", entry["dtype"]),
                head_dims(entry), entry["banded"],
                entry.get("softcap", False), entry.get("segments", False),
                entry.get("split", False), entry.get("paged", False),
                entry.get("keys_as_m", False), entry.get("long_rows", False)) == key:
            return dict(entry)
    return None


def _register_targets() -> None:
    if _ffi is None or getattr(_ffi, _REGISTERED_FLAG, False):
        return
    for name, stages in _ffi.registrations().items():
        jax.ffi.register_ffi_target(name, stages, platform="CUDA")
    setattr(_ffi, _REGISTERED_FLAG, True)


_MANIFEST: tuple[dict, ...] = tuple(_ffi.manifest()) if _ffi is not None else ()
_register_targets()
