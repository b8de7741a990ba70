// SPDX-License-Identifier: MIT
// PagedAttentionInt8 on ORT's CPU EP (DESIGN.md): query [T, Hq, D] float32/float16, the paged
// INT8 K/V cache with per-token scales, block_tables int32 [S, M], seq_lens int32 [S],
// cu_seqlens_q int32 [S + 1] optional -> output [T, Hq, D] (query's dtype). Spec:
// ort_ops/ops/paged_attention_int8.py.
//
// Design (what each task owns, where scales live):
// - Validation first, all of it: shapes, dtypes, Hq % Hkv (validate.cc, shared with the CUDA
//   op); the CPU kernels' limits (head_dim in {32, 64, 80, 96, 128, 256}, block size a power of two
//   8..256); the table values: seq_lens within the block table, every block id a query can
//   reach within 0..N-1 (not those of blocks wholly before the window: never read), cu_seqlens_q
//   rising from 0 to T with q_len <= seq_len, a finite head_sink. After this no task can read
//   outside the buffers.
// - Query prep (parallel over T * Hq rows): qk s8 quantizes each (token, q head) row with the
//   contract's rule into zero-padded codes + one scale; qk none keeps float32. Non-finite
//   queries fail the Run.
// - Tasks, run on ORT's intra-op pool. A task is (sequence, kv head, query chunk, key range):
//   its rows are the chunk's query tokens x the kv head's group of q heads, so the group shares
//   every K row and V slice it reads (GQA). A chunk of one query (decode, or the tail of a
//   prefill) splits its keys into partition_size ranges, one task each (parallelism for long
//   contexts at batch 1); a chunk of several queries (prefill, up to kMaxRows rows) walks all
//   its visible keys in one task with an online softmax over 256-position tiles, causal. With a
//   window both start at the (32-aligned) window start of their first query, so partitions and
//   tiles wholly before the window are never planned.
//   K/V scales live in the cache (per token, per kv head); query scales in the prep buffer; W
//   group scales only in the task's registers/stack.
// - Each task writes (O unnormalized, m, l) per row into its own partial slot; the merge
//   (parallel over tokens) combines a token's key ranges by log-sum-exp, adds the head's sink
//   to the denominator, divides by it and writes the output dtype.
#include "ops/paged_attention_int8/op.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/convert.h"
#include "common/cpu_features.h"
#include "common/parallel.h"
#include "common/tensor.h"
#include "ops/dynamic_quant/cpu.h"
#include "ops/paged_attention_int8/cpu.h"
#include "ops/paged_attention_int8/validate.h"

namespace ort_ops {
namespace {

namespace pa = paged_attention_int8;

using pa::kOp;

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr auto I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;

// validate.cc checks partition_size % 32; partitions must hold whole W scale groups.
static_assert(pa::kGroup == 32, "partition_size is checked as a multiple of 32");

// What the CPU kernels take (cpu.h): these head dims, power-of-two blocks of 8..256 keys.
void check_cpu_head_dim_and_block_size(int64_t D, int64_t B) {
  if (D != 32 && D != 64 && D != 80 && D != 96 && D != 128 && D != 256)
    fail_unsupported(kOp, "head_dim must be one of {32, 64, 80, 96, 128, 256}, got ", D);
  if (B < 8 || B > 256 || (B & (B - 1)) != 0)
    fail_unsupported(kOp, "block_size (dim 2 of input 'key_cache') must be a power of two in "
                     "8..256, got ", B);
}

constexpr pa::DeviceChecks kCpuChecks{nullptr, check_cpu_head_dim_and_block_size};

// A task's working memory (cpu.h, Scratch) carved from one buffer per pool thread that is kept
// across Runs: a decode step runs hundreds of tasks, and allocating per task would cost more
// than a 256-key partition's arithmetic.
pa::Scratch task_scratch(int64_t rows, int64_t d) {
  thread_local std::vector<unsigned char> buffer;
  const int64_t R = rows, T = pa::kTile, G = pa::kGroup;
  const int64_t sizes[] = {
      R * int64_t{sizeof(void*)}, R * int64_t{sizeof(void*)}, R * 4, R * 4, R * 4, R * 8,  // q_codes .. last_pos
      R * d * 4, R * T * 4, R * T * 4, R * T * 4,   // out, iscore, score, w
      T * int64_t{sizeof(void*)}, T * 4, T * 4,      // kptr, sk, sv
      R * G, R * 4, d * G};                          // codes, gscale, vgather
  int64_t offsets[sizeof(sizes) / sizeof(sizes[0])];
  int64_t total = 0;
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
    offsets[i] = total;
    total += (sizes[i] + 63) / 64 * 64;  // each array 64-byte aligned within the buffer
  }
  if (static_cast<int64_t>(buffer.size()) < total + 64) buffer.resize(total + 64);
  unsigned char* base = buffer.data();
  base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
  auto at = [&](int i) { return static_cast<void*>(base + offsets[i]); };
  return pa::Scratch{static_cast<const int8_t**>(at(0)), static_cast<const float**>(at(1)),
                     static_cast<float*>(at(2)),         static_cast<float*>(at(3)),
                     static_cast<float*>(at(4)),         static_cast<int64_t*>(at(5)),
                     static_cast<float*>(at(6)),         static_cast<int32_t*>(at(7)),
                     static_cast<float*>(at(8)),         static_cast<float*>(at(9)),
                     static_cast<const int8_t**>(at(10)), static_cast<float*>(at(11)),
                     static_cast<float*>(at(12)),        static_cast<uint8_t*>(at(13)),
                     static_cast<float*>(at(14)),        static_cast<int8_t*>(at(15))};
}

class PagedAttentionInt8Cpu final : public KernelImpl {
 public:
  explicit PagedAttentionInt8Cpu(const OrtKernelInfo* info)
      : isa_(selected_isa(kOp)), attrs_(pa::parse_attrs(info, kCpuChecks)) {
    pv_ = attrs_.pv_quant == "s8"   ? pa::PvMode::kS8
          : attrs_.pv_quant == "u8" ? pa::PvMode::kU8
                                    : pa::PvMode::kNone;
    task_ = pa::task_fn(isa_);
    quantize_row_ = dynamic_quant::quantize_row_fn(isa_);
    half_to_float_ = half_to_float_fn(isa_);
    float_to_half_ = float_to_half_fn(isa_);
  }

  void compute(Ort::KernelContext& ctx) override {
    const pa::Inputs in = pa::read_inputs(ctx);
    const pa::Dims dims = pa::validate_inputs(in, kCpuChecks);
    const InputView &q = in.query, &cu = in.cu_seqlens_q;
    const int64_t T = dims.T, Hq = dims.Hq, D = dims.D, N = dims.N, Hkv = dims.Hkv, B = dims.B,
                  S = dims.S, M = dims.M;
    const int32_t* seq_lens = in.seq_lens.ptr<int32_t>();
    const int32_t* tables = in.block_tables.ptr<int32_t>();

    // Query rows of each sequence.
    std::vector<int64_t> cu_q(S + 1);
    if (cu.present) {
      const int32_t* c = cu.ptr<int32_t>();
      for (int64_t s = 0; s <= S; ++s) cu_q[s] = c[s];
      bool ok = cu_q[0] == 0 && cu_q[S] == T;
      for (int64_t s = 0; s < S && ok; ++s) ok = cu_q[s] < cu_q[s + 1];
      if (!ok)
        fail_invalid(kOp, "input 'cu_seqlens_q' must rise from 0 to T = ", T,
                     " with at least one query row per sequence, got ", shape_str(cu_q));
    } else {
      for (int64_t s = 0; s <= S; ++s) cu_q[s] = s;  // decode: T == S, checked
    }
    for (int64_t s = 0; s < S; ++s) {
      const int64_t len = seq_lens[s];
      if (len < 0 || len > M * B)
        fail_invalid(kOp, "input 'seq_lens' must be in 0..", M * B,
                     " (max_blocks * block_size), got seq_lens[", s, "] = ", len);
      if (cu_q[s + 1] - cu_q[s] > len)
        fail_invalid(kOp, "input 'seq_lens' must be >= the query count of each sequence, got "
                     "seq_lens[", s, "] = ", len, " < ", cu_q[s + 1] - cu_q[s], " queries");
      if (cu_q[s + 1] == cu_q[s]) continue;  // no query reads this sequence's blocks
      const int64_t used = (len + B - 1) / B;
      const int64_t first = pa::first_visible(len, cu_q[s + 1] - cu_q[s], attrs_.window) / B;
      for (int64_t b = first; b < used; ++b) {
        const int64_t blk = tables[s * M + b];
        if (blk < 0 || blk >= N)
          fail_invalid(kOp, "input 'block_tables' must hold block ids in 0..", N - 1, ", got "
                       "block_tables[", s, ", ", b, "] = ", blk);
      }
    }

    const float* sink = in.head_sink.present ? in.head_sink.ptr<float>() : nullptr;
    for (int64_t h = 0; sink && h < Hq; ++h)
      if (!std::isfinite(sink[h]))
        fail_invalid(kOp, "input 'head_sink' must be finite, got ", sink[h], " at head ", h);

    void* out_raw = make_output_raw(ctx, 0, q.shape);
    if (T == 0 || Hq == 0) return;

    // Query prep: codes + scale (qk s8) or float32 (qk none), zero padded to a multiple of 32.
    const int64_t DP = (D + 31) / 32 * 32;
    const int64_t rows = T * Hq;
    std::vector<int8_t> q_codes(attrs_.qk_s8 ? rows * DP : 0, 0);
    std::vector<float> q_scale(attrs_.qk_s8 ? rows : 0);
    std::vector<float> q_f32(attrs_.qk_s8 ? 0 : rows * DP, 0.0f);
    parallel_for(ctx, static_cast<size_t>(T), [&](size_t ti) {
      const int64_t t = static_cast<int64_t>(ti);
      std::vector<float> buf(D);
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t r = t * Hq + h;
        float* x = attrs_.qk_s8 ? buf.data() : q_f32.data() + r * DP;
        if (q.dtype == F32)
          std::memcpy(x, q.ptr<float>() + r * D, D * sizeof(float));
        else
          half_to_float_(q.ptr<uint16_t>() + r * D, x, D);
        bool finite = true;
        if (attrs_.qk_s8) {
          finite = quantize_row_(x, nullptr, D, q_codes.data() + r * DP, &q_scale[r]);
        } else {
          for (int64_t d = 0; d < D; ++d) finite = finite && std::isfinite(x[d]);
        }
        if (!finite)
          fail_invalid(kOp, "input 'query' must be finite, got NaN or Inf in token ", t,
                       ", head ", h);
      }
    });

    // Plan: tasks and partial-result slots.
    const int64_t G = Hq / Hkv;
    const int64_t max_q = std::max<int64_t>(1, pa::kMaxRows / G);
    std::vector<int64_t> part_offset(T), part_count(T);
    std::vector<pa::Task> tasks;
    int64_t slots = 0;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t nq = cu_q[s + 1] - cu_q[s];
      const int64_t first = seq_lens[s] - nq;
      for (int64_t c = 0; c < nq; c += max_q) {
        const int64_t n = std::min(max_q, nq - c);
        const int64_t row0 = cu_q[s] + c, pos0 = first + c;
        const int64_t visible = pos0 + n;  // keys 0 .. visible - 1 for the chunk's last query
        // The chunk's first query sees nothing before its window start; begin at its W group.
        const int64_t begin =
            pa::first_visible(pos0 + 1, 1, attrs_.window) / pa::kGroup * pa::kGroup;
        if (n == 1) {
          const int64_t P = attrs_.partition_size;
          const int64_t first_part = begin / P, parts = (visible + P - 1) / P - first_part;
          part_offset[row0] = slots;
          part_count[row0] = parts;
          slots += parts;
          // Partition-major: consecutive tasks read the kv heads of the same cache blocks, which
          // lie next to each other ([N, Hkv, B, D]), so each thread streams whole blocks.
          for (int64_t ps = 0; ps < parts; ++ps) {
            const int64_t kb = std::max(begin, (first_part + ps) * P);
            const int64_t ke = std::min(visible, (first_part + ps + 1) * P);
            for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({s, h, row0, 1, pos0, kb, ke, ps});
          }
        } else {
          for (int64_t j = 0; j < n; ++j) {
            part_offset[row0 + j] = slots++;
            part_count[row0 + j] = 1;
          }
          for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({s, h, row0, n, pos0, begin, visible, 0});
        }
      }
    }

    std::vector<float> part_o(slots * Hq * D), part_m(slots * Hq), part_l(slots * Hq);
    pa::Params p{};
    p.key_cache = in.key_cache.ptr<int8_t>();
    p.value_cache = in.value_cache.ptr<int8_t>();
    p.key_scale = in.key_scale.ptr<float>();
    p.value_scale = in.value_scale.ptr<float>();
    p.block_tables = tables;
    p.max_blocks = M;
    p.num_kv_heads = Hkv;
    p.block_size = B;
    p.log2_block = 0;
    while ((int64_t{1} << p.log2_block) < B) ++p.log2_block;
    p.head_dim = D;
    p.padded_dim = DP;
    p.num_q_heads = Hq;
    p.group = G;
    p.scale = attrs_.softmax_scale(D);
    p.window = attrs_.window;
    p.softcap = attrs_.softcap;
    p.qk_s8 = attrs_.qk_s8;
    p.pv = pv_;
    p.q_codes = q_codes.data();
    p.q_scale = q_scale.data();
    p.q_f32 = q_f32.data();
    p.part_offset = part_offset.data();
    p.part_o = part_o.data();
    p.part_m = part_m.data();
    p.part_l = part_l.data();
    parallel_for(ctx, tasks.size(), [&](size_t i) {
      const pa::Task& task = tasks[i];
      task_(p, task, task_scratch(task.n_q * G, D));
    });

    // Merge each token's key ranges by log-sum-exp: O = sum_p e^(m_p - M) O_p / den with
    // den = sum_p e^(m_p - M) l_p (+ e^(sink_h - M), and M = max(sink_h, max_p m_p), with a sink).
    parallel_for(ctx, static_cast<size_t>(T), [&](size_t ti) {
      const int64_t t = static_cast<int64_t>(ti);
      std::vector<float> acc(D);
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t base = part_offset[t] * Hq + h;
        const int64_t parts = part_count[t];
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t ps = 0; ps < parts; ++ps) mx = std::max(mx, part_m[base + ps * Hq]);
        if (sink) mx = std::max(mx, sink[h]);
        std::fill(acc.begin(), acc.end(), 0.0f);
        float den = sink ? std::exp(sink[h] - mx) : 0.0f;
        for (int64_t ps = 0; ps < parts; ++ps) {
          const int64_t slot = base + ps * Hq;
          const float f = parts == 1 && !sink ? 1.0f : std::exp(part_m[slot] - mx);
          den += f * part_l[slot];
          const float* o = part_o.data() + slot * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += f * o[d];
        }
        const float inv = 1.0f / den;
        for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
        const int64_t at = (t * Hq + h) * D;
        if (q.dtype == F32)
          std::memcpy(static_cast<float*>(out_raw) + at, acc.data(), D * sizeof(float));
        else
          float_to_half_(acc.data(), static_cast<uint16_t*>(out_raw) + at, D);
      }
    });
  }

 private:
  CpuIsa isa_;
  pa::Attrs attrs_;
  pa::PvMode pv_ = pa::PvMode::kS8;
  pa::TaskFn task_;
  dynamic_quant::QuantizeRowFn quantize_row_;
  HalfToFloatFn half_to_float_;
  FloatToHalfFn float_to_half_;
};

}  // namespace

const CustomOp& paged_attention_int8_cpu_op() {
  static const CustomOp op(paged_attention_int8::signature(), kCpuEp, make_kernel<PagedAttentionInt8Cpu>);
  return op;
}

}  // namespace ort_ops
