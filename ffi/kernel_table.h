// The table of exported kernels the FFI handlers dispatch on.
//
// kernels/export.py generates one row per kernel (kernel_table.inc) with a module
// loader and a launch adapter that fills that kernel's export structs from FwdArgs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_fa4 {

enum class Dtype { kBF16, kF16 };

// One forward launch. Tensors are row-major: q, o (batch, seqlen_q, heads, head_dim),
// k, v (batch, seqlen_k, heads, head_dim), lse (batch, heads, seqlen_q) fp32. Sizes are
// int32 because the export ABI's shape slots are.
struct FwdArgs {
  void* q;
  void* k;
  void* v;
  void* o;
  void* lse;
  int32_t batch;
  int32_t seqlen_q;
  int32_t seqlen_k;
  int32_t heads;
  float scale_log2;  // softmax_scale * log2(e)
};

struct FwdKernel {
  const char* name;
  const char* arch;
  Dtype dtype;
  int head_dim;
  bool causal;
  int tile_m;
  int tile_n;
  cudaError_t (*load)();  // loads the module onto every visible device
  int32_t (*launch)(const FwdArgs&, cudaStream_t);
};

extern const FwdKernel kFwdKernels[];
extern const int kNumFwdKernels;

const char* DtypeName(Dtype dtype);

// nullptr when no kernel was built for this configuration.
const FwdKernel* FindFwdKernel(Dtype dtype, int head_dim, bool causal);

// Loads the kernel's module once per process; later calls return the first result.
// Not safe inside CUDA-graph capture: call it from an FFI initialize stage.
cudaError_t EnsureLoaded(const FwdKernel& kernel);

// True once EnsureLoaded succeeded for this kernel (cheap, capture-safe).
bool IsLoaded(const FwdKernel& kernel);

}  // namespace jax_fa4
