// XLA FFI handler `jax_fa4_bwd`: attention backward through an exported CuTe-DSL kernel
// (one entry point that launches preprocess, main and postprocess in order).
//
// Operands: q, out, dout (..., Sq, H, D) and k, v (..., Sk, H, D), bf16 or fp16 (one
// dtype), row-major; lse (..., H, Sq) fp32 from the forward and dlse, its cotangent
// (zeros when lse is not an output). Every leading dimension is folded into the batch.
// Results: dq, dk, dv like q, k, v, then the kernel's workspaces, which XLA allocates
// and the kernel initializes (never allocated or cleared here):
//   lse2, dsum (..., H, Sq_pad) fp32; dq_accum (..., H, Sq_pad * D) fp32;
//   sem (..., H, Sq_pad / tile_m * consumers) int32; Sq_pad = Sq rounded up to tile_m.
// Attributes: banded (bool: the banded kernel), softmax_scale (f32), deterministic
// (bool: dq accumulated in a fixed order, bitwise reproducible; otherwise with atomic
// adds), window_left / window_right / top_left (the band) and softcap, as for
// jax_fa4_fwd. Three more int32 operands after dlse select the segment variant, as for
// jax_fa4_fwd, with the backward's plan (..., key blocks, 1 + 2 * query tiles).
//
// Stages, as for jax_fa4_fwd: INITIALIZE checks the device and loads the selected
// kernel's module onto it (once per process and device, outside any CUDA-graph
// capture); EXECUTE only validates and launches on XLA's stream, so the handler is
// command-buffer compatible.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "handler_common.h"
#include "kernel_table.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_fa4 {
namespace {

struct BwdOperands {
  const ffi::AnyBuffer &q, &k, &v, &out, &dout, &lse, &dlse;

  std::string Describe() const {
    return Shapes({{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"dout", dout}, {"lse", lse},
                   {"dlse", dlse}});
  }
};

struct BwdProblem {
  const BwdKernel* kernel;
  int64_t batch, seqlen_q, seqlen_k, heads, head_dim, heads_kv, head_dim_v;
  size_t lead;  // leading (batch) dimensions, folded into `batch`
  BwdExtents workspace;
};

// Whether x has the dimensions lead ++ tail, where lead is the first `lead` of `ref`.
bool HasDims(const ffi::AnyBuffer& x, ffi::AnyBuffer::Dimensions ref, size_t lead,
             std::initializer_list<int64_t> tail) {
  auto dims = x.dimensions();
  if (dims.size() != lead + tail.size()) return false;
  for (size_t i = 0; i < lead; ++i)
    if (dims[i] != ref[i]) return false;
  size_t i = lead;
  for (int64_t extent : tail)
    if (dims[i++] != extent) return false;
  return true;
}

// Validates the operands and picks the kernel; shared by both stages.
ffi::ErrorOr<BwdProblem> Select(const BwdOperands& x, bool banded, float softcap,
                                bool segments) {
  auto qd = x.q.dimensions(), kd = x.k.dimensions(), vd = x.v.dimensions();
  const std::string shapes = x.Describe();
  if (qd.size() < 3 || kd.size() != qd.size() || vd.size() != qd.size())
    return ffi::Error::InvalidArgument("jax_fa4_bwd: q, k, v, out, dout must have the same "
                                       "rank >= 3 (..., S, H, D); got " + shapes);
  const size_t r = qd.size(), lead = r - 3;
  BwdProblem p{nullptr, 1, qd[r - 3], kd[r - 3], qd[r - 2],
               qd[r - 1], kd[r - 2], vd[r - 1], lead, {}};
  for (size_t i = 0; i < lead; ++i) p.batch *= qd[i];
  if (!GroupsHeads(p.heads, p.heads_kv))
    return ffi::Error::InvalidArgument("jax_fa4_bwd: the heads of k and v must divide the "
                                       "heads of q: " + shapes);
  const std::initializer_list<int64_t> o_tail = {p.seqlen_q, p.heads, p.head_dim_v};
  const std::initializer_list<int64_t> k_tail = {p.seqlen_k, p.heads_kv, p.head_dim};
  const std::initializer_list<int64_t> v_tail = {p.seqlen_k, p.heads_kv, p.head_dim_v};
  const std::initializer_list<int64_t> lse_tail = {p.heads, p.seqlen_q};
  if (!HasDims(x.k, qd, lead, k_tail) || !HasDims(x.v, qd, lead, v_tail) ||
      !HasDims(x.out, qd, lead, o_tail) || !HasDims(x.dout, qd, lead, o_tail) ||
      !HasDims(x.lse, qd, lead, lse_tail) || !HasDims(x.dlse, qd, lead, lse_tail))
    return ffi::Error::InvalidArgument("jax_fa4_bwd: operand shapes disagree; expected q "
                                       "(..., Sq, H, D), k (..., Sk, Hkv, D), v (..., Sk, Hkv, "
                                       "Dv), out, dout (..., Sq, H, Dv), lse, dlse (..., H, Sq): " +
                                       shapes);
  const ffi::DataType type = x.q.element_type();
  for (const ffi::AnyBuffer* b : {&x.k, &x.v, &x.out, &x.dout})
    if (b->element_type() != type)
      return ffi::Error::InvalidArgument("jax_fa4_bwd: q, k, v, out, dout dtypes differ: " +
                                         shapes);
  if (x.lse.element_type() != ffi::DataType::F32 || x.dlse.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("jax_fa4_bwd: lse and dlse must be f32: " + shapes);
  const std::optional<Dtype> dtype = KernelDtype(type);
  if (!dtype)
    return ffi::Error::InvalidArgument("jax_fa4_bwd: dtype must be bf16 or fp16: " + shapes);
  if (!ValidSoftcap(softcap, banded))
    return ffi::Error::InvalidArgument("jax_fa4_bwd: softcap must be finite and >= 0, and "
                                       "> 0 only with the banded kernel");
  KernelKey key{*dtype, *dtype, static_cast<int>(p.head_dim), static_cast<int>(p.head_dim_v)};
  key.banded = banded;
  key.softcap = softcap > 0.0f;
  key.segments = segments;
  p.kernel = FindBwdKernel(key);
  if (p.kernel == nullptr)
    return ffi::Error::InvalidArgument(std::string("jax_fa4_bwd: no kernel built for dtype ") +
                                       DtypeName(*dtype) + ", head_dim " +
                                       HeadDims(p.head_dim, p.head_dim_v) +
                                       (banded ? ", banded" : ", full") +
                                       (softcap > 0.0f ? ", softcap" : "") +
                                       (segments ? ", segments" : "") + ": " + shapes);
  p.workspace = WorkspaceExtents(*p.kernel, p.seqlen_q);
  return p;
}

// "" when result `name` has `type` (called `type_name`) and the dimensions lead ++ tail,
// else what it should be.
std::string ResultMismatch(const char* name, const ffi::AnyBuffer& result, ffi::DataType type,
                           const char* type_name, ffi::AnyBuffer::Dimensions ref,
                           const BwdProblem& p, std::initializer_list<int64_t> tail) {
  if (result.element_type() == type && HasDims(result, ref, p.lead, tail)) return "";
  std::string want = "(";
  for (size_t i = 0; i < p.lead; ++i) want += std::to_string(ref[i]) + ", ";
  size_t i = 0;
  for (int64_t extent : tail) want += (i++ ? ", " : "") + std::to_string(extent);
  return std::string("result ") + name + Dims(result.dimensions()) + " must have shape " +
         want + ") and dtype " + type_name;
}

ffi::Error BwdInitialize(int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer lse,
                         ffi::AnyBuffer dlse, ffi::RemainingArgs segments,
                         ffi::RemainingRets /*dq, ..., sem*/, bool banded,
                         float /*softmax_scale*/, bool /*deterministic*/,
                         int32_t /*window_left*/, int32_t /*window_right*/,
                         bool /*top_left*/, float softcap) {
  auto problem = Select({q, k, v, out, dout, lse, dlse}, banded, softcap, segments.size() > 0);
  if (problem.has_error()) return problem.error();
  return CheckDeviceAndLoad("jax_fa4_bwd", *problem->kernel, device);
}

ffi::Error BwdExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                      ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer dout,
                      ffi::AnyBuffer lse, ffi::AnyBuffer dlse, ffi::RemainingArgs segment_args,
                      ffi::Result<ffi::AnyBuffer> dq,
                      ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                      ffi::Result<ffi::AnyBuffer> lse2, ffi::Result<ffi::AnyBuffer> dsum,
                      ffi::Result<ffi::AnyBuffer> dq_accum, ffi::Result<ffi::AnyBuffer> sem,
                      bool banded, float softmax_scale, bool deterministic,
                      int32_t window_left, int32_t window_right, bool top_left,
                      float softcap) {
  const BwdOperands operands{q, k, v, out, dout, lse, dlse};
  auto problem = Select(operands, banded, softcap, segment_args.size() > 0);
  if (problem.has_error()) return problem.error();
  const BwdProblem& p = *problem;
  const std::string where = std::string("jax_fa4_bwd[") + p.kernel->name + "] " +
                            operands.Describe();
  const int64_t key_blocks = (p.seqlen_k + p.kernel->tile_n - 1) / p.kernel->tile_n;
  const int64_t q_tiles = (p.seqlen_q + p.kernel->tile_m - 1) / p.kernel->tile_m;
  auto segments = ReadSegments(where, segment_args, p.batch, p.seqlen_q, p.seqlen_k,
                               key_blocks, 1 + 2 * q_tiles);
  if (segments.has_error()) return segments.error();

  const auto qd = q.dimensions();
  const ffi::DataType type = q.element_type();
  const BwdExtents& w = p.workspace;
  const ffi::DataType f32 = ffi::DataType::F32, s32 = ffi::DataType::S32;
  const std::string mismatches[] = {
      ResultMismatch("dq", *dq, type, "of q", qd, p, {p.seqlen_q, p.heads, p.head_dim}),
      ResultMismatch("dk", *dk, type, "of q", qd, p, {p.seqlen_k, p.heads_kv, p.head_dim}),
      ResultMismatch("dv", *dv, type, "of q", qd, p, {p.seqlen_k, p.heads_kv, p.head_dim_v}),
      ResultMismatch("lse2", *lse2, f32, "f32", qd, p, {p.heads, w.sq_pad}),
      ResultMismatch("dsum", *dsum, f32, "f32", qd, p, {p.heads, w.sq_pad}),
      ResultMismatch("dq_accum", *dq_accum, f32, "f32", qd, p, {p.heads, w.dq_accum}),
      ResultMismatch("sem", *sem, s32, "s32", qd, p, {p.heads, w.sem}),
  };
  for (const std::string& mismatch : mismatches)
    if (!mismatch.empty()) return ffi::Error::InvalidArgument(where + ": " + mismatch);
  if (!(softmax_scale > 0.0f) || !std::isfinite(softmax_scale))
    return ffi::Error::InvalidArgument(where + ": softmax_scale must be finite and > 0");
  if (p.batch == 0 || p.heads == 0) return ffi::Error::Success();  // every buffer is empty
  if (p.seqlen_q == 0 || p.seqlen_k == 0)
    return ffi::Error::InvalidArgument(where + ": seqlen_q and seqlen_k must be >= 1 "
                                       "(handled in Python)");
  // Grids (tiles, heads, batch) and, for the main kernel, (key blocks, K/V heads,
  // batch); key blocks go along y only in launches of at most 64 of them (bwd.py
  // _launch_main). The export ABI and the kernels' key indices are int32, up to the last
  // block of a pair (an odd count gets an empty one), and so is dq_accum's extent
  // (Sq_pad * D).
  const int64_t padded_keys = (key_blocks + 1) / 2 * 2 * p.kernel->tile_n;
  if (p.batch > kMaxGridYZ || p.heads > kMaxGridYZ || padded_keys > kInt32Max ||
      w.dq_accum > kInt32Max)
    return ffi::Error::InvalidArgument(where + ": batch and heads must be <= 65535, seqlen_k "
                                       "rounded up to an even number of key blocks < 2^31, "
                                       "and padded seqlen_q * head_dim < 2^31");
  if (!TmaAligned({q.untyped_data(), k.untyped_data(), v.untyped_data(), out.untyped_data(),
                   dout.untyped_data(), lse.untyped_data(), dlse.untyped_data(),
                   dq->untyped_data(), dk->untyped_data(), dv->untyped_data(),
                   lse2->untyped_data(), dsum->untyped_data(), dq_accum->untyped_data(),
                   sem->untyped_data()}))
    return ffi::Error::InvalidArgument(where + ": buffers must be 16-byte aligned for TMA");
  if (!IsLoaded(*p.kernel, device))
    return ffi::Error::Internal(where + ": module not loaded onto device " +
                                std::to_string(device) + " (initialize stage did not run)");
  if (ffi::Error error = MakeCurrent(where, device); error.failure()) return error;

  // Deterministic calls without a band may shift their walks (kernels/sm90/bwd.py
  // _shift: 2), whose turns wait on every key block of a K/V head, not only on the ones
  // launched before it: only where all of a head's CTAs (a pair kernel's odd block
  // count rounded up) fit on the GPU at once, which half its SMs leave room for (2-CTA
  // clusters may not use every SM). That takes the reported SM count as available: MPS
  // or green contexts that leave a call less than half of them could hang it (README).
  int32_t order = 0;
  if (deterministic) {
    auto num_sms = SmCount(where, device);
    if (num_sms.has_error()) return num_sms.error();
    const int64_t head_ctas = key_blocks + 1;
    order = !banded && 2 * head_ctas <= int64_t{*num_sms} * p.kernel->ctas_per_sm ? 2 : 1;
  }
  const Band band = MakeBand(p.seqlen_q, p.seqlen_k, window_left, window_right, top_left);
  BwdArgs args{const_cast<void*>(q.untyped_data()),
               const_cast<void*>(k.untyped_data()),
               const_cast<void*>(v.untyped_data()),
               const_cast<void*>(out.untyped_data()),
               const_cast<void*>(dout.untyped_data()),
               const_cast<void*>(lse.untyped_data()),
               const_cast<void*>(dlse.untyped_data()),
               dq->untyped_data(),
               dk->untyped_data(),
               dv->untyped_data(),
               lse2->untyped_data(),
               dsum->untyped_data(),
               dq_accum->untyped_data(),
               sem->untyped_data(),
               static_cast<int32_t>(p.batch),
               static_cast<int32_t>(p.seqlen_q),
               static_cast<int32_t>(p.seqlen_k),
               static_cast<int32_t>(p.heads),
               static_cast<int32_t>(p.heads_kv),
               static_cast<int32_t>(w.sq_pad),
               static_cast<int32_t>(w.dq_accum),
               static_cast<int32_t>(w.sem),
               softmax_scale * kLog2e,
               softmax_scale,
               order,
               band.lo,
               band.hi,
               SoftcapScale(softmax_scale, softcap)};
  segments->Into(args);
  return LaunchResult(where, p.kernel->launch(args, stream));
}

}  // namespace
}  // namespace jax_fa4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4BwdInitialize, jax_fa4::BwdInitialize,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::DeviceOrdinal>()  // device XLA runs on
                                  .Arg<ffi::AnyBuffer>()      // q
                                  .Arg<ffi::AnyBuffer>()      // k
                                  .Arg<ffi::AnyBuffer>()      // v
                                  .Arg<ffi::AnyBuffer>()      // out
                                  .Arg<ffi::AnyBuffer>()      // dout
                                  .Arg<ffi::AnyBuffer>()      // lse
                                  .Arg<ffi::AnyBuffer>()      // dlse
                                  .RemainingArgs()            // segments: select the kernel
                                  .RemainingRets()            // dq, ..., sem: not touched
                                  .Attr<bool>("banded")       // selects the kernel
                                  .Attr<float>("softmax_scale")  // unused here
                                  .Attr<bool>("deterministic")    // unused here
                                  .Attr<int32_t>("window_left")   // unused here
                                  .Attr<int32_t>("window_right")  // unused here
                                  .Attr<bool>("top_left")         // unused here
                                  .Attr<float>("softcap"));       // selects the kernel

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4BwdExecute, jax_fa4::BwdExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()  // device XLA runs on
                                  .Arg<ffi::AnyBuffer>()      // q (..., Sq, H, D)
                                  .Arg<ffi::AnyBuffer>()      // k (..., Sk, H, D)
                                  .Arg<ffi::AnyBuffer>()      // v (..., Sk, H, D)
                                  .Arg<ffi::AnyBuffer>()      // out (..., Sq, H, D)
                                  .Arg<ffi::AnyBuffer>()      // dout (..., Sq, H, D)
                                  .Arg<ffi::AnyBuffer>()      // lse (..., H, Sq) f32
                                  .Arg<ffi::AnyBuffer>()      // dlse (..., H, Sq) f32
                                  .RemainingArgs()            // segments: rows, keys, plan
                                  .Ret<ffi::AnyBuffer>()      // dq (..., Sq, H, D)
                                  .Ret<ffi::AnyBuffer>()      // dk (..., Sk, Hkv, D)
                                  .Ret<ffi::AnyBuffer>()      // dv (..., Sk, Hkv, D)
                                  .Ret<ffi::AnyBuffer>()      // lse2 (..., H, Sq_pad) f32
                                  .Ret<ffi::AnyBuffer>()      // dsum (..., H, Sq_pad) f32
                                  .Ret<ffi::AnyBuffer>()      // dq_accum (..., H, Sq_pad*D) f32
                                  .Ret<ffi::AnyBuffer>()      // sem (..., H, n) s32
                                  .Attr<bool>("banded")
                                  .Attr<float>("softmax_scale")
                                  .Attr<bool>("deterministic")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<bool>("top_left")
                                  .Attr<float>("softcap"),
                              {ffi::Traits::kCmdBufferCompatible});
