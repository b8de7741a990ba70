// SPDX-License-Identifier: MIT
// Plain C entry points over the CUDA launchers (raw device pointers + stream) so that tests and
// benchmarks can drive the kernels through ctypes without onnxruntime-gpu. Return 0 on success,
// a cudaError_t value on a CUDA failure, or -1 for an unsupported configuration (the message is
// copied into `msg`).
#include <cstring>

#include "ops/paged_attention_int8/cuda.cuh"
#include "ops/quantize_kv_cache/cuda.cuh"

#include "cuda/export.h"

namespace {

ort_ops::PagedAttentionParams pa_params(const void* query, int query_fp16, const void* key_cache,
                                        const void* value_cache, const void* key_scale, const void* value_scale,
                                        const void* block_tables, const void* seq_lens, const void* cu_seqlens_q,
                                        void* output, const int* dims, float scale, int pv_quant,
                                        int partition_size, int num_splits, float softcap, const void* head_sink,
                                        void* workspace, int* status) {
  ort_ops::PagedAttentionParams p;
  p.query = query;
  p.query_fp16 = query_fp16 != 0;
  p.key_cache = static_cast<const int8_t*>(key_cache);
  p.value_cache = static_cast<const int8_t*>(value_cache);
  p.key_scale = static_cast<const float*>(key_scale);
  p.value_scale = static_cast<const float*>(value_scale);
  p.block_tables = static_cast<const int32_t*>(block_tables);
  p.seq_lens = static_cast<const int32_t*>(seq_lens);
  p.cu_seqlens_q = static_cast<const int32_t*>(cu_seqlens_q);
  p.output = output;
  // dims: T, S, Hq, Hkv, D, B, M, N, max_q_len, max_context, decode_with_cu (0 or 1), window
  p.num_tokens = dims[0];
  p.num_seqs = dims[1];
  p.num_heads = dims[2];
  p.num_kv_heads = dims[3];
  p.head_dim = dims[4];
  p.block_size = dims[5];
  p.max_blocks = dims[6];
  p.num_blocks = dims[7];
  p.max_q_len = dims[8];
  p.max_context = dims[9];
  p.decode_with_cu = dims[10] != 0;
  p.window = dims[11];
  p.softcap = softcap;
  p.head_sink = static_cast<const float*>(head_sink);
  p.scale = scale;
  p.pv_quant = static_cast<ort_ops::PvQuant>(pv_quant);
  p.partition_size = partition_size;
  p.num_splits = num_splits;
  p.workspace = workspace;
  p.status = status;
  return p;
}

}  // namespace

// Scratch bytes and the split count a launch with these dims would use (dims as below).
ORT_OPS_CUDA_EXPORT long long ort_ops_cuda_paged_attention_int8_workspace(const int* dims, int partition_size,
                                                                          int num_splits, int* nsplit_out) {
  int one = 0;
  ort_ops::PagedAttentionParams p =
      pa_params(nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, dims, 1.0f, 1,
                partition_size, num_splits, 0.0f, nullptr, nullptr, &one);
  if (ort_ops::paged_attention_unsupported(p) != nullptr) return -1;
  if (nsplit_out) *nsplit_out = ort_ops::paged_attention_num_splits(p);
  return static_cast<long long>(ort_ops::paged_attention_workspace_bytes(p));
}

// The split count a launch with these dims would use on a GPU with `sms` SMs of `smem_per_sm`
// bytes of shared memory each (-1: unsupported dims). Needs no GPU.
ORT_OPS_CUDA_EXPORT int ort_ops_cuda_paged_attention_int8_plan(const int* dims, int partition_size, int sms,
                                                               int smem_per_sm) {
  int one = 0;
  ort_ops::PagedAttentionParams p =
      pa_params(nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, dims, 1.0f, 1,
                partition_size, 0, 0.0f, nullptr, nullptr, &one);
  if (ort_ops::paged_attention_unsupported(p) != nullptr || sms < 1 || smem_per_sm < 1) return -1;
  return ort_ops::paged_attention_num_splits(p, ort_ops::DeviceLimits{sms, smem_per_sm});
}

ORT_OPS_CUDA_EXPORT int ort_ops_cuda_paged_attention_int8(
    const void* query, int query_fp16, const void* key_cache, const void* value_cache, const void* key_scale,
    const void* value_scale, const void* block_tables, const void* seq_lens, const void* cu_seqlens_q, void* output,
    const int* dims, float scale, int pv_quant, int partition_size, int num_splits, float softcap,
    const void* head_sink, void* workspace, int* status, void* stream, char* msg, int msg_len) {
  if (pv_quant < 0 || pv_quant > 2) {
    if (msg && msg_len > 0) std::strncpy(msg, "pv_quant must be 0 (none), 1 (s8) or 2 (u8)", msg_len - 1);
    return -1;
  }
  const ort_ops::PagedAttentionParams p =
      pa_params(query, query_fp16, key_cache, value_cache, key_scale, value_scale, block_tables, seq_lens,
                cu_seqlens_q, output, dims, scale, pv_quant, partition_size, num_splits, softcap, head_sink,
                workspace, status);
  if (const char* why = ort_ops::paged_attention_unsupported(p)) {
    if (msg && msg_len > 0) {
      std::strncpy(msg, why, msg_len - 1);
      msg[msg_len - 1] = '\0';
    }
    return -1;
  }
  return static_cast<int>(ort_ops::launch_paged_attention_int8(p, static_cast<cudaStream_t>(stream)));
}

ORT_OPS_CUDA_EXPORT int ort_ops_cuda_quantize_kv_cache(const void* key, const void* value, int input_fp16,
                                                       const void* slot_mapping, void* key_cache, void* value_cache,
                                                       void* key_scale, void* value_scale, int num_tokens,
                                                       int num_kv_heads, int head_dim, int block_size,
                                                       long long num_slots, int* status, void* stream) {
  // `status` is 32 bytes of device memory: the status word, then the slot check's scratch.
  ort_ops::QuantizeKvCacheParams p =
      ort_ops::kv_cache_params(slot_mapping, key_cache, value_cache, key_scale, value_scale, num_tokens, num_kv_heads,
                               head_dim, block_size, num_slots, status, reinterpret_cast<char*>(status) + 16);
  p.key = key;
  p.value = value;
  p.input_fp16 = input_fp16 != 0;
  return static_cast<int>(ort_ops::launch_quantize_kv_cache(p, static_cast<cudaStream_t>(stream)));
}
