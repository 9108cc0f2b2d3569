// XLA FFI handler `jax_fa4_fwd`: attention forward through an exported CuTe-DSL kernel.
//
// Operands q (..., Sq, H, D), k and v (..., Sk, H, D): bf16 or fp16, row-major; every
// leading dimension is folded into the batch (so vmap can add axes). Results: out like
// q, lse (..., H, Sq) fp32, and a tile counter (..., 1) int32, a workspace that
// "dynamic"-schedule kernels take tiles from (zeroed here before them). Attributes:
// banded (bool: the banded kernel), softmax_scale (f32), window_left / window_right
// (i32, < 0: unbounded; causal is a right side of 0), top_left (bool: the band's
// alignment; else bottom-right), softcap (f32, 0: none; else the banded kernel's softcap
// variant). Three more int32 operands after v select the segment variant of the banded
// kernel: rows (..., 3, Sq), keys (..., Sk) and the plan (..., query tiles, 1 + key
// blocks) (kernels/sm90/segments.py); the band attributes are then unused, the rows
// carry it. split_kernel (bool) selects the split-KV variant of the banded kernel, which
// cuts each tile's key blocks into num_splits (i32) runs, one CTA each: it
// writes fp32 partials into two more results, out (..., num_splits, Sq, H, Dv)
// normalized per split and lse (..., num_splits, H, Sq) (an empty split gives 0 and
// -inf), and its combine kernel merges them into out and lse (with num_splits 1 the
// kernel writes out and lse itself and no combine runs); with unpack_group (i32) g
// > 1 those two are the caller's of a pack-GQA call, (..., Sq / g, H * g, Dv) and (...,
// H * g, Sq / g) (ffi/kernel_table.h). q_heads_as_rows (bool) says that a decode step's q
// comes unpacked, (..., 1, H * g, D): the kernel reads its g heads per K/V head as g
// rows through strides (a split with g > 1 and one position only). Without a split the
// partials' results are unused (any size) and unpack_group must be 1. A fourth operand
// after the segment ones, the page table (..., max_pages) int32, selects the paged
// variant: k and v are then caches (num_pages, page_size, Hkv, D / Dv) with page_size a
// multiple of kPageRows, and Sk is max_pages * page_size (kernels/sm90/paged.py). Two
// more operands after it, new_k and new_v (..., Snew, Hkv, D / Dv), are rows the kernel
// appends to the caches at each batch's last Snew keys before attending; the call then
// has two more results, the caches, which XLA aliases to k and v (the kernel writes
// them in place). kv_float8 (bool): k and v (and new_k, new_v) are float8_e4m3fn with a
// bf16 q and out (the split kernels' float8 KV variants), and the last operand is the
// descale table (3, Hkv) float32: 1, then k's and v's descale of each K/V head.
// keys_as_m (bool, with split_kernel) selects the split kernel's decode tile, whose
// tile_m query rows are the wgmma's N (kernels/sm90/fwd_keys_m.py), where one was built.
// long_rows (bool, without split, segments or pages) selects the tile for rows that see
// many keys, banded or not, where one was built.
//
// Stages: INITIALIZE checks the device and loads the selected kernel's module onto it
// (once per process and device, outside any CUDA-graph capture); EXECUTE only launches
// on XLA's stream (and, for a "dynamic" kernel, zeroes its counter there first), so the
// handler is command-buffer (CUDA graph) compatible.

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

std::string Describe(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v) {
  return Shapes({{"q", q}, {"k", k}, {"v", v}});
}

constexpr int64_t kPageRows = 16;  // kernels/sm90/paged.py PAGE_ROWS
constexpr size_t kSegmentOperands = 3, kPagedOperands = 4, kAppendOperands = 6;

struct FwdProblem {
  const FwdKernel* kernel;
  int64_t batch, seqlen_q, seqlen_k, heads, head_dim, heads_kv, head_dim_v;
  // Paged calls: the cache's pages and rows per page, and the table's entries per batch.
  int64_t num_pages = 0, page_size = 0, max_pages = 0;
  // The segment / page operands after v (SelectCall), before any descale table.
  size_t given = 0;
};

// The page table's entries per batch (its last dimension); 0 without one. `given`: the
// operands after v before the descales.
ffi::ErrorOr<int64_t> MaxPages(const ffi::RemainingArgs& rest, size_t given) {
  if (given != kPagedOperands && given != kAppendOperands) return int64_t{0};
  auto table = rest.get<ffi::AnyBuffer>(kPagedOperands - 1);
  if (table.has_error()) return table.error();
  auto dims = table->dimensions();
  if (table->element_type() != ffi::DataType::S32 || dims.size() == 0 || dims.back() < 1)
    return ffi::Error::InvalidArgument("jax_fa4_fwd: the page table must be int32 "
                                       "(..., max_pages) with max_pages >= 1; got " +
                                       Dims(dims));
  return dims.back();
}

struct Appended {
  void* k = nullptr;
  void* v = nullptr;
  int64_t rows = 0;
};

// A paged call's new rows (operands after the page table) and its two results, the
// caches, which must alias k and v; none without them.
ffi::ErrorOr<Appended> ReadAppended(const std::string& where, const ffi::RemainingArgs& rest,
                                    size_t given, const ffi::RemainingRets& caches,
                                    const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                    const FwdProblem& p) {
  Appended a;
  if (given != kAppendOperands) {
    if (caches.size() != 0)
      return ffi::Error::InvalidArgument(where + ": cache results without new rows");
    return a;
  }
  auto new_k = rest.get<ffi::AnyBuffer>(kAppendOperands - 2);
  auto new_v = rest.get<ffi::AnyBuffer>(kAppendOperands - 1);
  if (new_k.has_error()) return new_k.error();
  if (new_v.has_error()) return new_v.error();
  auto kd = new_k->dimensions(), vd = new_v->dimensions();
  const size_t r = kd.size();
  bool ok = r >= 3 && vd.size() == r && new_k->element_type() == k.element_type() &&
            new_v->element_type() == k.element_type() && kd[r - 2] == p.heads_kv &&
            vd[r - 2] == p.heads_kv && kd[r - 1] == p.head_dim && vd[r - 1] == p.head_dim_v &&
            kd[r - 3] == vd[r - 3];
  int64_t batch = 1;
  for (size_t i = 0; ok && i + 3 < r; ++i) {
    ok = kd[i] == vd[i];
    batch *= kd[i];
  }
  if (!ok || batch != p.batch || kd[r - 3] > kInt32Max)
    return ffi::Error::InvalidArgument(
        where + ": new rows must be (..., S, Hkv, D) and (..., S, Hkv, Dv) in k's dtype, "
                "batch " + std::to_string(p.batch) + "; got " + Dims(kd) + " and " + Dims(vd));
  if (caches.size() != 2)
    return ffi::Error::InvalidArgument(where + ": appending needs the two caches as results");
  auto k_out = caches.get<ffi::AnyBuffer>(0), v_out = caches.get<ffi::AnyBuffer>(1);
  if (k_out.has_error()) return k_out.error();
  if (v_out.has_error()) return v_out.error();
  if ((*k_out)->untyped_data() != k.untyped_data() ||
      (*v_out)->untyped_data() != v.untyped_data())
    return ffi::Error::InvalidArgument(where + ": the cache results must alias k and v");
  a.k = new_k->untyped_data();
  a.v = new_v->untyped_data();
  a.rows = kd[r - 3];
  return a;
}

// Validates the operands and picks the kernel; shared by both stages. max_pages > 0:
// a paged call, k and v are caches.
ffi::ErrorOr<FwdProblem> Select(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                const ffi::AnyBuffer& v, bool banded, float softcap,
                                bool segments, bool split, int32_t num_splits,
                                int64_t max_pages, bool kv_float8, bool keys_as_m,
                                bool long_rows) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const std::string shapes = Describe(q, k, v);
  const bool paged = max_pages > 0;
  if (qd.size() < 3 || (paged ? kd.size() != 4 || vd.size() != 4
                              : kd.size() != qd.size() || vd.size() != qd.size()))
    return ffi::Error::InvalidArgument(
        "jax_fa4_fwd: q, k, v must have the same rank >= 3 (..., S, H, D), or k and v be "
        "caches (num_pages, page_size, H, D) with a page table; got " + shapes);
  const size_t r = qd.size();
  int64_t batch = 1;
  for (size_t i = 0; i + 3 < r; ++i) {
    if (!paged && (kd[i] != qd[i] || vd[i] != qd[i]))
      return ffi::Error::InvalidArgument("jax_fa4_fwd: leading (batch) dims differ: " + shapes);
    batch *= qd[i];
  }
  const size_t kr = kd.size();
  FwdProblem p{nullptr, batch, qd[r - 3], kd[kr - 3], qd[r - 2], qd[r - 1], kd[kr - 2],
               vd[kr - 1]};
  if (vd[kr - 2] != p.heads_kv || kd[kr - 1] != p.head_dim || vd[kr - 3] != p.seqlen_k ||
      (paged && vd[0] != kd[0]))
    return ffi::Error::InvalidArgument("jax_fa4_fwd: heads, head_dim or seqlen_k of q, k, v "
                                       "disagree: " + shapes);
  if (paged) {
    p.num_pages = kd[0];
    p.page_size = kd[1];
    p.max_pages = max_pages;
    p.seqlen_k = max_pages * p.page_size;
    if (p.num_pages < 1 || p.page_size < kPageRows || p.page_size % kPageRows != 0)
      return ffi::Error::InvalidArgument("jax_fa4_fwd: paged caches need pages and a page "
                                         "size that is a multiple of " +
                                         std::to_string(kPageRows) + ": " + shapes);
  }
  if (!GroupsHeads(p.heads, p.heads_kv))
    return ffi::Error::InvalidArgument("jax_fa4_fwd: the heads of k and v must divide the "
                                       "heads of q: " + shapes);
  if (k.element_type() != v.element_type() ||
      (kv_float8 ? k.element_type() != ffi::DataType::F8E4M3FN ||
                       q.element_type() != ffi::DataType::BF16
                 : q.element_type() != k.element_type()))
    return ffi::Error::InvalidArgument(
        std::string("jax_fa4_fwd: ") +
        (kv_float8 ? "kv_float8 needs q in bf16 and k, v in float8_e4m3fn: "
                   : "q, k, v dtypes differ: ") + shapes);
  const std::optional<Dtype> dtype = KernelDtype(q.element_type());
  if (!dtype)
    return ffi::Error::InvalidArgument("jax_fa4_fwd: dtype must be bf16 or fp16: " + shapes);
  const Dtype kv_dtype = kv_float8 ? Dtype::kE4M3 : *dtype;
  if (!ValidSoftcap(softcap, banded))
    return ffi::Error::InvalidArgument("jax_fa4_fwd: softcap must be finite and >= 0, and "
                                       "> 0 only with the banded kernel");
  if (num_splits < 1 || num_splits > kMaxSplits || (num_splits > 1 && !split) ||
      (split && !banded) || (keys_as_m && !split) ||
      (long_rows && (split || segments)))
    return ffi::Error::InvalidArgument("jax_fa4_fwd: num_splits must be in [1, " +
                                       std::to_string(kMaxSplits) +
                                       "], > 1 only with split_kernel, which needs the "
                                       "banded kernel, as keys_as_m needs split_kernel; "
                                       "long_rows needs a call without split or "
                                       "segments");
  KernelKey key{*dtype, kv_dtype, static_cast<int>(p.head_dim),
                static_cast<int>(p.head_dim_v)};
  key.banded = banded;
  key.softcap = softcap > 0.0f;
  key.segments = segments;
  key.split = split;
  key.paged = paged;
  key.keys_as_m = keys_as_m;
  key.long_rows = long_rows;
  p.kernel = FindFwdKernel(key);
  if (p.kernel == nullptr)
    return ffi::Error::InvalidArgument(std::string("jax_fa4_fwd: no kernel built for dtype ") +
                                       DtypeName(*dtype) +
                                       (kv_float8 ? " with e4m3 k, v" : "") + ", head_dim " +
                                       HeadDims(p.head_dim, p.head_dim_v) +
                                       (banded ? ", banded" : ", full") +
                                       (softcap > 0.0f ? ", softcap" : "") +
                                       (segments ? ", segments" : "") +
                                       (split ? ", split" : "") +
                                       (paged ? ", paged" : "") +
                                       (keys_as_m ? ", keys as M" : "") +
                                       (long_rows ? ", long rows" : "") + ": " + shapes);
  return p;
}

// Select for a call's trailing operands: the segment / page ones, then with kv_float8
// the descale table; shared by both stages.
ffi::ErrorOr<FwdProblem> SelectCall(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                    const ffi::AnyBuffer& v, const ffi::RemainingArgs& rest,
                                    bool banded, float softcap, bool split, int32_t num_splits,
                                    bool kv_float8, bool keys_as_m, bool long_rows) {
  if (kv_float8 && rest.size() == 0)
    return ffi::Error::InvalidArgument("jax_fa4_fwd: kv_float8 needs the descale operand");
  const size_t given = rest.size() - (kv_float8 ? 1 : 0);
  auto max_pages = MaxPages(rest, given);
  if (max_pages.has_error()) return max_pages.error();
  auto problem = Select(q, k, v, banded, softcap, given > 0, split, num_splits, *max_pages,
                        kv_float8, keys_as_m, long_rows);
  if (problem.has_error()) return problem.error();
  FwdProblem p = *problem;
  p.given = given;
  return p;
}

ffi::Error FwdInitialize(int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::RemainingArgs segments, ffi::RemainingRets /*results*/,
                         bool banded, float /*softmax_scale*/, int32_t /*window_left*/,
                         int32_t /*window_right*/, bool /*top_left*/, float softcap,
                         bool split_kernel, int32_t num_splits,
                         int32_t /*unpack_group*/, bool /*q_heads_as_rows*/, bool kv_float8,
                         bool keys_as_m, bool long_rows) {
  auto problem = SelectCall(q, k, v, segments, banded, softcap, split_kernel, num_splits,
                            kv_float8, keys_as_m, long_rows);
  if (problem.has_error()) return problem.error();
  return CheckDeviceAndLoad("jax_fa4_fwd", *problem->kernel, device);
}

ffi::Error FwdExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                      ffi::AnyBuffer v, ffi::RemainingArgs segment_args,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                      ffi::Result<ffi::Buffer<ffi::S32>> tile_counter,
                      ffi::Result<ffi::Buffer<ffi::F32>> out_part,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse_part,
                      ffi::RemainingRets caches, bool banded,
                      float softmax_scale, int32_t window_left, int32_t window_right,
                      bool top_left, float softcap, bool split_kernel,
                      int32_t num_splits, int32_t unpack_group, bool q_heads_as_rows,
                      bool kv_float8, bool keys_as_m, bool long_rows) {
  auto problem = SelectCall(q, k, v, segment_args, banded, softcap, split_kernel,
                            num_splits, kv_float8, keys_as_m, long_rows);
  if (problem.has_error()) return problem.error();
  FwdProblem p = *problem;
  const size_t given = p.given;
  const std::string where = std::string("jax_fa4_fwd[") + p.kernel->name + "] " + Describe(q, k, v);
  // A pack-GQA decode step's q in the caller's layout, (..., 1, heads_kv * g, D): the
  // split kernel reads its g heads per K/V head as g rows through q_strides, with no
  // transpose.
  const int64_t row = p.heads * p.head_dim;
  int64_t q_strides[3] = {p.seqlen_q * row, row, p.head_dim};
  if (q_heads_as_rows) {
    if (!split_kernel || unpack_group < 2 || p.seqlen_q != 1 ||
        p.heads != p.heads_kv * unpack_group)
      return ffi::Error::InvalidArgument(
          where + ": q_heads_as_rows needs split_kernel, unpack_group g > 1 and q of one "
                  "position with heads_kv * g heads");
    q_strides[1] = p.head_dim;
    q_strides[2] = unpack_group * p.head_dim;
    p.seqlen_q = unpack_group;
    p.heads = p.heads_kv;
  }
  const int64_t q_tiles = (p.seqlen_q + p.kernel->tile_m - 1) / p.kernel->tile_m;
  const int64_t key_blocks = (p.seqlen_k + p.kernel->tile_n - 1) / p.kernel->tile_n;
  const bool paged = p.max_pages > 0;
  auto segments = ReadSegments(where, segment_args, p.batch, p.seqlen_q, p.seqlen_k, q_tiles,
                               1 + key_blocks, paged ? given - kSegmentOperands : 0,
                               kv_float8 ? 1 : 0);
  if (segments.has_error()) return segments.error();
  void* page_table = nullptr;
  if (paged) {
    auto table = segment_args.get<ffi::AnyBuffer>(kPagedOperands - 1);
    if (table.has_error()) return table.error();
    if (static_cast<int64_t>(table->element_count()) != p.batch * p.max_pages)
      return ffi::Error::InvalidArgument(where + ": the page table must have " +
                                         std::to_string(p.max_pages) + " entries per batch");
    page_table = table->untyped_data();
  }
  auto appended = ReadAppended(where, segment_args, given, caches, k, v, p);
  if (appended.has_error()) return appended.error();
  void* descale = nullptr;
  if (kv_float8) {
    auto table = segment_args.get<ffi::AnyBuffer>(given);
    if (table.has_error()) return table.error();
    if (table->element_type() != ffi::DataType::F32 ||
        static_cast<int64_t>(table->element_count()) != 3 * p.heads_kv)
      return ffi::Error::InvalidArgument(where + ": the descale table must be float32 (3, " +
                                         std::to_string(p.heads_kv) + ")");
    descale = table->untyped_data();
  }

  const int64_t out_count = p.batch * p.seqlen_q * p.heads * p.head_dim_v;
  const int64_t lse_count = p.batch * p.heads * p.seqlen_q;
  if (out->element_type() != q.element_type() || out->element_count() != out_count ||
      lse->element_count() != lse_count || tile_counter->element_count() < 1 ||
      (split_kernel && (out_part->element_count() != num_splits * out_count ||
                        lse_part->element_count() != num_splits * lse_count)))
    return ffi::Error::InvalidArgument(where + ": result shapes do not match the operands");
  if (unpack_group < 1 || p.seqlen_q % unpack_group != 0 ||
      (!split_kernel && unpack_group != 1))
    return ffi::Error::InvalidArgument(where + ": unpack_group must divide Sq, and be 1 "
                                       "without a split");
  if (!(softmax_scale > 0.0f) || !std::isfinite(softmax_scale))
    return ffi::Error::InvalidArgument(where + ": softmax_scale must be finite and > 0");
  if (p.batch == 0 || p.heads == 0 || p.seqlen_q == 0) return ffi::Error::Success();
  if (p.seqlen_k == 0)
    return ffi::Error::InvalidArgument(where + ": seqlen_k must be >= 1 (handled in Python)");
  // Grid (query tiles, heads, batch); the export ABI holds sizes as int32.
  // Split kernels: grid x is query tiles * num_splits, and the partials' batch
  // num_splits * batch.
  if (p.batch > kMaxGridYZ || p.heads > kMaxGridYZ || p.seqlen_q > kInt32Max ||
      p.seqlen_k > kInt32Max || q_tiles * num_splits > kInt32Max ||
      p.batch * num_splits > kInt32Max || p.num_pages * p.page_size > kInt32Max)
    return ffi::Error::InvalidArgument(where + ": batch and heads must be <= 65535 and "
                                       "sequence lengths < 2^31");
  // The split kernels' combine addresses out in 32 bits (kernels/sm90/combine.py;
  // jax_fa4._split_kv.out_view_fits routes larger calls unsplit).
  if (split_kernel && static_cast<int64_t>(out->element_count()) > kInt32Max)
    return ffi::Error::InvalidArgument(where + ": a split kernel's out must have fewer "
                                       "than 2^31 elements");
  if (!TmaAligned({q.untyped_data(), k.untyped_data(), v.untyped_data(), out->untyped_data(),
                   lse->typed_data()}) ||
      (split_kernel && !TmaAligned({out_part->typed_data(), lse_part->typed_data()})))
    return ffi::Error::InvalidArgument(where + ": buffers must be 16-byte aligned for TMA");
  auto num_sms = PrepareForwardLaunch(where, *p.kernel, device, stream,
                                      tile_counter->typed_data());
  if (num_sms.has_error()) return num_sms.error();

  const Band band = MakeBand(p.seqlen_q, p.seqlen_k, window_left, window_right, top_left);
  FwdArgs args = ForwardArgs(p, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                             out->untyped_data(), lse->typed_data(), softmax_scale, band,
                             SoftcapScale(softmax_scale, softcap));
  args.num_splits = num_splits;
  args.split_batch = static_cast<int32_t>(p.batch * num_splits);
  args.o_part = out_part->typed_data();
  args.lse_part = lse_part->typed_data();
  args.unpack_group = unpack_group;
  for (int i = 0; i < 3; ++i) args.q_strides[i] = q_strides[i];
  args.num_sms = *num_sms;
  args.tile_counter = tile_counter->typed_data();
  args.page_table = page_table;
  args.num_pages = static_cast<int32_t>(p.num_pages);
  args.page_size = static_cast<int32_t>(p.page_size);
  args.max_pages = static_cast<int32_t>(p.max_pages);
  args.new_k = appended->k;
  args.new_v = appended->v;
  args.new_rows = static_cast<int32_t>(appended->rows);
  args.descale = descale;
  segments->Into(args);
  return LaunchResult(where, p.kernel->launch(args, stream));
}

}  // namespace
}  // namespace jax_fa4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4FwdInitialize, jax_fa4::FwdInitialize,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::DeviceOrdinal>()      // device XLA runs on
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // k
                                  .Arg<ffi::AnyBuffer>()          // v
                                  .RemainingArgs()                // segments: select the kernel
                                  .RemainingRets()                // results: not touched
                                  .Attr<bool>("banded")           // selects the kernel
                                  .Attr<float>("softmax_scale")   // unused here
                                  .Attr<int32_t>("window_left")   // unused here
                                  .Attr<int32_t>("window_right")  // unused here
                                  .Attr<bool>("top_left")         // unused here
                                  .Attr<float>("softcap")         // selects the kernel
                                  .Attr<bool>("split_kernel")     // selects the kernel
                                  .Attr<int32_t>("num_splits")    // checked
                                  .Attr<int32_t>("unpack_group")     // unused here
                                  .Attr<bool>("q_heads_as_rows")     // unused here
                                  .Attr<bool>("kv_float8")           // selects the kernel
                                  .Attr<bool>("keys_as_m")           // selects the kernel
                                  .Attr<bool>("long_rows"));         // selects the kernel

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa4FwdExecute, jax_fa4::FwdExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()  // device XLA runs on
                                  .Arg<ffi::AnyBuffer>()      // q (..., Sq, H, D)
                                  .Arg<ffi::AnyBuffer>()      // k (..., Sk, H, D)
                                  .Arg<ffi::AnyBuffer>()      // v (..., Sk, H, D)
                                  .RemainingArgs()            // segments: rows, keys, plan
                                                              // (+ page table: paged;
                                                              // + descale: kv_float8)
                                  .Ret<ffi::AnyBuffer>()      // out (..., Sq, H, D)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse (..., H, Sq)
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tile counter (1,)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // split partials: out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // and lse
                                  .RemainingRets()  // appending: k, v caches (aliased)
                                  .Attr<bool>("banded")
                                  .Attr<float>("softmax_scale")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<bool>("top_left")
                                  .Attr<float>("softcap")
                                  .Attr<bool>("split_kernel")
                                  .Attr<int32_t>("num_splits")
                                  .Attr<int32_t>("unpack_group")
                                  .Attr<bool>("q_heads_as_rows")
                                  .Attr<bool>("kv_float8")
                                  .Attr<bool>("keys_as_m")
                                  .Attr<bool>("long_rows"),
                              {ffi::Traits::kCmdBufferCompatible});
