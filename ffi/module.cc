// The native module jax_fa4._ffi: hands the FFI handlers to Python as capsules and
// describes the kernels that were built. Python registers the handlers with XLA
// (jax_fa4/_registry.py); nothing here runs on the GPU.

#include <nanobind/nanobind.h>

#include "kernel_table.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* JaxFa4FwdInitialize(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* JaxFa4FwdExecute(XLA_FFI_CallFrame*);

namespace nb = nanobind;

namespace {

nb::capsule Handler(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "jax_fa4 native module: XLA FFI handlers and the kernel manifest.";

  m.def("registrations", [] {
    nb::dict fwd;
    fwd["initialize"] = Handler(JaxFa4FwdInitialize);
    fwd["execute"] = Handler(JaxFa4FwdExecute);
    nb::dict targets;
    targets["jax_fa4_fwd"] = fwd;
    return targets;
  }, "FFI target name -> {stage: handler capsule}, for jax.ffi.register_ffi_target.");

  m.def("manifest", [] {
    nb::list kernels;
    for (int i = 0; i < jax_fa4::kNumFwdKernels; ++i) {
      const jax_fa4::FwdKernel& k = jax_fa4::kFwdKernels[i];
      nb::dict e;
      e["name"] = k.name;
      e["kind"] = "fwd";
      e["arch"] = k.arch;
      e["dtype"] = jax_fa4::DtypeName(k.dtype);
      e["head_dim"] = k.head_dim;
      e["causal"] = k.causal;
      e["tile_m"] = k.tile_m;
      e["tile_n"] = k.tile_n;
      kernels.append(e);
    }
    return kernels;
  }, "One dict per compiled kernel (name, kind, arch, dtype, head_dim, causal, tiles).");
}
