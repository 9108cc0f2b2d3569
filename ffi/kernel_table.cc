#include "kernel_table.h"

#include <atomic>
#include <mutex>

namespace jax_fa4 {
namespace {

// The export's module entry points _mlir_<name>_cuda_init and
// _mlir_<name>_cuda_load_to_device take MLIR packed arguments: a pointer to each
// argument, then one to the cudaError_t they return (kernels/export.py checks the
// header's argument structs against these two).
using PackedEntry = void (*)(void**);

// Loads the kernel's library (cudaLibraryLoadData) into *library. Context-free: once
// per process serves every device.
cudaError_t InitLibrary(PackedEntry init, cudaLibrary_t* library) {
  cudaError_t ret = cudaSuccess;
  void* args[] = {&library, &ret};
  init(args);
  return ret;
}

// Resolves the library's kernel and sets its attributes (opt-in shared memory,
// non-portable cluster size) for `device` only. Every call names the device, so no
// cudaSetDevice is needed.
cudaError_t LoadToDevice(PackedEntry load, cudaLibrary_t* library, int32_t device) {
  cudaError_t ret = cudaSuccess;
  void* args[] = {&library, &device, &ret};
  load(args);
  return ret;
}

// The export structs of a row-major (batch, seqlen, heads, head_dim) tensor with static
// head_dim and of a row-major (batch, heads, n) one: dynamic shapes and strides in mode
// order, the ABI kernels/export.py checks.
template <typename Tensor>
Tensor Bshd(void* data, int32_t batch, int32_t seqlen, int32_t heads, int64_t head_dim) {
  const int64_t row = heads * head_dim;
  return Tensor{data, {batch, seqlen, heads}, {seqlen * row, row}};
}

// The same with every stride given (elements; batch, seqlen, heads): a view that is not
// row-major, as the split kernels take q (FwdArgs q_strides).
template <typename Tensor>
Tensor BshdStrided(void* data, int32_t batch, int32_t seqlen, int32_t heads,
                   const int64_t (&strides)[3]) {
  return Tensor{data, {batch, seqlen, heads}, {strides[0], strides[1], strides[2]}};
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

// Loads of every kernel and device take this lock: load_to_device stores the kernel's
// handle in a global of its object each time, and loads are rare (initialize stages).
std::mutex g_load_mutex;
// Results stored as 1 + cudaError_t, so that the zero of static storage means "not
// tried yet". Per kernel, forward ones first: its one library init (under the lock),
// and its one load per device (read without the lock by IsLoaded).
int g_init_state[kNumFwd + kNumBwd];
std::atomic<int> g_load_state[kNumFwd + kNumBwd][kMaxDevices];
static_assert(ATOMIC_INT_LOCK_FREE == 2, "load state must be lock-free");

int Stored(cudaError_t e) { return 1 + static_cast<int>(e); }
cudaError_t Result(int stored) { return static_cast<cudaError_t>(stored - 1); }

int SlotOf(const FwdKernel& kernel) { return static_cast<int>(&kernel - kFwdKernels); }
int SlotOf(const BwdKernel& kernel) {
  return kNumFwd + static_cast<int>(&kernel - kBwdKernels);
}

bool ValidDevice(int32_t device) { return device >= 0 && device < kMaxDevices; }

template <typename Args>
cudaError_t EnsureLoadedAt(int slot, const Kernel<Args>& kernel, int32_t device) {
  if (!ValidDevice(device)) return cudaErrorInvalidDevice;
  std::atomic<int>& state = g_load_state[slot][device];
  if (int s = state.load(std::memory_order_acquire)) return Result(s);
  std::lock_guard<std::mutex> lock(g_load_mutex);
  if (int s = state.load(std::memory_order_relaxed)) return Result(s);
  int& init = g_init_state[slot];
  if (!init) init = Stored(kernel.init());
  // A failed init is the process's (cached above), not this device's: state stays 0.
  if (Result(init) != cudaSuccess) return Result(init);
  const cudaError_t e = kernel.load(device);
  state.store(Stored(e), std::memory_order_release);
  return e;
}

bool IsLoadedAt(int slot, int32_t device) {
  return ValidDevice(device) &&
         Result(g_load_state[slot][device].load(std::memory_order_acquire)) == cudaSuccess;
}

template <typename Args>
const Kernel<Args>* Find(const Kernel<Args>* table, int n, const KernelKey& key) {
  for (int i = 0; i < n; ++i) {
    const Kernel<Args>& k = table[i];
    if (k.dtype == key.dtype && k.kv_dtype == key.kv_dtype && k.head_dim == key.head_dim &&
        k.head_dim_v == key.head_dim_v && k.banded == key.banded &&
        k.softcap == key.softcap && k.segments == key.segments && k.split == key.split &&
        k.paged == key.paged && k.keys_as_m == key.keys_as_m &&
        k.long_rows == key.long_rows)
      return &k;
  }
  return nullptr;
}

}  // namespace

const char* DtypeName(Dtype dtype) {
  switch (dtype) {
    case Dtype::kBF16: return "bf16";
    case Dtype::kF16: return "fp16";
    case Dtype::kE4M3: return "e4m3";
  }
  return "?";
}

const FwdKernel* FindFwdKernel(const KernelKey& key) {
  return Find(kFwdKernels, kNumFwdKernels, key);
}

const BwdKernel* FindBwdKernel(const KernelKey& key) {
  return Find(kBwdKernels, kNumBwdKernels, key);
}

BwdExtents WorkspaceExtents(const BwdKernel& kernel, int64_t seqlen_q) {
  const int64_t tiles = (seqlen_q + kernel.tile_m - 1) / kernel.tile_m;
  const int64_t sq_pad = tiles * kernel.tile_m;
  return {sq_pad, sq_pad * kernel.head_dim, tiles * kernel.dq_parts};
}

cudaError_t EnsureLoaded(const FwdKernel& kernel, int32_t device) {
  return EnsureLoadedAt(SlotOf(kernel), kernel, device);
}
cudaError_t EnsureLoaded(const BwdKernel& kernel, int32_t device) {
  return EnsureLoadedAt(SlotOf(kernel), kernel, device);
}

bool IsLoaded(const FwdKernel& kernel, int32_t device) {
  return IsLoadedAt(SlotOf(kernel), device);
}
bool IsLoaded(const BwdKernel& kernel, int32_t device) {
  return IsLoadedAt(SlotOf(kernel), device);
}

}  // namespace jax_fa4
