// SPDX-License-Identifier: MIT
// Input validation and work splitting shared by GroupedMatmulSwigluQuant and
// GroupedMatmulDequant (CPU): both take x int8 [M, K], weight int8 [E, K, N], weight_scale
// [E, N], x_scale [M], group_list int64 [E] and differ only in the tile epilogue.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <vector>

#include "common/tensor.h"
#include "onnxruntime_cxx_api.h"
#include "ops/grouped_matmul/cpu.h"
#include "ops/grouped_matmul/validate.h"
#include "ops/grouped_matmul_swiglu_quant/weight_layout.h"

namespace ort_ops::grouped_matmul {

struct Problem {
  int64_t m = 0, k = 0, n = 0, e = 0;
  const int8_t* x = nullptr;
  const int8_t* w = nullptr;
  bool w_quads = false;  // w is [E, ceil(N/16), K/4, 16, 4] ("EN16K4"): needs kern.panel; every expert
                         // runs as panels
  std::vector<float> w_scale_f32, x_scale_f32;  // filled only for float16 scales
  const float* bias = nullptr;                  // [E, N] float32, or nullptr (no bias input)
  const float* w_scale = nullptr;               // [E, N]
  const float* x_scale = nullptr;               // [M]
  std::vector<int64_t> ends;                    // end row of each expert's group
  int64_t rows_used = 0;                        // last group end: rows past it are not computed
};

// If input `index` (the weight) is a constant initializer of at least a few MB, asks Linux to
// back it with 2 MB pages (MADV_COLLAPSE, once, here at kernel creation). The grouped GEMM reads
// every weight byte once per Run along short strided segments, so with 4 KB pages a large part
// of its time is page walks; the contents are not touched. ORT_OPS_CPU_HUGEPAGES=0 skips it;
// a kernel or file system that refuses is ignored.
void advise_weight_pages(const OrtKernelInfo* info, size_t index);

// Validates inputs 0..5 (bias: dtype, shape and, on the CPU, finite values) and the attribute
// value; throws OpError naming the op and the input.
Problem read_problem(const char* op, Ort::KernelContext& ctx, int64_t group_list_type, bool even_n);
// The same on inputs already read (a caller that first maps another weight layout to the logical
// [E, K, N] shape for validation; p.w is the weight's data as given).
Problem read_problem(const char* op, const Inputs& in, int64_t group_list_type, bool even_n);

using gmsq_layout::WeightLayout;
struct FreeDeleter {
  void operator()(int8_t* p) const { std::free(p); }
};
using WeightScratch = std::unique_ptr<int8_t[], FreeDeleter>;

// read_problem for a weight stored in `layout` (the attribute weight_layout of both ops,
// ops/grouped_matmul_swiglu_quant/weight_layout.h): "EKN" is read_problem itself. "ENK" and
// "EN16K4" are first checked in their own shape and mapped to the logical [E, K, N] (same
// messages for every other input); then "EN16K4" with kern.panel (AMX) points p.w at the weight
// as it is (p.w_quads: the panels read it, no per-Run packing), while "ENK" and "EN16K4" without
// panels transpose / unpack every expert that has rows into `scratch` ([E, K, N], 2 MB pages;
// unused experts untouched) and point p.w there. even_n: GroupedMatmulSwigluQuant's even N.
Problem read_problem_layout(const char* op, Ort::KernelContext& ctx, WeightLayout layout, int64_t group_list_type,
                            bool even_n, const Kernels& kern, WeightScratch& scratch);

// What both CPU ops read once, at kernel creation: the CPU variant (errors name `op`), the
// attributes group_list_type and weight_layout, and that variant's GEMM kernels; it also advises
// 2 MB pages for the weight (input 1, advise_weight_pages).
struct CpuOpConfig {
  CpuOpConfig(const char* op, const OrtKernelInfo* info)
      : isa(selected_isa(op)),
        group_list_type(read_group_list_type(op, info)),
        layout(gmsq_layout::read_weight_layout(op, info)),
        kernels(kernels_for(isa)) {
    advise_weight_pages(info, 1);
  }

  // read_problem_layout with these attributes and kernels.
  Problem read_problem(const char* op, Ort::KernelContext& ctx, bool even_n,
                       WeightScratch& scratch) const {
    return read_problem_layout(op, ctx, layout, group_list_type, even_n, kernels, scratch);
  }

  CpuIsa isa;
  int64_t group_list_type;
  WeightLayout layout;
  Kernels kernels;
};

// Runs every (expert, row chunk, column tile) task, and for few-row experts every (expert,
// k block) partial-sum task then one epilogue task per expert, over ORT's pool.
//   kDequant: out = y [M, N] (ldo = N), columns [0, N).
//   kSwiglu:  out = S [M, N/2] (ldo = N/2), A/G column pairs [0, N/2).
// C includes p.bias when there is one; kSwiglu applies `act`. Rows past rows_used are not
// touched. A non-finite C in a SwiGLU tile fails the Run.
// rows_done(r0, r1) (optional) runs in the second phase once rows [r0, r1) are complete: the
// SwiGLU op quantizes them there, saving a third barrier.
using RowsDoneFn = std::function<void(int64_t r0, int64_t r1)>;
void run_tiles(const char* op, Ort::KernelContext& ctx, const Problem& p, Mode mode,
               const Kernels& kern, float* out, int64_t ldo, const RowsDoneFn& rows_done = nullptr,
               const Act& act = Act{});

}  // namespace ort_ops::grouped_matmul
