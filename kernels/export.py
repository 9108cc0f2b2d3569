"""Ahead-of-time export of every kernel in kernels/config.py:MANIFEST.

For each configuration (forward or backward): compile the CuTe-DSL kernel for its arch
with fully dynamic batch, sequence lengths and head count, `export_to_c` it to
`<name>.h` + `<name>.o`, then write `kernel_table.inc`, the C++ tables the FFI handlers
dispatch on. Needs nvidia-cutlass-dsl, not a GPU.

Compiles run in parallel worker processes (the DSL keeps global state, one kernel per
process). Objects are cached under a key of the kernel sources, the configuration, the
arch and the toolchain version, so an unchanged kernel is never compiled twice.

    python kernels/export.py --out build/kernels [--cache DIR] [--jobs N]
    python kernels/export.py --list       # kernel names, no compile (for CMake)
    python kernels/export.py --out /tmp/k --only fwd_sm90_bf16_d128_full --keep /tmp/k/ptx
        # one kernel, keeping its PTX and cubin for `cuobjdump -sass` / `ptxas -v`
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import hashlib
import importlib.metadata
import multiprocessing
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.config import FP8_DTYPES, MANIFEST, BwdConfig, FwdConfig  # noqa: E402

Config = FwdConfig | BwdConfig
TOOLCHAIN = "nvidia-cutlass-dsl"


class Param(NamedTuple):
    """One tensor parameter of an exported kernel, in the order of its wrapper.

    layout "bshd": (B, S, H, D) row-major with static D -> export struct shapes
    (B, S, H), strides (S*H*D, H*D); "bhn": (B, H, N) row-major -> shapes (B, H, N),
    strides (H*N, N). `extent` is the FwdArgs / BwdArgs field holding S or N, `heads`
    the one holding H (K and V have their own with GQA), `batch` the one holding B, each
    or a literal number (still a runtime size in the export ABI); `field` the one
    holding the pointer; dtype "io" is the configuration's dtype.
    """

    tensor: str
    field: str
    layout: str
    extent: str
    dtype: str = "io"
    heads: str = "heads"
    batch: str = "batch"
    # "bshd" only: the head stride is a runtime value too (FwdArgs q_strides), so that a
    # view that is not row-major can be passed (kernels/sm90/fwd.py: pack-GQA's decode q).
    head_stride: bool = False


# The export ABI of each kind (see ffi/kernel_table.h): tensors, then scalars, then the
# stream. Compile, header check and the generated launch adapters all follow it.
TENSORS = {
    "fwd": (
        Param("mQ", "q", "bshd", "seqlen_q"),
        Param("mK", "k", "bshd", "seqlen_k", heads="heads_kv"),
        Param("mV", "v", "bshd", "seqlen_k", heads="heads_kv"),
        Param("mO", "o", "bshd", "seqlen_q"),
        Param("mLSE", "lse", "bhn", "seqlen_q", "f32"),
    ),
    "bwd": (
        Param("mQ", "q", "bshd", "seqlen_q"),
        Param("mK", "k", "bshd", "seqlen_k", heads="heads_kv"),
        Param("mV", "v", "bshd", "seqlen_k", heads="heads_kv"),
        Param("mO", "o", "bshd", "seqlen_q"),
        Param("mdO", "dout", "bshd", "seqlen_q"),
        Param("mLSE", "lse", "bhn", "seqlen_q", "f32"),
        Param("mdLSE", "dlse", "bhn", "seqlen_q", "f32"),
        Param("mdQ", "dq", "bshd", "seqlen_q"),
        Param("mdK", "dk", "bshd", "seqlen_k", heads="heads_kv"),
        Param("mdV", "dv", "bshd", "seqlen_k", heads="heads_kv"),
        Param("mLSE2", "lse2", "bhn", "sq_pad", "f32"),
        Param("mDsum", "dsum", "bhn", "sq_pad", "f32"),
        Param("mdQaccum", "dq_accum", "bhn", "dq_accum_len", "f32"),
        Param("mSem", "sem", "bhn", "sem_len", "i32"),
    ),
}
# Split-KV variants take q with all three strides at run time (a pack-GQA decode step's
# q in the caller's layout, its group's heads as rows), and write fp32 partials, one batch of them per split: (B * num_splits,
# Sq, H, Dv) and (B * num_splits, H, Sq), batch-major, after the tile counter; their
# combine writes out and lse (kernels/sm90/combine.py).
SPLIT_PARTIALS = (
    Param("mOpart", "o_part", "bshd", "seqlen_q", "f32", batch="split_batch"),
    Param("mLSEpart", "lse_part", "bhn", "seqlen_q", "f32", batch="split_batch"),
)
SPLIT_Q = Param("mQ", "q", "bshd", "seqlen_q", head_stride=True)
# Paged variants read K and V from caches (num_pages, page_size, Hkv, D / Dv) and take
# the page table (B, 1, max_pages) after the segment tensors (kernels/sm90/paged.py).
PAGED_CACHES = (
    Param("mK", "k", "bshd", "page_size", heads="heads_kv", batch="num_pages"),
    Param("mV", "v", "bshd", "page_size", heads="heads_kv", batch="num_pages"),
)
PAGE_TABLE = Param("mPages", "page_table", "bhn", "max_pages", "i32", heads="1")
# ... and after it the new rows they append to the caches, (B, new_rows, Hkv, D / Dv);
# new_rows 0: none.
NEW_ROWS = (
    Param("mNewK", "new_k", "bshd", "new_rows", heads="heads_kv"),
    Param("mNewV", "new_v", "bshd", "new_rows", heads="heads_kv"),
)
# Every forward kernel takes the "dynamic" schedule's tile counter after out and lse
# (kernels/sm90/schedule.py): one int32 that the handler zeroes before such a launch.
TILE_COUNTER = Param("mTileCounter", "tile_counter", "bhn", "1", "i32", heads="1", batch="1")
# float8 forwards take V^T, (B, Hkv * Dv, Skp) with Skp >= Sk keys a multiple of 32 (16
# bytes at least, as TMA strides need), and after the tile counter the descales (1, 3, Hkv) fp32:
# q, k, v of each K/V head (kernels/sm90/fwd.py); their out is bf16 ("out").
FP8_VT = Param("mV", "v", "bhn", "v_keys", heads="v_rows")
FP8_DESCALE = Param("mDescale", "descale", "bhn", "heads_kv", "f32", heads="3", batch="1")
# kv_dtype variants take K, V and the new rows in kv_dtype ("kv"), and the descales
# after everything else (q's is 1).
KV_FIELDS = ("k", "v", "new_k", "new_v")
# Fields of the (B, S, H, Dv) tensors: v, out and their gradients; the others have D.
VALUE_FIELDS = ("v", "o", "o_part", "dout", "dv", "new_v")


def width(cfg: Config, p: Param) -> int:
    """The static head_dim of a "bshd" tensor parameter."""
    return cfg.head_dim_v if p.field in VALUE_FIELDS else cfg.head_dim


# Segment variants take these after the tensors above (kernels/sm90/segments.py).
SEGMENT_TENSORS = (
    Param("mRows", "q_rows", "bhn", "seqlen_q", "i32", heads="3"),
    Param("mKeys", "k_ids", "bhn", "seqlen_k", "i32", heads="1"),
    Param("mPlan", "plan", "bhn", "plan_len", "i32", heads="plan_tiles"),
)


def tensors(cfg) -> tuple[Param, ...]:
    """The tensor parameters of cfg's kernel, in order."""
    params = TENSORS[cfg.kind]
    if cfg.kind == "fwd" and cfg.dtype in FP8_DTYPES:
        out = params[3]._replace(dtype="out")
        return params[:2] + (FP8_VT, out, params[4], TILE_COUNTER, FP8_DESCALE)
    if cfg.kind == "fwd":
        params = (((SPLIT_Q if cfg.split else params[0]),)
                  + (PAGED_CACHES if cfg.paged else params[1:3]) + params[3:]
                  + (TILE_COUNTER,) + (SPLIT_PARTIALS if cfg.split else ()))
    params = (params + (SEGMENT_TENSORS if cfg.segments else ())
              + ((PAGE_TABLE, *NEW_ROWS) if cfg.paged else ()))
    if cfg.kind == "fwd" and cfg.kv_dtype:
        params = tuple(p._replace(dtype="kv") if p.field in KV_FIELDS else p
                       for p in params) + (FP8_DESCALE,)
    return params


# (C type, FwdArgs / BwdArgs field) of each scalar parameter.
SCALARS = {
    "fwd": (("float", "scale_log2"), ("int32_t", "band_lo"), ("int32_t", "band_hi"),
            ("float", "softcap_scale"), ("int32_t", "num_splits"), ("int32_t", "num_sms"),
            ("int32_t", "unpack_group")),
    "bwd": (("float", "scale_log2"), ("float", "scale"), ("int32_t", "deterministic"),
            ("int32_t", "band_lo"), ("int32_t", "band_hi"), ("float", "softcap_scale")),
}
def struct(p: Param) -> str:
    """The export struct of a tensor parameter (the header's text, spaces collapsed)."""
    strides = 3 if p.head_stride else 2
    return f"void *data; int32_t dynamic_shapes[3]; int64_t dynamic_strides[{strides}];"


# The module struct the wrapper takes, and the module's loader entry points, which the
# generated table calls one device at a time (InitLibrary and LoadToDevice in
# ffi/kernel_table.cc) instead of the header's _Kernel_Module_Load, which loads onto
# every device. They take MLIR packed arguments: a pointer to each argument, then one to
# the returned cudaError_t. Per entry point: the struct the header packs them in, and
# its field types.
MODULE = "cudaLibrary_t module;"
LOADERS = {
    "cuda_init": ("initArgs", ("cudaLibrary_t **", "cudaError_t *")),
    "cuda_load_to_device": ("loadArgs", ("cudaLibrary_t **", "int32_t *", "cudaError_t *")),
}


def source_digest() -> str:
    """Hash of every kernel source file, this one included (its ABI tables and symbolic
    sizes shape the compiled code): a change anywhere invalidates the cache."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(path.relative_to(ROOT).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(cfg: Config, sources: str, toolchain: str) -> str:
    text = "\n".join([sources, repr(cfg), cfg.arch, toolchain, sys.version.split()[0]])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def compile_one(cfg: Config, out_dir: str, keep: str | None = None) -> float:
    """Worker: compile and export one kernel into out_dir; returns seconds. With `keep`,
    the compiler's PTX and cubin are written there too."""
    os.environ["CUTE_DSL_ARCH"] = cfg.arch
    options = f"--gpu-arch {cfg.arch}"
    if keep:
        os.makedirs(keep, exist_ok=True)
        os.chdir(keep)  # the DSL writes kept intermediates to the working directory
        options += " --keep-ptx --keep-cubin"
    import ctypes

    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor
    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    from kernels.sm90.fwd import DTYPES, OUT_DTYPES, FwdSm90
    from kernels.sm90.fwd_keys_m import FwdKeysAsM

    # Without a GPU, export JIT-links the host stub against symbols of the DSL runtime
    # that only a loaded driver would otherwise provide: load them globally first.
    for lib in CuTeDSL._get_dsl().get_shared_libs():
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)

    t0 = time.time()
    if cfg.kind == "fwd":
        kind = FwdKeysAsM if cfg.keys_as_m else FwdSm90
        kernel, scalars = kind(cfg), (Float32(1.0), Int32(0), Int32(0), Float32(1.0),
                                         Int32(1), Int32(1), Int32(1))
    else:
        from kernels.sm90.bwd import BwdSm90
        from kernels.sm90.bwd_split import BwdSm90SplitD

        kind = BwdSm90SplitD if cfg.tile.split_head_dim else BwdSm90
        kernel, scalars = kind(cfg), (Float32(1.0), Float32(1.0), Int32(0), Int32(0), Int32(0),
                                      Float32(1.0))
    params = tensors(cfg)
    # One runtime size per name: batch, heads and each extent of `params`. The backward's
    # workspace extents are whole query tiles (WorkspaceExtents in ffi/kernel_table.cc):
    # saying so lets the kernels use 16-byte accesses on them.
    tiles = {"sq_pad": cfg.tile.m, "dq_accum_len": cfg.tile.m * cfg.head_dim, "v_keys": 16}
    sizes = {name: cute.SymInt(divisibility=tiles.get(name, 1))
             for name in (*(p.batch for p in params), *(p.heads for p in params),
                          *(p.extent for p in params))}
    dtypes = {"io": DTYPES[cfg.dtype], "out": OUT_DTYPES.get(cfg.dtype, DTYPES[cfg.dtype]),
              "kv": DTYPES[cfg.kv_dtype or cfg.dtype], "f32": Float32, "i32": Int32}

    def fake(p: Param):
        b, h, n = sizes[p.batch], sizes[p.heads], sizes[p.extent]
        if p.head_stride:
            # 16-byte aligned strides, as TMA needs (8 16-bit values).
            strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3))
            return make_fake_tensor(dtypes[p.dtype], (b, n, h, width(cfg, p)), (*strides, 1),
                                    assumed_align=16)
        if p.layout == "bshd":
            shape, order = (b, n, h, width(cfg, p)), (3, 2, 1, 0)
        else:
            shape, order = (b, h, n), (2, 1, 0)
        return make_fake_compact_tensor(dtypes[p.dtype], shape, stride_order=order,
                                        assumed_align=16)

    # Variants without segments take None for the segment tensors: not in their ABI.
    seg = [fake(p) if cfg.segments else None for p in SEGMENT_TENSORS]
    later = {p.tensor for p in SEGMENT_TENSORS + SPLIT_PARTIALS
             + (PAGE_TABLE, *NEW_ROWS, FP8_DESCALE)}
    main = [fake(p) for p in params if p.tensor not in later]
    # Forward kernels take the split partials (None unless split) after the tile
    # counter, and the page table and new rows (None unless paged) before their scalars.
    parts, pages, descale = [], [], []
    if cfg.kind == "fwd":
        parts = [fake(p) if cfg.split else None for p in SPLIT_PARTIALS]
        by_tensor = {p.tensor: p for p in params}
        pages = [fake(by_tensor[p.tensor]) if cfg.paged else None
                 for p in (PAGE_TABLE, *NEW_ROWS)]
        descale = [fake(FP8_DESCALE) if cfg.dtype in FP8_DTYPES or cfg.kv_dtype else None]
    compiled = cute.compile(kernel, *main, *parts, *seg, *pages, *descale, *scalars,
                            cuda.CUstream(0),
                            options=options)
    compiled.export_to_c(file_path=out_dir, file_name=cfg.name, function_prefix=cfg.name)
    check_header(pathlib.Path(out_dir) / f"{cfg.name}.h", cfg)
    return time.time() - t0


def check_header(path: pathlib.Path, cfg: Config) -> None:
    """The table below assumes this ABI; fail the build if the export changed it."""
    text, name = path.read_text(), cfg.name
    params = tensors(cfg)
    for p in params:
        found = re.search(
            r"typedef struct \{([^}]*)\} " + re.escape(f"{name}_Tensor_{p.tensor}_t;"), text
        )
        if not found:
            raise RuntimeError(f"{path}: no tensor struct for {p.tensor}")
        body = " ".join(found.group(1).split())
        if body != struct(p):
            raise RuntimeError(f"{path}: {p.tensor} struct is '{body}', expected '{struct(p)}'")
    check_loaders(path, text, name)
    signature = (
        rf"cute_dsl_{name}_wrapper\({name}_Kernel_Module_t \*module, "
        + ", ".join(rf"{name}_Tensor_{p.tensor}_t \*{p.tensor}" for p in params)
        + "".join(rf", {ctype} {field}" for ctype, field in SCALARS[cfg.kind])
        + r", cudaStream_t stream\)"
    )
    if not re.search(signature, text):
        raise RuntimeError(f"{path}: wrapper signature changed")


def check_loaders(path: pathlib.Path, text: str, name: str) -> None:
    """The module struct, and the declaration and argument struct of each LOADERS entry."""
    module = re.search(r"typedef struct \{([^}]*)\} " + re.escape(f"{name}_Kernel_Module_t;"),
                       text)
    if not module or " ".join(module.group(1).split()) != MODULE:
        raise RuntimeError(f"{path}: module struct changed, expected '{MODULE}'")
    for entry, (var, want) in LOADERS.items():
        symbol = f"_mlir_{name}_{entry}"
        if not re.search(rf"\bvoid {symbol}\(void \*\*\);", text):
            raise RuntimeError(f"{path}: no declaration 'void {symbol}(void **);'")
        args = re.search(r"struct \{([^}]*)\} " + var + r" = ", text)
        if not args or not re.search(rf"\b{symbol}\(\(void \*\*\)\(&{var}\)\);", text):
            raise RuntimeError(f"{path}: {symbol} is no longer called with a struct {var}")
        fields = (" ".join(f.split()) for f in args.group(1).split(";") if f.strip())
        got = tuple(re.sub(r"\w+$", "", f) for f in fields)  # the types, without names
        if got != want:
            raise RuntimeError(f"{path}: {symbol} takes {got}, expected {want}")


_ENTRY = """
namespace {name} {{
{name}_Kernel_Module_t module;
cudaError_t Init() {{ return InitLibrary(_mlir_{name}_cuda_init, &module.module); }}
cudaError_t Load(int32_t device) {{
  return LoadToDevice(_mlir_{name}_cuda_load_to_device, &module.module, device);
}}
int32_t Launch(const {args}& a, cudaStream_t stream) {{
{tensors}
  return cute_dsl_{name}_wrapper(&module, {call});
}}
}}  // namespace {name}
"""


def _entry(cfg: Config) -> str:
    """One kernel's module, loaders and launch adapter (Args -> its export structs)."""
    lines = []
    for p in tensors(cfg):
        type_name = f"{cfg.name}_Tensor_{p.tensor}_t"
        batch, heads, extent = (name if name.isdigit() else f"a.{name}"
                                for name in (p.batch, p.heads, p.extent))
        if p.head_stride:
            make = (f"BshdStrided<{type_name}>(a.{p.field}, {batch}, {extent}, {heads}, "
                    f"a.{p.field}_strides)")
        elif p.layout == "bshd":
            make = (f"Bshd<{type_name}>(a.{p.field}, {batch}, {extent}, {heads}, "
                    f"{width(cfg, p)})")
        else:
            make = f"Bhn<{type_name}>(a.{p.field}, {batch}, {heads}, {extent})"
        lines.append(f"  auto {p.field} = {make};")
    call = [f"&{p.field}" for p in tensors(cfg)]
    call += [f"a.{field}" for _, field in SCALARS[cfg.kind]] + ["stream"]
    return _ENTRY.format(name=cfg.name, args=f"{cfg.kind.capitalize()}Args",
                         tensors="\n".join(lines), call=", ".join(call))


def write_table(out: pathlib.Path, configs: tuple[Config, ...]) -> None:
    """Generated C++: includes every exported header and defines kFwdKernels and
    kBwdKernels, one row per kernel (see ffi/kernel_table.h for the types)."""
    lines = [
        "// Generated by kernels/export.py. Do not edit.",
        "// Included once, by ffi/kernel_table.cc, after ffi/kernel_table.h.",
    ]
    lines += [f'#include "{cfg.name}.h"' for cfg in configs]
    lines.append("namespace jax_fa4 {")
    lines += [_entry(cfg) for cfg in configs]
    for kind in ("fwd", "bwd"):
        table = f"k{kind.capitalize()}Kernels"
        lines.append(f"const {kind.capitalize()}Kernel {table}[] = {{")
        for cfg in (c for c in configs if c.kind == kind):
            dtypes = {"bf16": "Dtype::kBF16", "fp16": "Dtype::kF16", "e4m3": "Dtype::kE4M3"}
            dtype, kv_dtype = dtypes[cfg.dtype], dtypes[cfg.kv_dtype or cfg.dtype]
            dynamic = kind == "fwd" and cfg.tile.schedule == "dynamic"
            banded, softcap, segments, split, paged, dynamic, keys_as_m, long_rows = (
                "true" if flag else "false"
                for flag in (cfg.banded, cfg.softcap, cfg.segments, cfg.split, cfg.paged,
                             dynamic, cfg.keys_as_m, cfg.long_rows))
            lines.append(
                f'    {{"{cfg.name}", "{cfg.arch}", {dtype}, {kv_dtype}, {cfg.head_dim}, {cfg.head_dim_v}, '
                f'{banded}, {softcap}, {segments}, {split}, {paged}, {dynamic}, {keys_as_m}, {long_rows}, '
                f"{cfg.tile.m}, {cfg.tile.n}, {getattr(cfg.tile, 'ctas_per_sm', 1)}, "
                f"{getattr(cfg.tile, 'dq_parts', 0)}, &{cfg.name}::Init, &{cfg.name}::Load, &{cfg.name}::Launch}},"
            )
        lines.append("};")
        lines.append(f"const int kNum{kind.capitalize()}Kernels = sizeof({table}) / sizeof({table}[0]);")
    lines.append("}  // namespace jax_fa4")
    text = "\n".join(lines) + "\n"
    path = out / "kernel_table.inc"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def export_only(args) -> int:
    """Developer path: compile the named kernels into --out, bypassing the cache."""
    by_name = {cfg.name: cfg for cfg in MANIFEST}
    names = args.only.split(",")
    missing = [n for n in names if n not in by_name]
    if missing:
        print(f"unknown kernels {missing}; see --list", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    keep_root = args.keep.resolve() if args.keep else None  # compile_one changes directory
    # A fresh process per kernel: the DSL's global state includes the folder it keeps
    # intermediates in, so in one process every kernel's PTX landed in the first's.
    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx,
                                     max_tasks_per_child=1) as pool:
        for name in names:
            keep = str(keep_root / name) if keep_root else None
            seconds = pool.submit(compile_one, by_name[name], str(out), keep).result()
            print(f"{name}: compiled in {seconds:.1f}s -> {args.out}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--cache", type=pathlib.Path,
                    default=pathlib.Path(os.environ.get("JAX_FA4_KERNEL_CACHE", ROOT / "build" / "kernel-cache")))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--list", action="store_true", help="print kernel names and exit")
    ap.add_argument("--only", help="comma-separated kernel names: compile just these, no table")
    ap.add_argument("--keep", type=pathlib.Path, help="with --only: keep PTX and cubin here")
    args = ap.parse_args()
    if args.list:
        print(";".join(cfg.name for cfg in MANIFEST))
        return 0
    if args.out is None:
        ap.error("--out is required")
    if args.only:
        return export_only(args)

    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    toolchain = f"{TOOLCHAIN}=={importlib.metadata.version(TOOLCHAIN)}"
    sources = source_digest()
    entries = {cfg: args.cache / cache_key(cfg, sources, toolchain) for cfg in MANIFEST}
    todo = [cfg for cfg in MANIFEST if not (entries[cfg] / f"{cfg.name}.o").exists()]
    n, done, failures = len(MANIFEST), 0, []
    for cfg in MANIFEST:
        if cfg not in todo:
            done += 1
            print(f"[{done}/{n}] {cfg.name}: cached", flush=True)

    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=ctx) as pool:
        staged = {}
        for cfg in todo:
            tmp = tempfile.mkdtemp(prefix=f"{cfg.name}.", dir=args.out)
            staged[pool.submit(compile_one, cfg, tmp)] = (cfg, tmp)
        for fut in futures.as_completed(staged):
            cfg, tmp = staged[fut]
            done += 1
            try:
                seconds = fut.result()
            except Exception as e:  # report every failing kernel, then fail the build
                failures.append(cfg.name)
                print(f"[{done}/{n}] {cfg.name}: FAILED: {e}", flush=True)
                shutil.rmtree(tmp, ignore_errors=True)
                continue
            entries[cfg].parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(entries[cfg], ignore_errors=True)
            shutil.move(tmp, entries[cfg])
            print(f"[{done}/{n}] {cfg.name}: compiled in {seconds:.1f}s", flush=True)
    if failures:
        print(f"export failed for {len(failures)} of {n} kernels: {', '.join(failures)}", flush=True)
        return 1

    for cfg in MANIFEST:
        for ext in ("h", "o"):
            shutil.copyfile(entries[cfg] / f"{cfg.name}.{ext}", args.out / f"{cfg.name}.{ext}")
    write_table(args.out, MANIFEST)
    print(
        f"exported {n} kernels ({len(todo)} compiled, {n - len(todo)} cached) "
        f"in {time.time() - t0:.1f}s -> {args.out}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
