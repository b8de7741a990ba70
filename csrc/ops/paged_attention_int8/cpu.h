// SPDX-License-Identifier: MIT
// PagedAttentionInt8 CPU kernels: one task = one (sequence, kv head, query chunk, key range).
// op.cc validates every input, prepares the queries, plans the tasks and merges the partial
// results; the ISA variants (cpu_scalar.cc, cpu_avx2.cc, cpu_avxvnni.cc, cpu_avx512vnni.cc) run
// tasks with the same driver (cpu_driver.h) over their own primitives. The spec is
// ort_ops/ops/paged_attention_int8.py.
#pragma once

#include <cstdint>

#include "common/cpu_features.h"

namespace ort_ops::paged_attention_int8 {

enum class PvMode : int { kNone = 0, kS8 = 1, kU8 = 2 };

// W scale group: absolute key positions [32g, 32g + 32), the K extent of one INT8 P.V dot
// (DESIGN.md). Tiles and partitions are multiples of it, aligned to position 0, so no group
// ever straddles two tiles.
constexpr int64_t kGroup = 32;
// Key tile of the online softmax: scores of all task rows for this many keys stay in L1/L2.
constexpr int64_t kTile = 256;
// Rows (query token x q head of one kv head) per prefill task: their K/V reads are shared.
constexpr int64_t kMaxRows = 64;

struct Params {
  // Cache (DESIGN.md layouts) and the tables; every block id a task can read was validated.
  const int8_t* key_cache;    // [N, Hkv, B, D]
  const int8_t* value_cache;  // [N, Hkv, D, B]
  const float* key_scale;     // [N, Hkv, B]
  const float* value_scale;   // [N, Hkv, B]
  const int32_t* block_tables;  // [S, max_blocks]
  int64_t max_blocks;
  int64_t num_kv_heads, block_size, log2_block, head_dim;
  int64_t padded_dim;  // head_dim rounded up to 32: query rows are zero padded to it
  int64_t num_q_heads, group;  // group = Hq / Hkv
  float scale;
  int64_t window;  // > 0: row at position p sees keys p - window < k <= p (DESIGN.md); 0: none
  float softcap;   // > 0: s = softcap * tanh(s / softcap) after the scale; 0: off
  bool qk_s8;
  PvMode pv;
  // Prepared query rows, row (token t, q head h) at t * Hq + h, each padded_dim long.
  const int8_t* q_codes;  // qk s8: codes, zero padded
  const float* q_scale;   // qk s8: per-row scale
  const float* q_f32;     // qk none: float32 values, zero padded
  // Partial results of key range `split` of token t, head h: slot (part_offset[t] + split) * Hq + h.
  const int64_t* part_offset;
  float* part_o;  // [slots, D] unnormalized output sum_t exp(s_t - m) * sV_t * V_t (quantized)
  float* part_m;  // [slots] running max m
  float* part_l;  // [slots] sum_t exp(s_t - m)
};

struct Task {
  int64_t seq, kv_head;
  int64_t q_row0, n_q;  // query tokens q_row0 .. q_row0 + n_q - 1 (rows of T)
  int64_t first_pos;    // position of token q_row0 in its sequence
  // Key positions of this task; key_begin a multiple of 32. With a window, key_begin is at most
  // 31 positions before the first row's window start, and positions before that start (which
  // may lie in blocks wholly before the window) are not read.
  int64_t key_begin, key_end;
  int64_t split;        // index of this key range among the token's ranges
};

// A task's working memory, allocated by op.cc (compiled without ISA flags) so that the ISA
// files instantiate no std containers: an inline library function compiled with AVX-512 flags
// could otherwise be the copy the linker keeps for every caller. R = rows of the task.
struct Scratch {
  const int8_t** q_codes;  // [R]
  const float** q_f32;     // [R]
  float* q_scale;          // [R]
  float* m;                // [R]
  float* l;                // [R]
  int64_t* last_pos;       // [R]
  float* out;              // [R, D]
  int32_t* iscore;         // [R, kTile]
  float* score;            // [R, kTile]
  float* w;                // [R, kTile]
  const int8_t** kptr;     // [kTile]
  float* sk;               // [kTile]
  float* sv;               // [kTile]
  uint8_t* codes;          // [R, kGroup]
  float* gscale;           // [R]
  int8_t* vgather;         // [D, kGroup]
};

using TaskFn = void (*)(const Params&, const Task&, const Scratch&);

void run_task_scalar(const Params& p, const Task& t, const Scratch& s);
void run_task_avx2(const Params& p, const Task& t, const Scratch& s);
void run_task_avxvnni(const Params& p, const Task& t, const Scratch& s);
void run_task_avx512vnni(const Params& p, const Task& t, const Scratch& s);

inline TaskFn task_fn(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512Vnni: return run_task_avx512vnni;
    case CpuIsa::kAvxVnni: return run_task_avxvnni;
    case CpuIsa::kAvx2: return run_task_avx2;
    default: return run_task_scalar;
  }
}

}  // namespace ort_ops::paged_attention_int8
