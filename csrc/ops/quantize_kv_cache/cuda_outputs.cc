// SPDX-License-Identifier: MIT
#include "ops/quantize_kv_cache/cuda_outputs.h"

#include "common/tensor.h"

namespace ort_ops::quantize_kv_cache {

CudaCacheOutputs::CudaCacheOutputs(const char* op, Ort::KernelContext& ctx, const Caches& in, size_t first_output,
                                   const Dims& d, cudaStream_t stream, int* status) {
  auto* kc_out = make_output<int8_t>(ctx, first_output + 0, in.key_cache.shape);
  auto* vc_out = make_output<int8_t>(ctx, first_output + 1, in.value_cache.shape);
  auto* ks_out = make_output<float>(ctx, first_output + 2, in.key_scale.shape);
  auto* vs_out = make_output<float>(ctx, first_output + 3, in.value_scale.shape);
  auto copy_unless_same = [&](const InputView& src, void* out, size_t bytes) {
    if (out != src.data && bytes)
      cuda_util::check_cuda(op, cudaMemcpyAsync(out, src.data, bytes, cudaMemcpyDeviceToDevice, stream), "cache copy");
  };
  copy_unless_same(in.key_cache, kc_out, in.key_cache.numel);
  copy_unless_same(in.value_cache, vc_out, in.value_cache.numel);
  copy_unless_same(in.key_scale, ks_out, in.key_scale.numel * sizeof(float));
  copy_unless_same(in.value_scale, vs_out, in.value_scale.numel * sizeof(float));
  const size_t ws = quantize_kv_cache_workspace_bytes(d.T);
  if (ws) scratch_.emplace(op, ctx, ws);
  params_ = kv_cache_params(in.slot_mapping.data, kc_out, vc_out, ks_out, vs_out, static_cast<int>(d.T),
                            static_cast<int>(d.H), static_cast<int>(d.D), static_cast<int>(d.B), d.N * d.B, status,
                            ws ? scratch_->get() : nullptr);
}

}  // namespace ort_ops::quantize_kv_cache
