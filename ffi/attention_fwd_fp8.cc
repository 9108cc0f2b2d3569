// XLA FFI handler `jax_fa4_fwd_fp8`: the float8 (e4m3) attention forward.
//
// Operands: q (..., Sq, H, D) and k (..., Sk, Hkv, D) float8_e4m3fn, row-major; vt
// (..., Hkv, Dv, Skp) float8_e4m3fn, V transposed with Skp >= Sk keys a multiple of 32,
// the keys past Sk zero and each 32 keys in the order of jax_fa4/_float8.py
// transposed_v (the kernel's P registers'); descale (3, Hkv) float32, the q, k and v
// descales of each K/V head. Every leading dimension is folded into the batch. Results:
// out (..., Sq, H, Dv) bf16, lse (..., H, Sq) fp32 (of the dequantized scores) and
// the "dynamic" schedule's tile counter (1,) int32, as for jax_fa4_fwd. Attributes: banded, softmax_scale, window_left, window_right, top_left, as for
// jax_fa4_fwd.
//
// Stages as jax_fa4_fwd's: INITIALIZE checks the device and loads the kernel's module;
// EXECUTE only launches on XLA's stream (command-buffer compatible).

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "handler_common.h"
#include "kernel_table.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fa4 {
namespace {

// Skp: whole 32-key groups of the key order (and 16-byte row strides for TMA).
constexpr int64_t kKeyAlign = 32;

struct Fp8Problem {
  const FwdKernel* kernel;
  int64_t batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, padded_keys;
};

ffi::ErrorOr<Fp8Problem> Select(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                const ffi::AnyBuffer& vt, const ffi::AnyBuffer& descale,
                                bool banded) {
  const std::string shapes =
      Shapes({{"q", q}, {"k", k}, {"vt", vt}, {"descale", descale}});
  const std::string where = "jax_fa4_fwd_fp8: ";
  auto qd = q.dimensions(), kd = k.dimensions(), vd = vt.dimensions();
  auto dd = descale.dimensions();
  const size_t r = qd.size();
  if (r < 3 || kd.size() != r || vd.size() != r || dd.size() != 2)
    return ffi::Error::InvalidArgument(where + "q, k (..., S, H, D) and vt (..., Hkv, Dv, "
                                       "Skp) must share a rank >= 3, descale be (3, Hkv); "
                                       "got " + shapes);
  for (auto type : {q.element_type(), k.element_type(), vt.element_type()})
    if (type != ffi::DataType::F8E4M3FN)
      return ffi::Error::InvalidArgument(where + "q, k, vt must be float8_e4m3fn: " + shapes);
  if (descale.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(where + "descale must be float32: " + shapes);
  int64_t batch = 1;
  for (size_t i = 0; i + 3 < r; ++i) {
    if (kd[i] != qd[i] || vd[i] != qd[i])
      return ffi::Error::InvalidArgument(where + "leading (batch) dims differ: " + shapes);
    batch *= qd[i];
  }
  Fp8Problem p{nullptr, batch, qd[r - 3], kd[r - 3], qd[r - 2], kd[r - 2], qd[r - 1],
               vd[r - 1]};
  if (kd[r - 1] != p.head_dim || vd[r - 3] != p.heads_kv || vd[r - 2] != p.head_dim ||
      dd[0] != 3 || dd[1] != p.heads_kv)
    return ffi::Error::InvalidArgument(where + "heads or head dims of q, k, vt, descale "
                                       "disagree (D = Dv): " + shapes);
  if (p.padded_keys < p.seqlen_k || p.padded_keys % kKeyAlign != 0)
    return ffi::Error::InvalidArgument(where + "vt's keys must cover k's and be a multiple "
                                       "of " + std::to_string(kKeyAlign) + ": " + shapes);
  if (!GroupsHeads(p.heads, p.heads_kv))
    return ffi::Error::InvalidArgument(where + "the heads of k must divide the heads of q: " +
                                       shapes);
  KernelKey key{Dtype::kE4M3, Dtype::kE4M3, static_cast<int>(p.head_dim),
                static_cast<int>(p.head_dim)};
  key.banded = banded;
  p.kernel = FindFwdKernel(key);
  if (p.kernel == nullptr)
    return ffi::Error::InvalidArgument(where + "no kernel built for head_dim " +
                                       std::to_string(p.head_dim) +
                                       (banded ? ", banded: " : ", full: ") + shapes);
  return p;
}

ffi::Error Fp8Initialize(int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer vt,
                         ffi::AnyBuffer descale, ffi::RemainingRets /*results*/, bool banded,
                         float /*softmax_scale*/, int32_t /*window_left*/,
                         int32_t /*window_right*/, bool /*top_left*/) {
  auto problem = Select(q, k, vt, descale, banded);
  if (problem.has_error()) return problem.error();
  return CheckDeviceAndLoad("jax_fa4_fwd_fp8", *problem->kernel, device);
}

ffi::Error Fp8Execute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                      ffi::AnyBuffer vt, ffi::AnyBuffer descale,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                      ffi::Result<ffi::Buffer<ffi::S32>> tile_counter, bool banded,
                      float softmax_scale, int32_t window_left, int32_t window_right,
                      bool top_left) {
  auto problem = Select(q, k, vt, descale, banded);
  if (problem.has_error()) return problem.error();
  const Fp8Problem p = *problem;
  const std::string where = std::string("jax_fa4_fwd_fp8[") + p.kernel->name + "] " +
                            Shapes({{"q", q}, {"k", k}, {"vt", vt}});
  if (out->element_type() != ffi::DataType::BF16 ||
      static_cast<int64_t>(out->element_count()) !=
          p.batch * p.seqlen_q * p.heads * p.head_dim ||
      static_cast<int64_t>(lse->element_count()) != p.batch * p.heads * p.seqlen_q ||
      tile_counter->element_count() < 1)
    return ffi::Error::InvalidArgument(where + ": out must be bf16 like q, lse (..., H, Sq)");
  if (!(softmax_scale > 0.0f) || !std::isfinite(softmax_scale))
    return ffi::Error::InvalidArgument(where + ": softmax_scale must be finite and > 0");
  if (p.batch == 0 || p.heads == 0 || p.seqlen_q == 0) return ffi::Error::Success();
  if (p.seqlen_k == 0)
    return ffi::Error::InvalidArgument(where + ": seqlen_k must be >= 1 (handled in Python)");
  if (p.batch > kMaxGridYZ || p.heads > kMaxGridYZ || p.seqlen_q > kInt32Max ||
      p.heads_kv * p.head_dim * p.padded_keys > kInt32Max)
    return ffi::Error::InvalidArgument(where + ": batch and heads must be <= 65535, Sq < "
                                       "2^31 and Hkv * Dv * Skp < 2^31");
  if (!TmaAligned({q.untyped_data(), k.untyped_data(), vt.untyped_data(),
                   out->untyped_data(), lse->typed_data()}))
    return ffi::Error::InvalidArgument(where + ": buffers must be 16-byte aligned for TMA");
  auto num_sms = PrepareForwardLaunch(where, *p.kernel, device, stream,
                                      tile_counter->typed_data());
  if (num_sms.has_error()) return num_sms.error();

  const Band band = MakeBand(p.seqlen_q, p.seqlen_k, window_left, window_right, top_left);
  FwdArgs args = ForwardArgs(p, q.untyped_data(), k.untyped_data(), vt.untyped_data(),
                             out->untyped_data(), lse->typed_data(), softmax_scale, band,
                             1.0f);
  args.num_splits = 1;
  args.split_batch = static_cast<int32_t>(p.batch);
  args.unpack_group = 1;
  args.num_sms = *num_sms;
  args.tile_counter = tile_counter->typed_data();
  args.v_rows = static_cast<int32_t>(p.heads_kv * p.head_dim);
  args.v_keys = static_cast<int32_t>(p.padded_keys);
  args.descale = const_cast<void*>(descale.untyped_data());
  return LaunchResult(where, p.kernel->launch(args, stream));
}

}  // namespace
}  // namespace jax_fa4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4FwdFp8Initialize, jax_fa4::Fp8Initialize,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // vt
                                  .Arg<ffi::AnyBuffer>()  // descale
                                  .RemainingRets()        // results: not touched
                                  .Attr<bool>("banded")   // selects the kernel
                                  .Attr<float>("softmax_scale")   // unused here
                                  .Attr<int32_t>("window_left")   // unused here
                                  .Attr<int32_t>("window_right")  // unused here
                                  .Attr<bool>("top_left"));       // unused here

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4FwdFp8Execute, jax_fa4::Fp8Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q (..., Sq, H, D)
                                  .Arg<ffi::AnyBuffer>()  // k (..., Sk, Hkv, D)
                                  .Arg<ffi::AnyBuffer>()  // vt (..., Hkv, Dv, Skp)
                                  .Arg<ffi::AnyBuffer>()  // descale (3, Hkv)
                                  .Ret<ffi::AnyBuffer>()  // out (..., Sq, H, Dv) bf16
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse (..., H, Sq)
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tile counter (1,)
                                  .Attr<bool>("banded")
                                  .Attr<float>("softmax_scale")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<bool>("top_left"),
                              {ffi::Traits::kCmdBufferCompatible});
