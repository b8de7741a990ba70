// SPDX-License-Identifier: MIT
// QuantizeKVCache's CPU cache update in two phases, shared with the ops that write the paged cache
// the same way (RotaryQuantizeKVCache): they differ only in where a token's float32 K and V rows
// come from.
//
// - quantize_live_rows (parallel over tokens): every live token's K and V row of each kv head is
//   quantized into scratch with the contract's row rule (DynamicQuant's row kernels: same rule,
//   same bits). Everything is quantized before any output byte is written, so a failing Run
//   (non-finite value) leaves a cache bound in place untouched.
// - write_caches: when an output is the very buffer of its input (IOBinding of one OrtValue to
//   both) nothing is copied; otherwise the input cache is copied to the output first. Then each
//   task (one token) scatters its rows: K rows are contiguous D bytes, V codes go to
//   value_cache[blk, h, d, off] with stride B (token innermost), scales to [blk, h, off].
//   Distinct slots (check_slots) mean tasks never write the same bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "ops/dynamic_quant/cpu.h"
#include "ops/quantize_kv_cache/validate.h"

namespace ort_ops::quantize_kv_cache {

// Codes and scales of T * H rows (row t * H + h); the rows of skipped tokens stay unused.
struct QuantizedRows {
  std::vector<int8_t> kq, vq;
  std::vector<float> ksc, vsc;
};

// Gives token t's float32 K and V rows, H * D values each (head h at h * D): either pointers into
// the input or into kbuf / vbuf (H * D floats each, the calling task's scratch) after filling them.
struct TokenRows {
  const float* k;
  const float* v;
};
using TokenRowsFn = std::function<TokenRows(int64_t t, float* kbuf, float* vbuf)>;

// What a non-finite row is called in the error, e.g. "input 'key' must be finite": the message
// goes on ", got NaN or Inf in token t, kv head h".
struct NonFiniteNames {
  const char* key;
  const char* value;
};

QuantizedRows quantize_live_rows(Ort::KernelContext& ctx, const char* op, const Dims& d, const int64_t* slot,
                                 dynamic_quant::QuantizeRowFn quantize_row, const TokenRowsFn& rows,
                                 const NonFiniteNames& names);

// Makes outputs first_output .. first_output + 3 (key_cache, value_cache, key_scale, value_scale),
// copies the input caches into them unless they are the same buffers, and writes the live rows.
void write_caches(Ort::KernelContext& ctx, const Caches& in, size_t first_output, const Dims& d,
                  const int64_t* slot, const QuantizedRows& rows);

}  // namespace ort_ops::quantize_kv_cache
