// SPDX-License-Identifier: MIT
// The task driver shared by every ISA variant: included by cpu_<isa>.cc and instantiated with
// that file's primitives (struct Kern, all static), so each variant is compiled with its own ISA
// flags and the primitives inline. The scalar primitives (cpu_scalar.cc) are the readable twin.
//
// One task: rows r = j * group + hh (query token q_row0 + j, q head kv_head * group + hh) over
// the keys [key_begin, key_end). Key tiles of up to kTile positions, aligned to absolute
// position 0 (so a 32-position W group never straddles tiles), each:
//   1. token pointers: key row, key/value scale of each position (through block_tables);
//      positions before the first row's window start get a zero K row and zero scales instead
//      (their blocks may lie wholly before the window, whose block-table entries are not read);
//   2. scores s = (Qq . Kq) * sQ * sK * scale (int32 dots), or (q . Kq) * sK * scale for qk none;
//      with a softcap, s = softcap * tanh(s / softcap) (DESIGN.md's float order);
//   3. online softmax: m' = max(m, tile max); O *= exp(m - m'), l = l * exp(m - m') + sum e;
//      e_t = exp(s_t - m') for the keys a row sees (causal and window), 0 elsewhere;
//   4. W_t = e_t * sV_t; per group: codes = min(rint(W * (L / max W)), L), then the int32 sums
//      sum_t code_t * Vq_t[d] over one 32-token V slice per output dim, and
//      O[d] += (max W / L) * isum[d]. (pv none: O[d] += sum_t W_t * Vq_t[d] in float.)
// The task stores (O, m, l) of each row; op.cc merges key ranges by log-sum-exp and divides by
// l (adding the head's sink there). Codes of a group do not change when its W share a factor (up to rounding), so this equals
// the reference's normalized-P semantics up to float rounding.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "ops/paged_attention_int8/cpu.h"

namespace ort_ops::paged_attention_int8 {

namespace {

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline float fmax2(float a, float b) { return a < b ? b : a; }
inline void prefetch_range(const int8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
  __builtin_prefetch(p + bytes - 1);
}
inline void fill0(float* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = 0.0f;
}
// Stands in for K rows before the window start: the Q.K primitives read up to the padded head
// dim (<= 256) from every row pointer.
alignas(64) constexpr int8_t kZeroKeyRow[256] = {};

template <class Kern>
void run_task_impl(const Params& p, const Task& task, const Scratch& sc) {
  const int64_t G = p.group, D = p.head_dim, B = p.block_size;
  const int64_t R = task.n_q * G;
  const int64_t Hkv = p.num_kv_heads, Hq = p.num_q_heads;
  const float levels = p.pv == PvMode::kU8 ? 255.0f : 127.0f;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Row setup: query pointers, last visible position, running state.
  const int8_t** q_codes = sc.q_codes;
  const float** q_f32 = sc.q_f32;
  float *q_scale = sc.q_scale, *m = sc.m, *l = sc.l;
  int64_t* last_pos = sc.last_pos;
  for (int64_t j = 0; j < task.n_q; ++j) {
    for (int64_t hh = 0; hh < G; ++hh) {
      const int64_t r = j * G + hh;
      const int64_t qrow = (task.q_row0 + j) * Hq + task.kv_head * G + hh;
      if (p.qk_s8) {
        q_codes[r] = p.q_codes + qrow * p.padded_dim;
        q_scale[r] = p.q_scale[qrow];
      } else {
        q_f32[r] = p.q_f32 + qrow * p.padded_dim;
      }
      last_pos[r] = task.first_pos + j;
      m[r] = neg_inf;
      l[r] = 0.0f;
    }
  }
  float* out = sc.out;
  fill0(out, R * D);
  int32_t* iscore = sc.iscore;
  float *score = sc.score, *w = sc.w, *sk = sc.sk, *sv = sc.sv, *gscale = sc.gscale;
  const int8_t** kptr = sc.kptr;
  uint8_t* codes = sc.codes;
  int8_t* vgather = sc.vgather;

  // First key position any row reads: the first row's window start (rows are in position order).
  const int64_t read_begin =
      p.window > 0 ? std::max(task.key_begin, task.first_pos - p.window + 1) : task.key_begin;
  const int32_t* table = p.block_tables + task.seq * p.max_blocks;
  // (block, kv head) row index and in-block offset of key position pos.
  auto cache_bh = [&](int64_t pos) { return int64_t{table[pos >> p.log2_block]} * Hkv + task.kv_head; };

  for (int64_t t0 = task.key_begin; t0 < task.key_end;) {
    const int64_t t1 = imin(task.key_end, (t0 / kTile + 1) * kTile);
    const int64_t n = t1 - t0;
    const int64_t n_pad = (n + kGroup - 1) / kGroup * kGroup;
    // 1. token pointers and scales, one block-table lookup per run of tokens in one block.
    // The tile's K rows and V slices are prefetched here: the cache is far larger than any CPU
    // cache and its blocks are scattered, so the hardware prefetcher restarts at every block;
    // asking for the whole tile (<= 64 KB) up front keeps many misses in flight while the
    // Q.K arithmetic runs.
    for (int64_t i = 0; i < n;) {
      if (t0 + i < read_begin) {  // before every row's window: masked below, never read
        const int64_t run = imin(read_begin - t0 - i, n - i);
        for (int64_t j = 0; j < run; ++j) {
          kptr[i + j] = kZeroKeyRow;
          sk[i + j] = 0.0f;
          sv[i + j] = 0.0f;
        }
        i += run;
        continue;
      }
      const int64_t off = (t0 + i) & (B - 1);
      const int64_t run = imin(B - off, n - i);
      const int64_t bh = cache_bh(t0 + i);
      const int64_t row = bh * B + off;
      const int8_t* k = p.key_cache + row * D;
      prefetch_range(k, run * D);
      const int8_t* v = p.value_cache + bh * D * B;
      if (run == B) {
        prefetch_range(v, D * B);  // the whole block: D rows of B tokens, contiguous
      } else {
        for (int64_t d = 0; d < D; ++d) prefetch_range(v + d * B + off, run);
      }
      for (int64_t j = 0; j < run; ++j) kptr[i + j] = k + j * D;
      std::memcpy(sk + i, p.key_scale + row, run * sizeof(float));
      std::memcpy(sv + i, p.value_scale + row, run * sizeof(float));
      i += run;
    }
    // 2. scores for every row and key of the tile (causal masking below).
    if (p.qk_s8) {
      Kern::qk_s8(q_codes, R, kptr, n, D, iscore, kTile);
      for (int64_t r = 0; r < R; ++r) {
        const int32_t* is = iscore + r * kTile;
        float* s = score + r * kTile;
        for (int64_t i = 0; i < n; ++i)
          s[i] = ((static_cast<float>(is[i]) * q_scale[r]) * sk[i]) * p.scale;
      }
    } else {
      Kern::qk_f32(q_f32, R, kptr, n, D, score, kTile);
      for (int64_t r = 0; r < R; ++r) {
        float* s = score + r * kTile;
        for (int64_t i = 0; i < n; ++i) s[i] = (s[i] * sk[i]) * p.scale;
      }
    }
    if (p.softcap > 0.0f)
      for (int64_t r = 0; r < R; ++r) Kern::softcap(score + r * kTile, n, p.softcap);
    // 3. online softmax and 4a. W = e * sV (zero outside each row's visible keys lo .. nv - 1).
    for (int64_t r = 0; r < R; ++r) {
      float* wr = w + r * kTile;
      const int64_t nv = imin(n, last_pos[r] - t0 + 1);  // keys this row sees in the tile end here
      const int64_t lo = p.window > 0 ? std::max<int64_t>(0, last_pos[r] - p.window + 1 - t0) : 0;
      if (nv <= lo) {
        fill0(wr, n_pad);
        continue;
      }
      float* s = score + r * kTile + lo;
      const float m_new = fmax2(m[r], Kern::row_max(s, nv - lo));
      const float alpha = m[r] == neg_inf ? 0.0f : expf(m[r] - m_new);
      const float sum = Kern::exp_sub(s, nv - lo, m_new);
      if (alpha != 1.0f) Kern::scale(out + r * D, D, alpha);
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
      fill0(wr, lo);
      Kern::mul(s, sv + lo, wr + lo, nv - lo);
      fill0(wr + nv, n_pad - nv);
    }
    // 4b. P.V per 32-position group.
    for (int64_t g0 = 0; g0 < n; g0 += kGroup) {
      const int8_t* vsrc;
      int64_t stride;
      if (B >= kGroup) {
        // The group is 32 tokens of one block (B and the group start are multiples of 32):
        // one contiguous 32-byte slice per output dim. Slots past the context are read but
        // their W code is 0.
        const int64_t bh = cache_bh(t0 + g0), off = (t0 + g0) & (B - 1);
        vsrc = p.value_cache + bh * D * B + off;
        stride = B;
      } else {
        // Blocks of 8 or 16 tokens: gather the group's slices; positions past the tile end
        // (whose blocks may not exist) and blocks wholly before the window are zeros.
        for (int64_t sub = 0; sub < kGroup; sub += B) {
          if (g0 + sub >= n || t0 + g0 + sub + B <= read_begin) {
            for (int64_t d = 0; d < D; ++d) std::memset(vgather + d * kGroup + sub, 0, B);
            continue;
          }
          const int8_t* src = p.value_cache + cache_bh(t0 + g0 + sub) * D * B;  // offset 0
          int8_t* dst = vgather + sub;
          if (B == 16) {  // constant sizes: plain 16- and 8-byte moves, no library call
            for (int64_t d = 0; d < D; ++d) std::memcpy(dst + d * kGroup, src + d * 16, 16);
          } else {
            for (int64_t d = 0; d < D; ++d) std::memcpy(dst + d * kGroup, src + d * 8, 8);
          }
        }
        vsrc = vgather;
        stride = kGroup;
      }
      if (p.pv == PvMode::kNone) {
        Kern::pv_f32(w + g0, kTile, R, vsrc, stride, D, out, D);
        continue;
      }
      bool any = false;
      for (int64_t r = 0; r < R; ++r) {
        const float* wr = w + r * kTile + g0;
        const float gmax = Kern::max32(wr);
        gscale[r] = gmax / levels;
        if (gmax > 0.0f) {
          Kern::quant32(wr, std::min(levels / gmax, std::numeric_limits<float>::max()), levels, codes + r * kGroup);  // L / max saturates (DESIGN.md)
          any = true;
        } else {
          std::memset(codes + r * kGroup, 0, kGroup);
        }
      }
      if (!any) continue;
      Kern::pv_int(codes, R, vsrc, stride, D, p.pv == PvMode::kU8, gscale, out, D);
    }
    t0 = t1;
  }

  for (int64_t j = 0; j < task.n_q; ++j) {
    for (int64_t hh = 0; hh < G; ++hh) {
      const int64_t r = j * G + hh;
      const int64_t slot = (p.part_offset[task.q_row0 + j] + task.split) * Hq + task.kv_head * G + hh;
      std::memcpy(p.part_o + slot * D, out + r * D, D * sizeof(float));
      p.part_m[slot] = m[r];
      p.part_l[slot] = l[r];
    }
  }
}

}  // namespace
}  // namespace ort_ops::paged_attention_int8
