// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant on the CPU EP (DESIGN.md "MoE"; spec: ort_ops/ops/_moe.py and
// ort_ops/ops/grouped_matmul_swiglu_quant.py). Inputs x int8 [M, K], weight int8 [E, K, N],
// weight_scale [E, N], x_scale [M] (float32/float16), group_list int64 [E]; outputs y int8
// [M, N/2], y_scale float32 [M], y_offset float32 [M] (zeros). Attributes group_list_type and
// weight_layout ("EKN": weight [E, K, N]; "ENK": [E, N, K]; "EN16K4": [E, N/16, K/4, 16, 4], weight_layout.h).
//
// Two phases: (1) grouped GEMM tasks write S = SwiGLU(C) as float32 [rows_used, N/2];
// (2) each finished row is quantized by the contract's rule (the DynamicQuant row kernel). A
// row needs every tile of its columns before its amax is known, hence the float buffer.
//
// "ENK" weights: the GEMM core (grouped_matmul/driver.h) reads [E, K, N], so each expert that has
// rows in this Run is transposed into a scratch [E, K, N] first (one task per expert; unused
// experts are neither read nor written). Same codes bit for bit; it costs a pass over the used
// weights per Run, so "EKN" is the CPU's fast layout ("ENK" is the Hopper wgmma kernel's):
// 8 experts x K 2048 x N 2816, 2 threads, medians of 9, one session: 32 rows EKN 2.3-2.5 ms,
// ENK 24-41 ms; 512 rows 6.3-7.1 vs 28-29 ms (a shared 2-core VM).
// "EN16K4" weights: with AMX the panels read them as they are (every expert, any row count, in
// chunks of kAmxPanelRows rows); other ISAs unpack each used expert into the scratch first.
#include "ops/grouped_matmul_swiglu_quant/op.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/convert.h"
#include "common/cpu_features.h"
#include "common/parallel.h"
#include "common/tensor.h"
#include "ops/dynamic_quant/cpu.h"
#include "ops/grouped_matmul/driver.h"
#include "ops/grouped_matmul/validate.h"
#include "ops/grouped_matmul_swiglu_quant/weight_layout.h"

namespace ort_ops {
namespace {

constexpr const char* kOp = "GroupedMatmulSwigluQuant";
using gmsq_layout::WeightLayout;

struct FreeDeleter {
  void operator()(int8_t* p) const { std::free(p); }
};
using WeightScratch = std::unique_ptr<int8_t[], FreeDeleter>;

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

// The Problem of an "ENK" or "EN16K4" weight, with p.w pointing at `scratch` (the used experts
// transposed or unpacked to [K, N]), or for "EN16K4" with `quads_direct` (the AMX panels read it)
// at the weight itself (p.w_quads). The checks and messages are read_problem's (on the weight's
// shape read in the layout's order).
grouped_matmul::Problem read_problem_layout(Ort::KernelContext& ctx, WeightLayout layout, int64_t group_list_type,
                                            bool quads_direct, WeightScratch& scratch) {
  using grouped_matmul::Problem;
  grouped_matmul::Inputs in = grouped_matmul::read_inputs(ctx);
  gmsq_layout::to_logical_weight(kOp, in, layout, true);
  Problem p = grouped_matmul::read_problem(kOp, in, group_list_type, true);
  const grouped_matmul::Dims d{p.m, p.k, p.n, p.e};

  if (layout == WeightLayout::kEN16K4 && quads_direct) {
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

class GroupedMatmulSwigluQuantCpu final : public KernelImpl {
 public:
  explicit GroupedMatmulSwigluQuantCpu(const OrtKernelInfo* info)
      : isa_(selected_isa(kOp)),
        group_list_type_(attr_int(info, "group_list_type", 0)),
        layout_(gmsq_layout::read_weight_layout(kOp, info)),
        kernels_(grouped_matmul::kernels_for(isa_)),
        quantize_row_(dynamic_quant::quantize_row_fn(isa_)) {
    if (group_list_type_ != 0 && group_list_type_ != 1)
      fail_invalid(kOp, "attribute 'group_list_type' must be 0 (cumulative) or 1 (counts), got ",
                   group_list_type_);
    grouped_matmul::advise_weight_pages(info, 1);
  }

  void compute(Ort::KernelContext& ctx) override {
    WeightScratch weight_ekn;  // "ENK" / "EN16K4" without panels: the used experts in [K, N]
    const grouped_matmul::Problem p =
        layout_ != WeightLayout::kEKN
            ? read_problem_layout(ctx, layout_, group_list_type_, kernels_.panel != nullptr, weight_ekn)
            : grouped_matmul::read_problem(kOp, ctx, group_list_type_, true);
    const int64_t h = p.n / 2;
    int8_t* y = make_output<int8_t>(ctx, 0, {p.m, h});
    float* y_scale = make_output<float>(ctx, 1, {p.m});
    float* y_offset = make_output<float>(ctx, 2, {p.m});
    std::fill(y_offset, y_offset + p.m, 0.0f);
    // Rows past the last group end: zeros and scale 0 (DESIGN.md; Ascend leaves them unwritten).
    std::fill(y + p.rows_used * h, y + p.m * h, int8_t{0});
    std::fill(y_scale + p.rows_used, y_scale + p.m, 0.0f);
    if (p.rows_used == 0) return;
    if (h == 0) {
      std::fill(y_scale, y_scale + p.rows_used, 0.0f);
      return;
    }

    std::unique_ptr<float[]> s(new float[static_cast<size_t>(p.rows_used * h)]);
    // Rows are quantized as soon as they are complete, in the GEMM's second phase.
    auto quantize_rows = [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        if (!quantize_row_(s.get() + r * h, nullptr, h, y + r * h, y_scale + r))
          fail_invalid(kOp, "row ", r,
                       ": the SwiGLU output overflows float32; check inputs 'x_scale' and 'weight_scale'");
    };
    grouped_matmul::run_tiles(kOp, ctx, p, grouped_matmul::Mode::kSwiglu, kernels_, s.get(), h, quantize_rows);
  }

 private:
  CpuIsa isa_;
  int64_t group_list_type_;
  WeightLayout layout_;
  grouped_matmul::Kernels kernels_;
  dynamic_quant::QuantizeRowFn quantize_row_;
};

}  // namespace

const CustomOp& grouped_matmul_swiglu_quant_cpu_op() {
  static const CustomOp op(grouped_matmul::swiglu_quant_signature(), kCpuEp, make_kernel<GroupedMatmulSwigluQuantCpu>);
  return op;
}

}  // namespace ort_ops
