// The tables of exported kernels the FFI handlers dispatch on.
//
// kernels/export.py generates one row per kernel (kernel_table.inc), in kFwdKernels or
// kBwdKernels, with its module's loaders and a launch adapter that fills that kernel's
// export structs from FwdArgs or BwdArgs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_fa4 {

enum class Dtype { kBF16, kF16, kE4M3 };  // kE4M3: float8 forwards, out in bf16

// One forward launch. Tensors are row-major: q, o (batch, seqlen_q, heads, head_dim),
// k, v (batch, seqlen_k, heads_kv, head_dim), lse (batch, heads, seqlen_q) fp32; query
// head h reads key/value head h / (heads / heads_kv) (GQA/MQA). Sizes are int32 because
// the export ABI's shape slots are.
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
  int32_t heads_kv;  // divides heads
  float scale_log2;  // softmax_scale * log2(e)
  int32_t band_lo;   // banded kernels: key j visible from row i iff band_lo <= j - i
  int32_t band_hi;   // ... <= band_hi (handler_common.h MakeBand); others ignore both
  float softcap_scale;  // softcap kernels: softmax_scale / softcap; others ignore it
  // Segment kernels (kernels/sm90/segments.py); others ignore these. int32, row-major.
  void* q_rows;        // (batch, 3, seqlen_q): per query row, key range and segment id
  void* k_ids;         // (batch, 1, seqlen_k): per key, segment id
  void* plan;          // (batch, plan_tiles, plan_len): per tile, the blocks it visits
  int32_t plan_tiles;
  int32_t plan_len;
  // Split kernels: the grid also runs over num_splits runs of each tile's key blocks,
  // which write fp32 partials o_part (batch * num_splits, seqlen_q, heads, head_dim_v)
  // and lse_part (batch * num_splits, heads, seqlen_q), batch-major; a combine kernel
  // then writes o and lse in the caller's layout (with num_splits 1 the split kernel
  // writes them itself, and no combine runs): with unpack_group g > 1 (pack-GQA),
  // row r = p * g + j of head h is query head h * g + j at position p, so o is (batch,
  // seqlen_q / g, heads * g, head_dim_v) and lse (batch, heads * g, seqlen_q / g).
  // Others ignore these: num_splits and unpack_group are 1, split_batch is batch.
  int32_t num_splits;
  int32_t split_batch;  // batch * num_splits
  void* o_part;
  void* lse_part;
  int32_t unpack_group;
  // Split kernels read q through these strides (elements: batch, row, head): row-major
  // (seqlen_q * heads * head_dim, heads * head_dim, head_dim), or, for a pack-GQA decode
  // step (one position), the caller's (batch, 1, heads * g, head_dim) as g rows per K/V
  // head: (heads * g * head_dim, head_dim, g * head_dim). Others ignore them.
  int64_t q_strides[3];
  // The device's SM count: persistent kernels launch min(tiles, num_sms) CTAs that
  // take tiles in turn; the others ignore it.
  int32_t num_sms;
  // "dynamic" kernels (kernels/sm90/schedule.py): one int32 counting the tiles taken,
  // zero at the launch; others ignore it.
  void* tile_counter;
  // Paged kernels (kernels/sm90/paged.py): k, v are caches (num_pages, page_size,
  // heads_kv, head_dim / head_dim_v), and key j of batch b is slot j % page_size of page
  // page_table[b, j / page_size]; seqlen_k is max_pages * page_size. Others ignore these.
  void* page_table;  // int32 (batch, 1, max_pages)
  int32_t num_pages;
  int32_t page_size;
  int32_t max_pages;
  // ... and the rows they append to the caches first, (batch, new_rows, heads_kv,
  // head_dim / head_dim_v), at keys L - new_rows .. L - 1 of each batch (L: its length,
  // the last query row's key_end); new_rows 0: none (the pointers are then unused).
  void* new_k;
  void* new_v;
  int32_t new_rows = 0;
  // float8 (kE4M3) kernels, and kernels whose kv_dtype alone is kE4M3 (k, v and new_k,
  // new_v in e4m3; descale's q row is 1, v not transposed): descale as below.
  // float8 (kE4M3) kernels: v is V^T, (batch, v_rows = heads_kv * head_dim_v, v_keys)
  // with v_keys >= seqlen_k a multiple of 32 (keys past seqlen_k zero), each 32 keys in
  // the order of jax_fa4/_float8.py transposed_v; descale (3, heads_kv) fp32 the
  // q, k and v descales of each K/V head; o is bf16. Others ignore these.
  int32_t v_rows = 0;
  int32_t v_keys = 0;
  void* descale = nullptr;
};

// One backward launch (preprocess, main, postprocess in order on the stream). Row-major:
// q, o, dout, dq (batch, seqlen_q, heads, head_dim); k, v, dk, dv (batch, seqlen_k,
// heads_kv, head_dim); lse, dlse (batch, heads, seqlen_q) fp32. The workspaces (batch,
// heads, extent) are XLA-allocated and initialized by the kernel; BwdExtents gives
// their extents.
struct BwdArgs {
  void* q;
  void* k;
  void* v;
  void* o;
  void* dout;
  void* lse;
  void* dlse;  // cotangent of lse; zeros when lse is not an output
  void* dq;
  void* dk;
  void* dv;
  void* lse2;      // fp32 (.., sq_pad): lse in base 2, padded
  void* dsum;      // fp32 (.., sq_pad): rowsum(dout * o) - dlse
  void* dq_accum;  // fp32 (.., dq_accum_len): dq before scaling and rounding
  void* sem;       // int32 (.., sem_len): deterministic mode's per-tile turn counters
  int32_t batch;
  int32_t seqlen_q;
  int32_t seqlen_k;
  int32_t heads;
  int32_t heads_kv;      // divides heads
  int32_t sq_pad;        // seqlen_q rounded up to the kernel's tile_m
  int32_t dq_accum_len;  // sq_pad * head_dim
  int32_t sem_len;       // sq_pad / tile_m * consumer warpgroups
  float scale_log2;      // softmax_scale * log2(e)
  float scale;           // softmax_scale
  int32_t deterministic;  // 1: dq accumulated in a fixed order (bitwise reproducible);
                          // 2: the same, walks may be shifted (attention_bwd.cc)
  int32_t band_lo;        // as in FwdArgs
  int32_t band_hi;
  float softcap_scale;    // as in FwdArgs
  // Segment kernels (kernels/sm90/segments.py); others ignore these. int32, row-major.
  void* q_rows;        // (batch, 3, seqlen_q): per query row, key range and segment id
  void* k_ids;         // (batch, 1, seqlen_k): per key, segment id
  void* plan;          // (batch, plan_tiles, plan_len): per tile, the blocks it visits
  int32_t plan_tiles;
  int32_t plan_len;
};

// One exported kernel: its configuration (kernels/config.py) and entry points.
template <typename Args>
struct Kernel {
  const char* name;
  const char* arch;
  Dtype dtype;
  Dtype kv_dtype;  // of k and v: dtype, or kE4M3 for a float8 KV cache (bf16 q and out)
  int head_dim;    // of q and k
  int head_dim_v;  // of v and out
  bool banded;   // the banded variant (runtime band)
  bool softcap;  // scores capped as softcap * tanh(scores / softcap); banded only
  bool segments;  // visibility from per-row arrays and a plan (FwdArgs); banded only
  bool split;     // forward split-KV: fp32 partials per split (FwdArgs); banded only
  bool paged;     // forward K/V read from a paged cache (FwdArgs); segment variants only
  bool dynamic;   // forward "dynamic" schedule: takes tiles from FwdArgs::tile_counter,
                  // which the handler zeroes before the launch
  bool keys_as_m;  // forward split decode tile: keys as the wgmma's M, tile_m rows as N
  bool long_rows;  // forward tile for rows that see many keys
  int tile_m;
  int tile_n;
  int ctas_per_sm;  // CTAs resident on one SM (kernels/config.py Tile)
  int dq_parts;  // backward: parts of a dQ tile (one per consumer), a semaphore each; fwd: 0
  cudaError_t (*init)();  // loads the module's library (context-free, once per process)
  cudaError_t (*load)(int32_t device);  // readies its kernels for `device`, after init
  int32_t (*launch)(const Args&, cudaStream_t);
};
using FwdKernel = Kernel<FwdArgs>;
using BwdKernel = Kernel<BwdArgs>;

extern const FwdKernel kFwdKernels[];
extern const int kNumFwdKernels;
extern const BwdKernel kBwdKernels[];
extern const int kNumBwdKernels;

const char* DtypeName(Dtype dtype);

// The static choices that name a kernel (kernels/config.py), as a call asks for one:
// the dtypes and head dims, then the variant flags by name (split, paged, keys_as_m and
// long_rows are the forward's).
struct KernelKey {
  Dtype dtype;
  Dtype kv_dtype;
  int head_dim;
  int head_dim_v;
  bool banded = false;
  bool softcap = false;
  bool segments = false;
  bool split = false;
  bool paged = false;
  bool keys_as_m = false;
  bool long_rows = false;
};

// nullptr when no kernel was built for this key.
const FwdKernel* FindFwdKernel(const KernelKey& key);
const BwdKernel* FindBwdKernel(const KernelKey& key);

// Workspace extents of one backward: the last dimension of lse2 and dsum (sq_pad),
// dq_accum and sem, each (batch, heads, extent).
struct BwdExtents {
  int64_t sq_pad;
  int64_t dq_accum;
  int64_t sem;
};
BwdExtents WorkspaceExtents(const BwdKernel& kernel, int64_t seqlen_q);

// Devices 0 .. kMaxDevices - 1 can load kernels (the load state is a fixed table).
constexpr int kMaxDevices = 64;

// Loads the kernel's module onto `device` the first time it is asked for there: the
// library once per process, then the device's part. Later calls return the first
// result, per device, so a failure on one device leaves the others free to load;
// cudaErrorInvalidDevice outside [0, kMaxDevices). Not safe inside CUDA-graph capture:
// call it from an FFI initialize stage.
cudaError_t EnsureLoaded(const FwdKernel& kernel, int32_t device);
cudaError_t EnsureLoaded(const BwdKernel& kernel, int32_t device);

// True once EnsureLoaded succeeded for this kernel and device (cheap, capture-safe).
bool IsLoaded(const FwdKernel& kernel, int32_t device);
bool IsLoaded(const BwdKernel& kernel, int32_t device);

}  // namespace jax_fa4
