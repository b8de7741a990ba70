// SPDX-License-Identifier: MIT
// MoeInitRouting on the CPU EP (spec: ort_ops/ops/moe_init_routing.py). x [M, H] float32/float16,
// expert_ids int32 [M, K], attribute num_experts -> sorted_x [M*K, H] (dtype of x, rows copied
// bit for bit), sorted_to_flat int32 [M*K], group_list int64 [E] (cumulative ends).
//
// A counting sort: one pass counts rows per expert, a prefix sum gives each expert's first row,
// a second pass in flat order places each pair, which makes the sort stable by construction.
// The row copies (the bulk of the work) then run over ORT's pool.
#include "ops/moe_init_routing/op.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/parallel.h"
#include "common/tensor.h"
#include "ops/moe_init_routing/validate.h"

namespace ort_ops {
namespace {

constexpr const char* kOp = "MoeInitRouting";

class MoeInitRoutingCpu final : public KernelImpl {
 public:
  explicit MoeInitRoutingCpu(const OrtKernelInfo* info)
      : num_experts_(moe_init_routing::read_num_experts(info)) {}

  void compute(Ort::KernelContext& ctx) override {
    const moe_init_routing::Inputs in = moe_init_routing::read_inputs(ctx);
    const InputView &x = in.x, &ids = in.expert_ids;
    const moe_init_routing::Dims d = moe_init_routing::validate_inputs(in);
    const int64_t h = d.H, k = d.K, total = d.total;
    const int32_t* id = ids.ptr<int32_t>();
    moe_init_routing::check_expert_ids(id, d, num_experts_);
    std::vector<int64_t> next(static_cast<size_t>(num_experts_) + 1, 0);
    for (int64_t f = 0; f < total; ++f) ++next[static_cast<size_t>(id[f]) + 1];
    int64_t* group_list = make_output<int64_t>(ctx, 2, {num_experts_});
    for (int64_t e = 0; e < num_experts_; ++e) {
      next[static_cast<size_t>(e) + 1] += next[static_cast<size_t>(e)];
      group_list[e] = next[static_cast<size_t>(e) + 1];
    }
    int32_t* s2f = make_output<int32_t>(ctx, 1, {total});
    for (int64_t f = 0; f < total; ++f) s2f[next[static_cast<size_t>(id[f])]++] = static_cast<int32_t>(f);

    auto* out = static_cast<uint8_t*>(make_output_raw(ctx, 0, {total, h}));
    // sorted_x_scale when the graph asks for it: x_scale of each sorted row, [0] without x_scale.
    if (ctx.GetOutputCount() > 3) {
      float* sorted_scale = make_output<float>(ctx, 3, {in.x_scale.present ? total : 0});
      if (in.x_scale.present) {
        const float* xs = in.x_scale.ptr<float>();
        for (int64_t i = 0; i < total; ++i) sorted_scale[i] = xs[s2f[i] / k];
      }
    }
    const size_t row_bytes = static_cast<size_t>(h) * static_cast<size_t>(d.elem_bytes);
    if (total == 0 || row_bytes == 0) return;
    const auto* src = static_cast<const uint8_t*>(x.data);
    const int64_t rows_per = std::max<int64_t>(1, static_cast<int64_t>((size_t{1} << 18) / row_bytes));
    const int64_t chunks = (total + rows_per - 1) / rows_per;
    parallel_for(ctx, static_cast<size_t>(chunks), [&](size_t c) {
      const int64_t i0 = static_cast<int64_t>(c) * rows_per;
      const int64_t i1 = std::min(total, i0 + rows_per);
      for (int64_t i = i0; i < i1; ++i)
        std::memcpy(out + i * row_bytes, src + (s2f[i] / k) * row_bytes, row_bytes);
    });
  }

 private:
  int64_t num_experts_;
};

}  // namespace

const CustomOp& moe_init_routing_cpu_op() {
  static const CustomOp op(moe_init_routing::signature(), kCpuEp, make_kernel<MoeInitRoutingCpu>);
  return op;
}

}  // namespace ort_ops
