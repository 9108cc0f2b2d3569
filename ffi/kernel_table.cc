#include "kernel_table.h"

#include <atomic>
#include <cstring>
#include <mutex>

// The exported headers report module-load errors through this macro (default: printf).
// Record the first error instead, so the loader can return it to XLA.
static cudaError_t g_load_error = cudaSuccess;
#define CUTE_DSL_CUDA_ERROR_CHECK(err)                                        \
  {                                                                          \
    cudaError_t e_ = (err);                                                  \
    if (e_ != cudaSuccess && g_load_error == cudaSuccess) g_load_error = e_; \
  }

namespace jax_fa4 {
namespace {

// Called only with g_load_mutex held.
cudaError_t TakeLoadError() {
  cudaError_t e = g_load_error;
  g_load_error = cudaSuccess;
  return e;
}

// The export structs of a row-major (batch, seqlen, heads, head_dim) tensor with static
// head_dim and of a row-major (batch, heads, n) one: dynamic shapes and strides in mode
// order, the ABI kernels/export.py checks.
template <typename Tensor>
Tensor Bshd(void* data, int32_t batch, int32_t seqlen, int32_t heads, int64_t head_dim) {
  const int64_t row = heads * head_dim;
  return Tensor{data, {batch, seqlen, heads}, {seqlen * row, row}};
}

template <typename Tensor>
Tensor Bhn(void* data, int32_t batch, int32_t heads, int32_t n) {
  return Tensor{data, {batch, heads, n}, {int64_t{heads} * n, n}};
}

}  // namespace
}  // namespace jax_fa4

#include "kernel_table.inc"  // generated: includes every exported kernel header

namespace jax_fa4 {
namespace {

constexpr int kNumFwd = sizeof(kFwdKernels) / sizeof(kFwdKernels[0]);
constexpr int kNumBwd = sizeof(kBwdKernels) / sizeof(kBwdKernels[0]);

std::mutex g_load_mutex;
// Per kernel, forward ones first: -1 not loaded, otherwise the cudaError_t of its one
// load attempt.
std::atomic<int> g_load_state[kNumFwd + kNumBwd];
static_assert(ATOMIC_INT_LOCK_FREE == 2, "load state must be lock-free");

int SlotOf(const FwdKernel& kernel) { return static_cast<int>(&kernel - kFwdKernels); }
int SlotOf(const BwdKernel& kernel) {
  return kNumFwd + static_cast<int>(&kernel - kBwdKernels);
}

struct InitLoadState {
  InitLoadState() {
    for (auto& s : g_load_state) s.store(-1);
  }
} g_init_load_state;

cudaError_t EnsureLoadedAt(int slot, cudaError_t (*load)()) {
  std::atomic<int>& state = g_load_state[slot];
  int s = state.load(std::memory_order_acquire);
  if (s >= 0) return static_cast<cudaError_t>(s);
  std::lock_guard<std::mutex> lock(g_load_mutex);
  s = state.load(std::memory_order_relaxed);
  if (s < 0) {
    s = static_cast<int>(load());
    state.store(s, std::memory_order_release);
  }
  return static_cast<cudaError_t>(s);
}

bool IsLoadedAt(int slot) {
  return g_load_state[slot].load(std::memory_order_acquire) == cudaSuccess;
}

template <typename Args>
const Kernel<Args>* Find(const Kernel<Args>* table, int n, Dtype dtype, int head_dim,
                         int head_dim_v, bool causal, bool softcap, bool segments) {
  for (int i = 0; i < n; ++i) {
    const Kernel<Args>& k = table[i];
    if (k.dtype == dtype && k.head_dim == head_dim && k.head_dim_v == head_dim_v &&
        k.causal == causal &&
        k.softcap == softcap && k.segments == segments)
      return &k;
  }
  return nullptr;
}

}  // namespace

const char* DtypeName(Dtype dtype) { return dtype == Dtype::kBF16 ? "bf16" : "fp16"; }

const FwdKernel* FindFwdKernel(Dtype dtype, int head_dim, int head_dim_v, bool causal,
                               bool softcap, bool segments) {
  return Find(kFwdKernels, kNumFwdKernels, dtype, head_dim, head_dim_v, causal, softcap,
              segments);
}

const BwdKernel* FindBwdKernel(Dtype dtype, int head_dim, int head_dim_v, bool causal,
                               bool softcap, bool segments) {
  return Find(kBwdKernels, kNumBwdKernels, dtype, head_dim, head_dim_v, causal, softcap,
              segments);
}

BwdExtents WorkspaceExtents(const BwdKernel& kernel, int64_t seqlen_q) {
  const int64_t tiles = (seqlen_q + kernel.tile_m - 1) / kernel.tile_m;
  const int64_t sq_pad = tiles * kernel.tile_m;
  return {sq_pad, sq_pad * kernel.head_dim, tiles * kernel.dq_parts};
}

cudaError_t EnsureLoaded(const FwdKernel& kernel) {
  return EnsureLoadedAt(SlotOf(kernel), kernel.load);
}
cudaError_t EnsureLoaded(const BwdKernel& kernel) {
  return EnsureLoadedAt(SlotOf(kernel), kernel.load);
}

bool IsLoaded(const FwdKernel& kernel) { return IsLoadedAt(SlotOf(kernel)); }
bool IsLoaded(const BwdKernel& kernel) { return IsLoadedAt(SlotOf(kernel)); }

}  // namespace jax_fa4
