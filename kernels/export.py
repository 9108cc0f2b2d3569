"""Ahead-of-time export of every kernel in kernels/config.py:MANIFEST.

For each configuration: compile the CuTe-DSL kernel for its arch with fully dynamic
batch, sequence lengths and head count, `export_to_c` it to `<name>.h` + `<name>.o`,
then write `kernel_table.inc`, the C++ table the FFI handlers dispatch on. Needs
nvidia-cutlass-dsl, not a GPU.

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

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.config import MANIFEST, FwdConfig  # noqa: E402

TOOLCHAIN = "nvidia-cutlass-dsl"
# Export ABI per tensor: which dynamic shape and stride slots the generated structs
# have, in mode order. (B, S, H, D) row-major with static D -> shapes (B, S, H),
# strides (S*H*D, H*D); LSE (B, H, Sq) -> shapes (B, H, Sq), strides (H*Sq, Sq).
EXPECTED_TENSORS = ("mQ", "mK", "mV", "mO", "mLSE")


def source_digest() -> str:
    """Hash of every kernel source file: a change anywhere invalidates the cache."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        if path.name == "export.py" or "__pycache__" in path.parts:
            continue
        h.update(path.relative_to(ROOT).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(cfg: FwdConfig, sources: str, toolchain: str) -> str:
    text = "\n".join([sources, repr(cfg), cfg.arch, toolchain, sys.version.split()[0]])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def compile_one(cfg: FwdConfig, out_dir: str, keep: str | None = None) -> float:
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
    from cutlass import Float32
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    from kernels.sm90.fwd import DTYPES, FwdSm90

    # Without a GPU, export JIT-links the host stub against symbols of the DSL runtime
    # that only a loaded driver would otherwise provide: load them globally first.
    for lib in CuTeDSL._get_dsl().get_shared_libs():
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)

    t0 = time.time()
    batch, seqlen_q, seqlen_k, heads = (cute.SymInt() for _ in range(4))
    dtype, d = DTYPES[cfg.dtype], cfg.head_dim

    def bshd(seqlen):
        return make_fake_compact_tensor(
            dtype, (batch, seqlen, heads, d), stride_order=(3, 2, 1, 0), assumed_align=16
        )

    lse = make_fake_compact_tensor(
        Float32, (batch, heads, seqlen_q), stride_order=(2, 1, 0), assumed_align=16
    )
    compiled = cute.compile(
        FwdSm90(cfg),
        bshd(seqlen_q), bshd(seqlen_k), bshd(seqlen_k), bshd(seqlen_q), lse,
        Float32(1.0), cuda.CUstream(0),
        options=options,
    )
    compiled.export_to_c(file_path=out_dir, file_name=cfg.name, function_prefix=cfg.name)
    check_header(pathlib.Path(out_dir) / f"{cfg.name}.h", cfg.name)
    return time.time() - t0


def check_header(path: pathlib.Path, name: str) -> None:
    """The table below assumes this ABI; fail the build if the export changed it."""
    text = path.read_text()
    for tensor in EXPECTED_TENSORS:
        struct = re.search(
            r"typedef struct \{([^}]*)\} " + re.escape(f"{name}_Tensor_{tensor}_t;"), text
        )
        if not struct:
            raise RuntimeError(f"{path}: no tensor struct for {tensor}")
        body = " ".join(struct.group(1).split())
        want = "void *data; int32_t dynamic_shapes[3]; int64_t dynamic_strides[2];"
        if body != want:
            raise RuntimeError(f"{path}: {tensor} struct is '{body}', expected '{want}'")
    signature = (
        rf"cute_dsl_{name}_wrapper\({name}_Kernel_Module_t \*module, "
        + ", ".join(rf"{name}_Tensor_{t}_t \*{t}" for t in EXPECTED_TENSORS)
        + r", float scale_log2, cudaStream_t stream\)"
    )
    if not re.search(signature, text):
        raise RuntimeError(f"{path}: wrapper signature changed")


_ENTRY = """
namespace {name} {{
{name}_Kernel_Module_t module;
cudaError_t Load() {{
  {name}_Kernel_Module_Load(&module);
  return TakeLoadError();
}}
int32_t Launch(const FwdArgs& a, cudaStream_t stream) {{
  const int64_t d = {head_dim};
  const int64_t q_row = int64_t{{a.heads}} * d, q_batch = int64_t{{a.seqlen_q}} * q_row;
  const int64_t k_batch = int64_t{{a.seqlen_k}} * q_row;
  {name}_Tensor_mQ_t q{{a.q, {{a.batch, a.seqlen_q, a.heads}}, {{q_batch, q_row}}}};
  {name}_Tensor_mK_t k{{a.k, {{a.batch, a.seqlen_k, a.heads}}, {{k_batch, q_row}}}};
  {name}_Tensor_mV_t v{{a.v, {{a.batch, a.seqlen_k, a.heads}}, {{k_batch, q_row}}}};
  {name}_Tensor_mO_t o{{a.o, {{a.batch, a.seqlen_q, a.heads}}, {{q_batch, q_row}}}};
  {name}_Tensor_mLSE_t lse{{a.lse, {{a.batch, a.heads, a.seqlen_q}},
                           {{int64_t{{a.heads}} * a.seqlen_q, a.seqlen_q}}}};
  return cute_dsl_{name}_wrapper(&module, &q, &k, &v, &o, &lse, a.scale_log2, stream);
}}
}}  // namespace {name}
"""


def write_table(out: pathlib.Path, configs: tuple[FwdConfig, ...]) -> None:
    """Generated C++: includes every exported header and defines kFwdKernels, one row
    per kernel (see ffi/kernel_table.h for the types)."""
    lines = [
        "// Generated by kernels/export.py. Do not edit.",
        "// Included once, by ffi/kernel_table.cc, after ffi/kernel_table.h.",
    ]
    lines += [f'#include "{cfg.name}.h"' for cfg in configs]
    lines.append("namespace jax_fa4 {")
    lines += [_ENTRY.format(name=cfg.name, head_dim=cfg.head_dim) for cfg in configs]
    lines.append("const FwdKernel kFwdKernels[] = {")
    for cfg in configs:
        dtype = {"bf16": "Dtype::kBF16", "fp16": "Dtype::kF16"}[cfg.dtype]
        causal = "true" if cfg.causal else "false"
        lines.append(
            f'    {{"{cfg.name}", "{cfg.arch}", {dtype}, {cfg.head_dim}, {causal}, '
            f"{cfg.tile.m}, {cfg.tile.n}, &{cfg.name}::Load, &{cfg.name}::Launch}},"
        )
    lines.append("};")
    lines.append("const int kNumFwdKernels = sizeof(kFwdKernels) / sizeof(kFwdKernels[0]);")
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
    for name in names:
        keep = str(keep_root / name) if keep_root else None
        seconds = compile_one(by_name[name], str(out), keep)
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
