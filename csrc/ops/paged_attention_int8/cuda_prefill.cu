// SPDX-License-Identifier: MIT
// PagedAttentionInt8 prefill kernel (64 rows per CTA): being written; until it lands, no launch
// takes this path (paged_attention_prefill_applies is false) and the general kernel runs prefill.
#include "ops/paged_attention_int8/cuda_prefill.cuh"

namespace ort_ops {

bool paged_attention_prefill_applies(const PagedAttentionParams&) { return false; }

int paged_attention_prefill_ctas_per_sm(int) { return 1; }

cudaError_t launch_paged_attention_prefill(const PagedAttentionParams&, const PrefillTiling&, cudaStream_t) {
  return cudaErrorNotSupported;
}

}  // namespace ort_ops
