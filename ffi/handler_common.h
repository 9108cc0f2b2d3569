// What the attention handlers share: shape text for errors, CUDA errors as ffi::Error,
// the dtype mapping, the device check of the initialize stage and the launch-time
// checks of the execute stage.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>

#include "kernel_table.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fa4 {

namespace ffi = xla::ffi;

constexpr int kTmaAlignBytes = 16;
constexpr int kMaxGridYZ = 65535;  // grids are (tiles, heads, batch)
constexpr int kHopperMajor = 9;
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr float kLog2e = 1.4426950408889634f;
// Split-KV: at most this many splits of a tile's key blocks (jax_fa4/_split_kv.py).
constexpr int32_t kMaxSplits = 128;

// The band lo <= j - i <= hi of the banded kernels (kernels/sm90/mask.py): the
// alignment offset (bottom-right Sk - Sq, top-left 0) minus the window's left side and
// plus its right side, a side < 0 being unbounded; clamped to +-kBandLimit, beyond any
// j - i of sequences a GPU holds (mask.BAND_LIMIT).
constexpr int64_t kBandLimit = int64_t{1} << 30;
struct Band {
  int32_t lo, hi;
};
inline Band MakeBand(int64_t seqlen_q, int64_t seqlen_k, int64_t left, int64_t right,
                     bool top_left) {
  const int64_t offset = top_left ? 0 : seqlen_k - seqlen_q;
  auto clamp = [](int64_t x) {
    return static_cast<int32_t>(std::clamp(x, -kBandLimit, kBandLimit));
  };
  return {left < 0 ? clamp(-kBandLimit) : clamp(offset - left),
          right < 0 ? clamp(kBandLimit) : clamp(offset + right)};
}

// Softcap kernels take softmax_scale / softcap (kernels/sm90/softcap.py); softcap 0
// means none. Valid: finite and >= 0, and > 0 only with the banded kernel (the one
// variant built with softcap).
inline bool ValidSoftcap(float softcap, bool banded) {
  return std::isfinite(softcap) && softcap >= 0.0f && (softcap == 0.0f || banded);
}
inline float SoftcapScale(float softmax_scale, float softcap) {
  return softcap > 0.0f ? softmax_scale / softcap : 1.0f;
}

// GQA/MQA: every group of heads / heads_kv query heads shares one key/value head.
inline bool GroupsHeads(int64_t heads, int64_t heads_kv) {
  return heads_kv > 0 ? heads % heads_kv == 0 : heads == 0;
}

inline std::string Dims(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + ")";
}

// "D", or "D / Dv" when v's head_dim differs from q's and k's.
inline std::string HeadDims(int64_t head_dim, int64_t head_dim_v) {
  return std::to_string(head_dim) +
         (head_dim_v == head_dim ? "" : " / " + std::to_string(head_dim_v));
}

struct Named {
  const char* name;
  const ffi::AnyBuffer& buffer;
};

// "q(2, 17, 4, 64) k(...) ..." for error messages.
inline std::string Shapes(std::initializer_list<Named> buffers) {
  std::string s;
  for (const Named& b : buffers) {
    s += (s.empty() ? "" : " ") + std::string(b.name) + Dims(b.buffer.dimensions());
  }
  return s;
}

// Also reads (so clears) the thread's last CUDA error: left set, the next call's launch
// check (LaunchResult) would report it as its own.
inline ffi::Error CudaError(const std::string& what, cudaError_t e) {
  cudaGetLastError();
  return ffi::Error::Internal(what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

// The kernels' dtype for an operand element type; nullopt when no kernel takes it.
inline std::optional<Dtype> KernelDtype(ffi::DataType type) {
  if (type == ffi::DataType::BF16) return Dtype::kBF16;
  if (type == ffi::DataType::F16) return Dtype::kF16;
  return std::nullopt;
}

// Initialize stage: `device` must be the Hopper GPU the kernel is built for; then its
// module is loaded onto it (once per process and device, outside any CUDA-graph
// capture).
template <typename Args>
ffi::Error CheckDeviceAndLoad(const std::string& handler, const Kernel<Args>& kernel,
                              int32_t device) {
  int major = 0, minor = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (e != cudaSuccess) return CudaError(handler + ": querying device " + std::to_string(device), e);
  if (major != kHopperMajor)
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      handler + ": kernel " + kernel.name + " is built for " + kernel.arch +
                          " (Hopper); device " + std::to_string(device) + " is sm_" +
                          std::to_string(major) + std::to_string(minor));
  if (device >= kMaxDevices)
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      handler + ": device " + std::to_string(device) + " is beyond the " +
                          std::to_string(kMaxDevices) + " devices kernels can be loaded onto "
                          "(kMaxDevices, ffi/kernel_table.h)");
  e = EnsureLoaded(kernel, device);
  if (e != cudaSuccess)
    return CudaError(handler + ": loading " + kernel.name + " onto device " +
                         std::to_string(device), e);
  return ffi::Error::Success();
}

// The device's SM count: persistent forward kernels launch at most one CTA per SM. A
// device attribute, not a stream operation: safe inside a CUDA-graph capture.
inline ffi::ErrorOr<int32_t> SmCount(const std::string& where, int32_t device) {
  int sms = 0;
  cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return CudaError(where + ": querying the SM count", e);
  return static_cast<int32_t>(sms);
}

// TMA needs every global buffer 16-byte aligned.
inline bool TmaAligned(std::initializer_list<const void*> buffers) {
  for (const void* ptr : buffers)
    if (reinterpret_cast<uintptr_t>(ptr) % kTmaAlignBytes != 0) return false;
  return true;
}

// The exported wrapper launches through this library's static cudart: make XLA's
// device current. cudaGetDevice/cudaSetDevice are capture-safe, unlike
// cudaStreamGetDevice.
inline ffi::Error MakeCurrent(const std::string& where, int32_t device) {
  int current = -1;
  cudaError_t e = cudaGetDevice(&current);
  if (e == cudaSuccess && current != device) e = cudaSetDevice(device);
  if (e != cudaSuccess) return CudaError(where + ": selecting device " + std::to_string(device), e);
  return ffi::Error::Success();
}

// The forward handlers' last steps before a launch: the kernel must be loaded onto
// `device` (by the initialize stage), which is made current; a "dynamic" kernel's tile
// counter is zeroed on the stream (a memset node under CUDA-graph capture, like the
// launch after it). Returns the device's SM count, which persistent kernels size their
// grid by.
inline ffi::ErrorOr<int32_t> PrepareForwardLaunch(const std::string& where,
                                                  const FwdKernel& kernel, int32_t device,
                                                  cudaStream_t stream, int32_t* tile_counter) {
  if (!IsLoaded(kernel, device))
    return ffi::Error::Internal(where + ": module not loaded onto device " +
                                std::to_string(device) + " (initialize stage did not run)");
  if (ffi::Error error = MakeCurrent(where, device); error.failure()) return error;
  auto num_sms = SmCount(where, device);
  if (num_sms.has_error()) return num_sms.error();
  if (kernel.dynamic) {
    cudaError_t e = cudaMemsetAsync(tile_counter, 0, sizeof(int32_t), stream);
    if (e != cudaSuccess) return CudaError(where + ": zeroing the tile counter", e);
  }
  return num_sms;
}

// The fields every forward launch fills: its buffers, sizes (`p`: a handler's problem),
// the softmax scale in log2 units, the band and the softcap scale; the others stay zero
// for the handler to set.
template <typename Problem>
FwdArgs ForwardArgs(const Problem& p, const void* q, const void* k, const void* v, void* o,
                    float* lse, float softmax_scale, const Band& band, float softcap_scale) {
  FwdArgs args{};
  args.q = const_cast<void*>(q);
  args.k = const_cast<void*>(k);
  args.v = const_cast<void*>(v);
  args.o = o;
  args.lse = lse;
  args.batch = static_cast<int32_t>(p.batch);
  args.seqlen_q = static_cast<int32_t>(p.seqlen_q);
  args.seqlen_k = static_cast<int32_t>(p.seqlen_k);
  args.heads = static_cast<int32_t>(p.heads);
  args.heads_kv = static_cast<int32_t>(p.heads_kv);
  args.scale_log2 = softmax_scale * kLog2e;
  args.band_lo = band.lo;
  args.band_hi = band.hi;
  args.softcap_scale = softcap_scale;
  return args;
}

// A launch adapter's status (0 or a cudaError_t) and any launch error the wrapper did not
// return, which cudaGetLastError reports.
inline ffi::Error LaunchResult(const std::string& where, int32_t ret) {
  if (ret != 0) return CudaError(where + ": launch", static_cast<cudaError_t>(ret));
  cudaError_t e = cudaPeekAtLastError();
  if (e != cudaSuccess) return CudaError(where + ": launch", e);
  return ffi::Error::Success();
}

// The segment kernels' operands (kernels/sm90/segments.py), after the handler's fixed
// ones: rows (..., 3, Sq), keys (..., Sk), plan (..., tiles, len), all int32, leading
// dimensions folded into `batch` as for q. None given: a kernel without segments.
struct Segments {
  bool given = false;
  void *rows = nullptr, *keys = nullptr, *plan = nullptr;
  int64_t tiles = 0, len = 0;

  // Fills the segment fields of FwdArgs or BwdArgs.
  template <typename Args>
  void Into(Args& args) const {
    args.q_rows = rows;
    args.k_ids = keys;
    args.plan = plan;
    args.plan_tiles = static_cast<int32_t>(tiles);
    args.plan_len = static_cast<int32_t>(len);
  }
};

// `tiles` and `len` are what the kernel's tile sizes require of the plan; a mismatch is
// an error, since the kernel indexes the plan with them.
// `extra` more operands may follow them (the forward's page table), and after those
// `trailing` ones that are not counted here (the forward's descales).
inline ffi::ErrorOr<Segments> ReadSegments(const std::string& handler,
                                           const ffi::RemainingArgs& rest, int64_t batch,
                                           int64_t seqlen_q, int64_t seqlen_k, int64_t tiles,
                                           int64_t len, size_t extra = 0,
                                           size_t trailing = 0) {
  Segments s;
  const size_t given = rest.size() - trailing;
  if (given == 0) return s;
  if (given != 3 + extra)
    return ffi::Error::InvalidArgument(handler + ": expected 0 or " + std::to_string(3 + extra) +
                                       " operands after the fixed ones (rows, keys, plan" +
                                       (extra ? ", page table" : "") + "); got " +
                                       std::to_string(given));
  const char* names[] = {"rows", "keys", "plan"};
  const int64_t counts[] = {batch * 3 * seqlen_q, batch * seqlen_k, batch * tiles * len};
  const int64_t lasts[] = {seqlen_q, seqlen_k, len};
  void* data[3];
  for (size_t i = 0; i < 3; ++i) {
    auto buffer = rest.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    auto dims = buffer->dimensions();
    if (buffer->element_type() != ffi::DataType::S32 || dims.size() == 0 ||
        dims.back() != lasts[i] || static_cast<int64_t>(buffer->element_count()) != counts[i])
      return ffi::Error::InvalidArgument(
          handler + ": segment operand " + names[i] + Dims(dims) + " must be int32 with " +
          std::to_string(counts[i]) + " elements, last dimension " + std::to_string(lasts[i]));
    data[i] = buffer->untyped_data();
  }
  s.given = true;
  s.rows = data[0];
  s.keys = data[1];
  s.plan = data[2];
  s.tiles = tiles;
  s.len = len;
  return s;
}

}  // namespace jax_fa4
