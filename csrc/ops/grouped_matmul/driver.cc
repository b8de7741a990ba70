// SPDX-License-Identifier: MIT
#include "ops/grouped_matmul/driver.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/convert.h"
#include "common/parallel.h"
#include "common/status.h"
#include "ops/grouped_matmul/validate.h"

namespace ort_ops::grouped_matmul {
namespace {

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;

// Rows per task: enough to amortise packing a tile (K * 128 bytes) over many rows, few enough
// that one huge expert still spreads over the pool. A multiple of every micro-kernel's MR.
constexpr int64_t kRowChunk = 240;

const float* as_f32(const InputView& t, std::vector<float>& storage) {
  if (t.dtype == F32) return t.ptr<float>();
  storage.resize(static_cast<size_t>(t.numel));
  half_to_float_scalar(t.ptr<uint16_t>(), storage.data(), t.numel);
  return storage.data();
}

// Uninitialized scratch for the transposed weight: pages of experts without rows are never
// touched. On Linux in 2 MB pages where the kernel offers them (MADV_HUGEPAGE): the buffer is
// fresh each Run, and with 4 KB pages its faults cost as much as the transpose.
WeightScratch alloc_scratch(size_t bytes) {
#if defined(__linux__)
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  void* mem = std::aligned_alloc(kHuge, rounded);
  if (mem != nullptr) madvise(mem, rounded, MADV_HUGEPAGE);  // refused: 4 KB pages, same result
#else
  void* mem = std::malloc(bytes);
#endif
  if (mem == nullptr) throw std::bad_alloc();
  return WeightScratch(static_cast<int8_t*>(mem));
}

#if defined(__SSE2__)
// dst[c * ldd + r] = src[r * lds + c] for r, c in [0, 16): four rounds of unpacks (bytes, then
// 2, 4 and 8 byte units), each doubling the rows a unit holds.
void transpose16x16(const int8_t* src, int64_t lds, int8_t* dst, int64_t ldd) {
  __m128i a[16], b[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * lds));
  for (int i = 0; i < 8; ++i) {  // b[2i], b[2i + 1]: rows 2i, 2i+1 of columns 0-7, 8-15
    b[2 * i] = _mm_unpacklo_epi8(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi8(a[2 * i], a[2 * i + 1]);
  }
  for (int j = 0; j < 4; ++j) {  // a[4j + g]: rows 4j..4j+3 of columns 4g..4g+3
    a[4 * j] = _mm_unpacklo_epi16(b[4 * j], b[4 * j + 2]);
    a[4 * j + 1] = _mm_unpackhi_epi16(b[4 * j], b[4 * j + 2]);
    a[4 * j + 2] = _mm_unpacklo_epi16(b[4 * j + 1], b[4 * j + 3]);
    a[4 * j + 3] = _mm_unpackhi_epi16(b[4 * j + 1], b[4 * j + 3]);
  }
  for (int o = 0; o < 2; ++o)  // b[8o + h]: rows 8o..8o+7 of columns 2h, 2h+1
    for (int g = 0; g < 4; ++g) {
      b[8 * o + 2 * g] = _mm_unpacklo_epi32(a[8 * o + g], a[8 * o + 4 + g]);
      b[8 * o + 2 * g + 1] = _mm_unpackhi_epi32(a[8 * o + g], a[8 * o + 4 + g]);
    }
  for (int h = 0; h < 8; ++h) {  // column 2h, 2h+1: all 16 rows
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * h) * ldd), _mm_unpacklo_epi64(b[h], b[8 + h]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * h + 1) * ldd), _mm_unpackhi_epi64(b[h], b[8 + h]));
  }
}
#endif

// One expert's [N, K] -> [K, N], in 64 x 64 byte blocks of 16 x 16 SIMD tiles where SSE2 is
// there; edges byte by byte.
void transpose_nk(const int8_t* src, int8_t* dst, int64_t n, int64_t k) {
  constexpr int64_t kB = 64;
  for (int64_t n0 = 0; n0 < n; n0 += kB)
    for (int64_t k0 = 0; k0 < k; k0 += kB) {
      const int64_t n1 = std::min(n0 + kB, n), k1 = std::min(k0 + kB, k);
      int64_t nt = n0, kt = k0;  // the SIMD tiles cover [n0, nt) x [k0, kt)
#if defined(__SSE2__)
      nt = n0 + (n1 - n0) / 16 * 16;
      kt = k0 + (k1 - k0) / 16 * 16;
      for (int64_t r = n0; r < nt; r += 16)
        for (int64_t c = k0; c < kt; c += 16) transpose16x16(src + r * k + c, k, dst + c * n + r, n);
#endif
      for (int64_t r = n0; r < n1; ++r)
        for (int64_t c = (r < nt ? kt : k0); c < k1; ++c) dst[c * n + r] = src[r * k + c];
    }
}

// One expert's [ceil(N/16), K/4, 16, 4] -> [K, N] ("EN16K4" on a path without the AMX panels).
void unpack_en16k4(const int8_t* src, int8_t* dst, int64_t n, int64_t k) {
  const int64_t k4 = k / 4;
  for (int64_t s = 0; s < k4; ++s)
    for (int64_t c = 0; c < n; ++c) {
      const int8_t* q = src + (((c / 16) * k4 + s) * 16 + c % 16) * 4;
      for (int64_t j = 0; j < 4; ++j) dst[(s * 4 + j) * n + c] = q[j];
    }
}

}  // namespace

void advise_weight_pages(const OrtKernelInfo* info, size_t index) {
#if defined(__linux__)
  const char* env = std::getenv("ORT_OPS_CPU_HUGEPAGES");
  if (env != nullptr && std::strcmp(env, "0") == 0) return;
  try {
    int is_constant = 0;
    const Ort::ConstValue w = Ort::ConstKernelInfo(info).GetTensorConstantInput(index, &is_constant);
    if (!is_constant || !w) return;
    const auto shape = w.GetTensorTypeAndShapeInfo();
    const size_t bytes = shape.GetElementCount();  // int8 weights: one byte each
    constexpr uintptr_t kHuge = uintptr_t{2} << 20;
    if (bytes < 2 * kHuge) return;
    const auto begin = reinterpret_cast<uintptr_t>(w.GetTensorRawData());
    const uintptr_t lo = (begin + kHuge - 1) & ~(kHuge - 1), hi = (begin + bytes) & ~(kHuge - 1);
    if (hi <= lo) return;
    constexpr int kMadvCollapse = 25;  // Linux 6.1+; older kernels answer EINVAL
    if (madvise(reinterpret_cast<void*>(lo), hi - lo, kMadvCollapse) != 0)
      madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // khugepaged, later
  } catch (const Ort::Exception&) {
    // Not a constant initializer ORT can hand out here: nothing to advise.
  }
#else
  (void)info;
  (void)index;
#endif
}

Problem read_problem(const char* op, Ort::KernelContext& ctx, int64_t group_list_type, bool even_n) {
  return read_problem(op, read_inputs(ctx), group_list_type, even_n);
}

Problem read_problem(const char* op, const Inputs& in, int64_t group_list_type, bool even_n) {
  const InputView &x = in.x, &w = in.weight, &ws = in.weight_scale, &xs = in.x_scale,
                  &gl = in.group_list;
  DeviceChecks cpu;
  cpu.after_weight = [](const char* op, const Dims& d) {
    if (d.k > kMaxK)
      fail_unsupported(op, "K must be <= ", kMaxK, " so the int32 accumulator cannot overflow, got ",
                       d.k);
  };
  const Dims d = validate_inputs(op, in, even_n, cpu);
  Problem p;
  p.m = d.m;
  p.k = d.k;
  p.e = d.e;
  p.n = d.n;
  if (group_list_type != 0 && group_list_type != 1)
    fail_invalid(op, "attribute 'group_list_type' must be 0 (cumulative) or 1 (counts), got ",
                 group_list_type);
  if (in.bias.present) {
    // A NaN or Inf bias would make every row of its expert non-finite (SwiGLU: refused per row;
    // dequant: silently NaN), so it is refused as an input, the way the reference does.
    const float* b = in.bias.ptr<float>();
    for (int64_t i = 0; i < p.e * p.n; ++i)
      if (!std::isfinite(b[i]))
        fail_invalid(op, "input 'bias' must be finite, got NaN or Inf at expert ", i / p.n,
                     ", column ", i % p.n);
    p.bias = b;
  }

  const int64_t* g = gl.ptr<int64_t>();
  p.ends.resize(static_cast<size_t>(p.e));
  int64_t prev = 0;
  for (int64_t i = 0; i < p.e; ++i) {
    if (group_list_type == 1) {
      if (g[i] < 0)
        fail_invalid(op, "input 'group_list' must hold counts >= 0, got ", g[i], " at index ", i);
      if (g[i] > p.m - prev)  // no overflow: prev <= m here
        fail_invalid(op, "input 'group_list' counts must sum to <= ", p.m, " (rows of 'x'), got more");
      prev += g[i];
    } else {
      if (g[i] < prev)
        fail_invalid(op, "input 'group_list' must be non-decreasing and >= 0, got ", g[i],
                     " at index ", i, " after ", prev);
      prev = g[i];
    }
    p.ends[static_cast<size_t>(i)] = prev;
  }
  if (prev > p.m) fail_invalid(op, "input 'group_list' must end at <= ", p.m, " (rows of 'x'), got ", prev);
  p.rows_used = prev;
  p.x = x.ptr<int8_t>();
  p.w = w.ptr<int8_t>();
  p.w_scale = as_f32(ws, p.w_scale_f32);
  p.x_scale = as_f32(xs, p.x_scale_f32);
  return p;
}

Problem read_problem_layout(const char* op, Ort::KernelContext& ctx, WeightLayout layout, int64_t group_list_type,
                            bool even_n, const Kernels& kern, WeightScratch& scratch) {
  if (layout == WeightLayout::kEKN) return read_problem(op, ctx, group_list_type, even_n);
  Inputs in = read_inputs(ctx);
  gmsq_layout::to_logical_weight(op, in, layout, even_n);
  Problem p = read_problem(op, in, group_list_type, even_n);
  const Dims d{p.m, p.k, p.n, p.e};

  if (layout == WeightLayout::kEN16K4 && kern.panel != nullptr) {
    p.w = in.weight.ptr<int8_t>();
    p.w_quads = true;
    return p;
  }
  std::vector<int64_t> used;  // experts with rows
  for (int64_t i = 0, start = 0; i < d.e; start = std::max(start, p.ends[static_cast<size_t>(i)]), ++i)
    if (p.ends[static_cast<size_t>(i)] > start) used.push_back(i);
  if (used.empty()) return p;
  const int64_t kn = d.k * d.n;
  scratch = alloc_scratch(static_cast<size_t>(d.e * kn));
  const int8_t* w = in.weight.ptr<int8_t>();
  int8_t* t = scratch.get();
  const int64_t src_stride = layout == WeightLayout::kEN16K4 ? (d.n + 15) / 16 * 16 * d.k : kn;
  parallel_for(ctx, used.size(), [&](size_t u) {
    if (layout == WeightLayout::kEN16K4)
      unpack_en16k4(w + used[u] * src_stride, t + used[u] * kn, d.n, d.k);
    else
      transpose_nk(w + used[u] * kn, t + used[u] * kn, d.n, d.k);
  });
  p.w = t;
  return p;
}

namespace {

// x rows in the ISA's layout (kern.prep), prepared once and shared by every task; empty when
// the kernels read x as it is.
struct PreparedX {
  std::unique_ptr<uint8_t[]> rows;
  int64_t stride = 0;
};

// Small inputs (decode) are prepared on this thread: every parallel_for is a barrier, and
// barriers are what an oversubscribed machine makes expensive. kern.prep_pad_rows zero rows
// follow the last used row.
[[gnu::always_inline]] inline PreparedX prepare_x(Ort::KernelContext& ctx, const Problem& p,
                                                  const Kernels& kern) {
  PreparedX xp;
  if (kern.prep) {
    const int64_t stride = kern.prep_stride(p.k);
    xp.stride = stride;
    xp.rows.reset(new uint8_t[static_cast<size_t>((p.rows_used + kern.prep_pad_rows) * stride)]);
    uint8_t* rows = xp.rows.get();
    std::fill(rows + p.rows_used * stride, rows + (p.rows_used + kern.prep_pad_rows) * stride,
              uint8_t{0});
    const int64_t rows_per = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(p.k, 1));
    const int64_t chunks = (p.rows_used + rows_per - 1) / rows_per;
    parallel_for(ctx, static_cast<size_t>(chunks), [&](size_t c) {
      const int64_t r0 = static_cast<int64_t>(c) * rows_per;
      const int64_t r1 = std::min(p.rows_used, r0 + rows_per);
      kern.prep(p.x + r0 * p.k, r1 - r0, p.k, rows + r0 * stride, stride);
    });
  }
  return xp;
}

// Few-row experts (memory-bound) go through K-split partial sums over whole weight rows;
// the others through column tiles that reuse each packed tile for all their rows.
struct Tile {
  int64_t e, r0, r1;
  int64_t col0, width;  // columns (SwiGLU: of A)
  bool panel;           // kern.panel over all of K, else kern.tile
};
struct Gemv {
  int64_t e, r0, r1;
  size_t offset;  // into partials: kblocks * (rows * n_pad + n_pad) ints
  size_t chunk;   // its entry in chunks
};
struct Chunk {  // rows whose epilogue the last of its tasks runs
  int64_t gemv;  // index into gemvs (its k blocks are the tasks), or -1 (its column tiles are)
  int64_t r0, r1;
};

// Every task of a Run: tiles (and panels), few-row experts' k blocks, and the chunks of rows
// they complete (chunk_tasks[c]: how many tasks chunk c waits for).
struct TaskPlan {
  std::vector<Tile> tiles;
  std::vector<Gemv> gemvs;
  std::vector<Chunk> chunks;
  std::vector<int64_t> tile_chunk;  // chunk of each tile
  std::vector<int64_t> chunk_tasks;
  size_t partial_ints = 0;  // int32 partial sums of all few-row experts
  int64_t n_pad = 0;        // N rounded up to kern.gemv_group (few-row path only)
  int64_t kblocks = 0;      // k blocks of kGemvBlockK per few-row expert
};

// Column width of one panel part: panels split their columns into parts so that a few of
// them still spread over the pool, and parts keep a panel's thread buffers bounded
// (kMaxPanelCols columns per segment). A multiple of 64 (the AMX packing group).
[[gnu::always_inline]] inline int64_t panel_part_width(int64_t cols, int64_t panel_experts) {
  constexpr int64_t kMaxPanelCols = 4096;
  const int64_t parts = std::max((cols + kMaxPanelCols - 1) / kMaxPanelCols,
                                 panel_experts ? std::min<int64_t>(4, (4 + panel_experts - 1) / panel_experts) : 1);
  return ((cols + parts - 1) / parts + 63) / 64 * 64;
}

// Splits every expert into tasks: few-row experts (kern.gemv_rows) into k blocks, panel
// experts (kern.panel_rows rows a chunk, or every expert for "EN16K4" weights, which need the
// AMX panel kernel) into column parts, the others into kRowChunk rows x column tiles.
[[gnu::always_inline]] inline TaskPlan plan_tasks(const char* op, const Problem& p,
                                                  const Kernels& kern, int64_t cols,
                                                  int64_t tile_w, int64_t col_tiles) {
  TaskPlan tp;
  const bool use_gemv = kern.gemv_partial != nullptr && p.k > 0 && p.n > 0;
  tp.n_pad = use_gemv ? (p.n + kern.gemv_group - 1) / kern.gemv_group * kern.gemv_group : 0;
  tp.kblocks = (p.k + kGemvBlockK - 1) / kGemvBlockK;
  const int64_t n_pad = tp.n_pad, kblocks = tp.kblocks;
  // "EN16K4" weights: every expert runs as panels (no packing to do), chunks of panel_rows rows.
  auto is_gemv = [&](int64_t rows) { return use_gemv && !p.w_quads && rows > 0 && rows <= kern.gemv_rows; };
  auto is_panel = [&](int64_t rows) {
    return kern.panel != nullptr && p.k > 0 && !is_gemv(rows) && rows > 0 &&
           (p.w_quads || rows <= kern.panel_rows);
  };
  if (p.w_quads && (kern.panel == nullptr || p.k % 4 != 0))
    fail_unsupported(op, "weight_layout 'EN16K4' needs the AMX panel kernel here (unpack it first)");
  int64_t panel_experts = 0;
  for (int64_t e = 0, start = 0; e < p.e; start = p.ends[static_cast<size_t>(e)], ++e)
    panel_experts += is_panel(p.ends[static_cast<size_t>(e)] - start) ? 1 : 0;
  const int64_t part_w = panel_part_width(cols, panel_experts);
  int64_t start = 0;
  for (int64_t e = 0; e < p.e; ++e) {
    const int64_t end = p.ends[static_cast<size_t>(e)];
    if (is_gemv(end - start)) {
      tp.gemvs.push_back({e, start, end, tp.partial_ints, tp.chunks.size()});
      tp.chunks.push_back({static_cast<int64_t>(tp.gemvs.size()) - 1, start, end});
      tp.chunk_tasks.push_back(kblocks);
      tp.partial_ints += static_cast<size_t>(kblocks * ((end - start) * n_pad + n_pad));
    } else if (is_panel(end - start)) {
      for (int64_t r0 = start; r0 < end; r0 += kern.panel_rows) {
        const int64_t r1 = std::min(end, r0 + kern.panel_rows);
        int64_t tasks = 0;
        for (int64_t c0 = 0; c0 < cols; c0 += part_w, ++tasks) {
          tp.tiles.push_back({e, r0, r1, c0, std::min(part_w, cols - c0), true});
          tp.tile_chunk.push_back(static_cast<int64_t>(tp.chunks.size()));
        }
        tp.chunks.push_back({-1, r0, r1});
        tp.chunk_tasks.push_back(tasks);
      }
    } else {
      for (int64_t r0 = start; r0 < end; r0 += kRowChunk) {  // empty experts add no task
        const int64_t r1 = std::min(end, r0 + kRowChunk);
        for (int64_t t = 0; t < col_tiles; ++t) {
          tp.tiles.push_back({e, r0, r1, t * tile_w, std::min(tile_w, cols - t * tile_w), false});
          tp.tile_chunk.push_back(static_cast<int64_t>(tp.chunks.size()));
        }
        tp.chunks.push_back({-1, r0, r1});
        tp.chunk_tasks.push_back(col_tiles);
      }
    }
    start = end;
  }
  return tp;
}

// What every task of the parallel section reads, and the state the tasks share: partial sums,
// pending task counts per chunk, and the first row that failed (-1: none).
struct TaskRun {
  const Problem& p;
  Mode mode;
  const Kernels& kern;
  float* out;
  int64_t ldo;
  const RowsDoneFn& rows_done;
  const Act& act;
  const TaskPlan& plan;
  const PreparedX& xp;
  int32_t* partials;
  std::atomic<int64_t>* pending;
  std::atomic<int64_t>& bad_row;
};

// Keeps the first failing row (a Run reports one).
[[gnu::always_inline]] inline void report_bad_row(std::atomic<int64_t>& bad_row, int64_t row) {
  int64_t expected = -1;
  bad_row.compare_exchange_strong(expected, row);
}

// k block b of few-row expert g: its int32 partial sums (and column sums) into partials.
[[gnu::always_inline]] inline void run_gemv_task(const TaskRun& run, const Gemv& g, int64_t b) {
  const Problem& p = run.p;
  const int64_t n_pad = run.plan.n_pad;
  const int64_t rows = g.r1 - g.r0;
  GemvArgs a;
  a.xprep = run.xp.rows.get() + g.r0 * run.xp.stride;
  a.xprep_stride = run.xp.stride;
  a.rows = rows;
  a.k = p.k;
  a.n = p.n;
  a.k0 = b * kGemvBlockK;
  a.k1 = std::min(p.k, a.k0 + kGemvBlockK);
  a.w = p.w + g.e * p.k * p.n;
  a.acc = run.partials + g.offset + static_cast<size_t>(b * (rows * n_pad + n_pad));
  a.colsum = a.acc + rows * n_pad;
  run.kern.gemv_partial(a);
}

// One column tile (kern.tile) or panel part (kern.panel) of rows [t.r0, t.r1) into out.
[[gnu::always_inline]] inline void run_tile_task(const TaskRun& run, const Tile& t) {
  const Problem& p = run.p;
  TileArgs a;
  a.mode = run.mode;
  a.x = p.x + t.r0 * p.k;
  a.xprep = run.xp.rows ? run.xp.rows.get() + t.r0 * run.xp.stride : nullptr;
  a.xprep_stride = run.xp.stride;
  a.rows = t.r1 - t.r0;
  a.k = p.k;
  a.n = p.n;
  a.w = p.w + t.e * (p.w_quads ? (p.n + 15) / 16 * 16 * p.k : p.k * p.n);
  a.quads = p.w_quads;
  a.x_scale = p.x_scale + t.r0;
  a.w_scale = p.w_scale + t.e * p.n;
  a.col0 = t.col0;
  a.width = t.width;
  a.out = run.out + t.r0 * run.ldo + a.col0;
  a.ldo = run.ldo;
  a.bias = p.bias ? p.bias + t.e * p.n : nullptr;
  a.act = run.act;
  int64_t row = -1;
  if (!(t.panel ? run.kern.panel : run.kern.tile)(a, &row)) report_bad_row(run.bad_row, t.r0 + row);
}

// The epilogue of a chunk whose tasks are all done: a few-row expert's finish (sums of its k
// blocks, scales, bias, activation), then rows_done. Skipped once a row failed.
[[gnu::always_inline]] inline void finish_chunk(const TaskRun& run, const Chunk& c) {
  if (run.bad_row.load() >= 0) return;  // the Run fails; leave the rows alone
  if (c.gemv >= 0) {
    const Problem& p = run.p;
    const int64_t n_pad = run.plan.n_pad;
    const Gemv& g = run.plan.gemvs[static_cast<size_t>(c.gemv)];
    GemvFinishArgs f;
    f.mode = run.mode;
    f.partials = run.partials + g.offset;
    f.colsums = f.partials + (g.r1 - g.r0) * n_pad;
    f.nparts = run.plan.kblocks;
    f.part_stride = (g.r1 - g.r0) * n_pad + n_pad;
    f.rows = g.r1 - g.r0;
    f.n = p.n;
    f.x_scale = p.x_scale + g.r0;
    f.w_scale = p.w_scale + g.e * p.n;
    f.out = run.out + g.r0 * run.ldo;
    f.ldo = run.ldo;
    f.bias = p.bias ? p.bias + g.e * p.n : nullptr;
    f.act = run.act;
    int64_t row = -1;
    if (!run.kern.gemv_finish(f, &row)) {
      report_bad_row(run.bad_row, g.r0 + row);
      return;
    }
  }
  if (run.rows_done) run.rows_done(c.r0, c.r1);
}

// Task `task` of the parallel section: tiles first, then the k blocks. The last task of a
// chunk (counted down with acquire-release, so it sees every other task's writes) runs the
// chunk's epilogue.
[[gnu::always_inline]] inline void run_task(const TaskRun& run, size_t task) {
  const TaskPlan& plan = run.plan;
  size_t chunk;
  if (task >= plan.tiles.size()) {
    const size_t i = task - plan.tiles.size();
    const size_t kblocks = static_cast<size_t>(plan.kblocks);
    const Gemv& g = plan.gemvs[i / kblocks];
    chunk = g.chunk;
    run_gemv_task(run, g, static_cast<int64_t>(i % kblocks));
  } else {
    chunk = static_cast<size_t>(plan.tile_chunk[task]);
    run_tile_task(run, plan.tiles[task]);
  }
  if (run.pending[chunk].fetch_sub(1, std::memory_order_acq_rel) == 1) finish_chunk(run, plan.chunks[chunk]);
}

}  // namespace

void run_tiles(const char* op, Ort::KernelContext& ctx, const Problem& p, Mode mode,
               const Kernels& kern, float* out, int64_t ldo, const RowsDoneFn& rows_done,
               const Act& act) {
  if (p.rows_used == 0) return;
  const int64_t cols = mode == Mode::kSwiglu ? p.n / 2 : p.n;
  const int64_t tile_w = mode == Mode::kSwiglu ? kHalfCols : kTileCols;
  const int64_t col_tiles = (cols + tile_w - 1) / tile_w;
  const PreparedX xp = prepare_x(ctx, p, kern);
  const TaskPlan plan = plan_tasks(op, p, kern, cols, tile_w, col_tiles);

  // One parallel section: partial-sum tasks and tile tasks together, the last task of a chunk
  // running its epilogue (finish_chunk). No barrier between the phases.
  std::unique_ptr<int32_t[]> partials(plan.partial_ints ? new int32_t[plan.partial_ints] : nullptr);
  std::unique_ptr<std::atomic<int64_t>[]> pending(new std::atomic<int64_t>[plan.chunks.size() + 1]);
  for (size_t c = 0; c < plan.chunks.size(); ++c) pending[c].store(plan.chunk_tasks[c]);
  std::atomic<int64_t> bad_row{-1};
  const TaskRun run{p, mode, kern, out, ldo, rows_done, act, plan, xp, partials.get(), pending.get(), bad_row};
  // Tiles and panels (a whole expert's weights each, or a column share of them) come first and
  // the small k-block tasks last, so the pool's threads end at about the same time.
  const size_t n_partial = plan.gemvs.size() * static_cast<size_t>(plan.kblocks);
  parallel_for(ctx, n_partial + plan.tiles.size(), [&](size_t task) { run_task(run, task); });
  // Every chunk has at least one task: few-row experts need K > 0 (use_gemv), and with no
  // column tile at all (N = 0) there is nothing to finish (the SwiGLU op returns before).
  if (bad_row.load() >= 0)
    fail_invalid(op, "row ", bad_row.load(),
                 ": the dequantized product is not finite; check inputs 'x_scale' and 'weight_scale'");
}

}  // namespace ort_ops::grouped_matmul
