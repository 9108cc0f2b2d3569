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

}  // namespace
}  // namespace jax_fa4

#include "kernel_table.inc"  // generated: includes every exported kernel header

namespace jax_fa4 {
namespace {

std::mutex g_load_mutex;
constexpr int kMaxKernels = 256;
// Per kernel: -1 not loaded, otherwise the cudaError_t of its one load attempt.
std::atomic<int> g_load_state[kMaxKernels];
static_assert(ATOMIC_INT_LOCK_FREE == 2, "load state must be lock-free");

int IndexOf(const FwdKernel& kernel) { return static_cast<int>(&kernel - kFwdKernels); }

struct InitLoadState {
  InitLoadState() {
    for (auto& s : g_load_state) s.store(-1);
  }
} g_init_load_state;

}  // namespace

const char* DtypeName(Dtype dtype) { return dtype == Dtype::kBF16 ? "bf16" : "fp16"; }

const FwdKernel* FindFwdKernel(Dtype dtype, int head_dim, bool causal) {
  for (int i = 0; i < kNumFwdKernels; ++i) {
    const FwdKernel& k = kFwdKernels[i];
    if (k.dtype == dtype && k.head_dim == head_dim && k.causal == causal) return &k;
  }
  return nullptr;
}

cudaError_t EnsureLoaded(const FwdKernel& kernel) {
  static_assert(sizeof(kFwdKernels) / sizeof(kFwdKernels[0]) <= kMaxKernels);
  std::atomic<int>& state = g_load_state[IndexOf(kernel)];
  int s = state.load(std::memory_order_acquire);
  if (s >= 0) return static_cast<cudaError_t>(s);
  std::lock_guard<std::mutex> lock(g_load_mutex);
  s = state.load(std::memory_order_relaxed);
  if (s < 0) {
    s = static_cast<int>(kernel.load());
    state.store(s, std::memory_order_release);
  }
  return static_cast<cudaError_t>(s);
}

bool IsLoaded(const FwdKernel& kernel) {
  return g_load_state[IndexOf(kernel)].load(std::memory_order_acquire) == cudaSuccess;
}

}  // namespace jax_fa4
