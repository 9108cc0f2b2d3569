// The native module jax_fa4._ffi: hands the FFI handlers to Python as capsules and
// describes the kernels that were built. Python registers the handlers with XLA
// (jax_fa4/_registry.py); nothing here runs on the GPU.

#include <nanobind/nanobind.h>

#include "kernel_table.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* JaxFa4FwdInitialize(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* JaxFa4FwdExecute(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* JaxFa4FwdFp8Initialize(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* JaxFa4FwdFp8Execute(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* JaxFa4BwdInitialize(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* JaxFa4BwdExecute(XLA_FFI_CallFrame*);

namespace nb = nanobind;

namespace {

using Handler = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);

nb::dict Stages(Handler initialize, Handler execute) {
  nb::dict stages;
  stages["initialize"] = nb::capsule(reinterpret_cast<void*>(initialize));
  stages["execute"] = nb::capsule(reinterpret_cast<void*>(execute));
  return stages;
}

template <typename Args>
void AppendEntries(nb::list& kernels, const jax_fa4::Kernel<Args>* table, int n,
                   const char* kind) {
  for (int i = 0; i < n; ++i) {
    const jax_fa4::Kernel<Args>& k = table[i];
    nb::dict e;
    e["name"] = k.name;
    e["kind"] = kind;
    e["arch"] = k.arch;
    e["dtype"] = jax_fa4::DtypeName(k.dtype);
    e["kv_dtype"] = jax_fa4::DtypeName(k.kv_dtype);
    e["head_dim"] = k.head_dim;
    e["head_dim_v"] = k.head_dim_v;
    e["banded"] = k.banded;
    e["softcap"] = k.softcap;
    e["segments"] = k.segments;
    e["split"] = k.split;
    e["paged"] = k.paged;
    e["keys_as_m"] = k.keys_as_m;
    e["long_rows"] = k.long_rows;
    e["tile_m"] = k.tile_m;
    e["tile_n"] = k.tile_n;
    e["ctas_per_sm"] = k.ctas_per_sm;
    if (k.dq_parts > 0) e["dq_parts"] = k.dq_parts;
    kernels.append(e);
  }
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "jax_fa4 native module: XLA FFI handlers and the kernel manifest.";

  m.def("registrations", [] {
    nb::dict targets;
    targets["jax_fa4_fwd"] = Stages(JaxFa4FwdInitialize, JaxFa4FwdExecute);
    targets["jax_fa4_fwd_fp8"] = Stages(JaxFa4FwdFp8Initialize, JaxFa4FwdFp8Execute);
    targets["jax_fa4_bwd"] = Stages(JaxFa4BwdInitialize, JaxFa4BwdExecute);
    return targets;
  }, "FFI target name -> {stage: handler capsule}, for jax.ffi.register_ffi_target.");

  m.def("manifest", [] {
    nb::list kernels;
    AppendEntries(kernels, jax_fa4::kFwdKernels, jax_fa4::kNumFwdKernels, "fwd");
    AppendEntries(kernels, jax_fa4::kBwdKernels, jax_fa4::kNumBwdKernels, "bwd");
    return kernels;
  }, "One dict per compiled kernel (name, kind, arch, dtype, head_dim, head_dim_v, banded, softcap, segments, tiles).");
}
