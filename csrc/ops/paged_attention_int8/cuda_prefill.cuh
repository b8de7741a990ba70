// SPDX-License-Identifier: MIT
// PagedAttentionInt8 prefill kernel (cuda_prefill.cu): 64 (query, q head) rows per CTA, the
// launcher in cuda.cu dispatches to it. Contract: cuda.cuh.
#pragma once

#include <cuda_runtime.h>

#include "ops/paged_attention_int8/cuda.cuh"

namespace ort_ops {

constexpr int kPrefillRows = 64;  // (query, q head) rows of one prefill CTA: 64 / G queries x G heads

// Whether the prefill kernel takes this launch: cu_seqlens_q present (and not the decode kernel's
// launch), D 64 / 128, G in {1, 2, 4, 8}, and max_q_len * G >= 32 (fewer rows would leave most
// of its 64 MMA rows empty; the general kernel's 16-row tiles serve them). The environment
// variable ORT_OPS_PA_PREFILL=general forces the general kernel (benchmarks compare the two).
bool paged_attention_prefill_applies(const PagedAttentionParams& p);

// Prefill CTAs resident per SM (the split model in cuda.cu's tile_shape uses it).
int paged_attention_prefill_ctas_per_sm(int head_dim, int smem_per_sm);

// The launch's tiling as cuda.cu's tile_shape chose it: n_qt row tiles of qpt queries (x G heads)
// per sequence and kv head, nsplit key splits of ppc partitions each (workspace and merge as for
// the general kernel).
struct PrefillTiling {
  int n_qt, qpt, nsplit, ppc;
};

cudaError_t launch_paged_attention_prefill(const PagedAttentionParams& p, const PrefillTiling& t,
                                           cudaStream_t stream);

}  // namespace ort_ops
