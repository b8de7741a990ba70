// SPDX-License-Identifier: MIT
// PagedAttentionInt8 on NVIDIA tensor cores: launcher on raw device pointers (no ORT headers).
// Spec: ort_ops/ops/paged_attention_int8.py (DESIGN.md "PagedAttentionInt8").
//
// Alphabet: T query tokens, S sequences, Hq query heads, Hkv kv heads, G = Hq / Hkv, D head dim,
// N cache blocks, B block size, M max blocks per sequence, P partition size.
//   query        [T, Hq, D] fp16 or fp32        output [T, Hq, D], dtype of query
//   key_cache    int8 [N, Hkv, B, D]            value_cache int8 [N, Hkv, D, B] (token innermost)
//   key_scale    float32 [N, Hkv, B]            value_scale float32 [N, Hkv, B]
//   block_tables int32 [S, M]   seq_lens int32 [S]   cu_seqlens_q int32 [S + 1] or null (decode)
// Supported here: D in {32, 64, 128, 256}; B a power of two >= 16 (16-byte V loads of one block);
// qk_quant s8; pv_quant s8, u8 or none (float P.V twin on fp16 tensor cores); window, softcap
// and head_sink as DESIGN.md defines them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ort_ops {

// Bits the kernels OR into *status (a device int the caller zeroes and reads back). Any set bit
// means the output is not the op's result; the kernels never read out of bounds.
enum PagedAttentionStatus : int {
  kPaBlockOutOfRange = 1,   // a block_tables entry a visible position needs is not in 0..N-1
  kPaSeqLenOutOfRange = 2,  // seq_lens[s] < 0, > M * B, or < the sequence's query count
  kPaCuSeqlensBad = 4,      // cu_seqlens_q not rising from 0 to T, or a q_len over max_q_len
  kPaQueryNonFinite = 8,    // NaN/Inf in the query
  // decode_with_cu only: some sequence's cu_seqlens_q count is not 1, so the decode kernel left
  // its rows undone; relaunch with decode_with_cu false (and max_q_len = T) for the result.
  kPaNotOneQueryEach = 16,
  kPaSinkNonFinite = 32,    // NaN/Inf in head_sink
};

enum class PvQuant : int { kNone = 0, kS8 = 1, kU8 = 2 };

struct PagedAttentionParams {
  const void* query = nullptr;
  bool query_fp16 = false;
  const int8_t* key_cache = nullptr;
  const int8_t* value_cache = nullptr;
  const float* key_scale = nullptr;
  const float* value_scale = nullptr;
  const int32_t* block_tables = nullptr;
  const int32_t* seq_lens = nullptr;
  const int32_t* cu_seqlens_q = nullptr;  // null: decode (T == S, one query per sequence)
  void* output = nullptr;                 // dtype of query
  int num_tokens = 0;                     // T
  int num_seqs = 0;                       // S
  int num_heads = 0;                      // Hq
  int num_kv_heads = 0;                   // Hkv
  int head_dim = 0;                       // D
  int block_size = 0;                     // B (a power of two >= 16)
  int log2_block_size = 0;                // set by the launcher
  int max_blocks = 0;                     // M
  int num_blocks = 0;                     // N
  int max_q_len = 1;    // upper bound on any sequence's query count (decode: 1; prefill: T)
  int max_context = 0;  // upper bound on seq_lens (<= M * B); sizes the grid
  float scale = 0.0f;
  int window = 0;        // > 0: the query at p sees keys p - window < k <= p; 0: no window
  float softcap = 0.0f;  // > 0: s = softcap * tanh(s / softcap) after the scale; 0: off
  const float* head_sink = nullptr;  // float32 [Hq] logits in the softmax denominator, or null
  PvQuant pv_quant = PvQuant::kS8;
  int partition_size = 256;  // multiple of 32; the unit in which keys are split across CTAs (speed only)
  // CTAs per (row tile, kv head) along the keys; 0: chosen here. Decode with a window splits the
  // window's span (splits start at the window's aligned start), not the whole context.
  int num_splits = 0;
  void* workspace = nullptr;  // paged_attention_workspace_bytes(...) bytes, 16-byte aligned
  // Required: where the kernels OR their status bits, device memory or pinned host memory mapped
  // into the device (cudaHostAllocMapped; the CUDA op's choice: no memset or copy node per Run).
  // The kernels only write it, and only on bad input.
  int* status = nullptr;
  // With cu_seqlens_q, T == S and max_q_len 1: take cu_seqlens_q as "probably one query per
  // sequence" and run the decode kernel (row cu_seqlens_q[s] for sequence s). A sequence whose
  // count is not 1 sets kPaNotOneQueryEach instead of being computed (see above). Real models
  // pass cu_seqlens_q on every step, so decode steps reach the decode kernel only this way.
  bool decode_with_cu = false;
};

// What the split model needs to know of a GPU: its SM count and shared memory per SM.
struct DeviceLimits {
  int sms = 1;
  int smem_per_sm = 0;
};

// The current device's limits (cudaDeviceGetAttribute, cached per device); {1, 0} when the
// device cannot be asked (launches then fail on their own).
DeviceLimits current_device_limits();

// The number of key splits a launch with these parameters would use on a GPU with `lim` (the
// launch arithmetic without a GPU: tests check it for other GPUs' limits).
int paged_attention_num_splits(const PagedAttentionParams& p, const DeviceLimits& lim);

// Whether decode_with_cu takes effect for these parameters (the decode kernel's shapes: T == S,
// max_q_len 1, G <= 8, D 32, 64 or 128); when false the launch ignores it.
bool paged_attention_decode_kernel_applies(const PagedAttentionParams& p);

// Validates what a launch cannot check on the device; returns nullptr when supported, else a
// message naming the unsupported value (the op turns it into an error naming the op).
const char* paged_attention_unsupported(const PagedAttentionParams& p);

// The number of key splits a launch will use (p.num_splits, or the launcher's choice when 0).
int paged_attention_num_splits(const PagedAttentionParams& p);

// Scratch bytes the launch needs (0 when a single split suffices: no merge step).
size_t paged_attention_workspace_bytes(const PagedAttentionParams& p);

// Runs the attention kernel and, with more than one split, the log-sum-exp merge kernel.
cudaError_t launch_paged_attention_int8(const PagedAttentionParams& p, cudaStream_t stream);

}  // namespace ort_ops
