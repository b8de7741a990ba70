// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant on Hopper: wgmma (sm_90a) with TMA loads and an mbarrier pipeline.
// Same op, same outputs bit for bit as the mma.sync kernel (cuda.cu); spec ort_ops/ops/_moe.py.
//
// Two schedules of the same tiles (one 128-deep k step = 128-byte swizzled TMA boxes of A rows
// and of B gate / up rows, K-major; one producer thread in warpgroup 0 fills an mbarrier ring;
// int32 accumulators in registers, 128 a consumer thread):
//
// Ping-pong (gmsq_wgmma_pp_kernel, the one launched while ceil(N/2 / 64) <= SM count): each of
// the two consumer warpgroups owns a tile of 128 rows x 64 outputs (two wgmma.m64n128k32 per
// 32 k, 32 KB a k step, 6 stages) and they take the CTA's row blocks in turn, their main loops
// strictly alternating (an order mbarrier each), so one warpgroup's epilogue (SwiGLU, row max,
// handshake, codes) runs while the other's wgmmas keep the tensor pipe busy (faster than the
// cooperative kernel wherever it applies; benchmarks/NOTES_moe_cuda.md).
//
// Cooperative (gmsq_wgmma_kernel, wider outputs): tile 128 rows x 128 outputs = 256 GEMM columns
// (128 gate | 128 up); warpgroups 1 and 2 each issue wgmma.m64n256k32 on 64 rows of the same
// tile (48 KB a k step, 4 stages) and run the epilogue together while no wgmma is in flight.
//
// Accumulator layout (m64nNk32, s32): thread (warp w of the warpgroup, g = lane / 4,
// t = lane % 4) holds d[4j + r] = row 16w + g + 8 (r >> 1), column 8j + 2t + (r & 1). Gate
// column c and up column c are n-columns c and N/2 + c of the instruction (N = 256: d[i] and
// d[64 + i]; N = 128: d[i] and d[32 + i]) of the same thread, so SwiGLU pairs are in one
// thread's registers and a row's outputs of the tile are spread over the 4 threads t of one
// quad (row max: two shuffles).
//
// Row max across the N/2 outputs: as in cuda.cu, a persistent cooperative grid in which the
// C column tiles of a row block run on C co-resident CTAs of one slot group; each publishes its
// partial row max with atomicMax, arrives on the row block's counter, waits for the C arrivals,
// then quantizes from registers. The producer keeps prefetching the next tile's k steps
// meanwhile.
#include "ops/grouped_matmul_swiglu_quant/cuda_wgmma.cuh"

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cfloat>
#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>  // std::call_once

#include "ops/grouped_matmul_swiglu_quant/epilogue.cuh"

namespace ort_ops::gmsq_cuda {
namespace {

constexpr int kWgBNh = 128;      // output columns per tile
constexpr int kWgMaxK = 131071;  // as cuda.cu: exact int32 accumulation

// The tile: two consumer warpgroups of 64 rows (BM = 128), 128-deep k steps (one 128-byte
// swizzle row per operand row) in a 4-stage ring, and the producer warpgroup, whose registers
// setmaxnreg moves to the consumers. (Measured and dropped: 64-deep k steps with the 64-byte
// swizzle in 8 stages, and no producer warpgroup, consumer thread 0 issuing the loads between
// its k steps: both slower; benchmarks/NOTES_moe_cuda.md.)
struct WgCfg {
  static constexpr int kCWG = 2;                       // consumer warpgroups
  static constexpr int kBM = 64 * kCWG;
  static constexpr int kBNh = kWgBNh;
  static constexpr int kBK = 128;
  static constexpr int kStages = 4;
  static constexpr int kThreads = 128 * (kCWG + 1);    // + the producer warpgroup
  static constexpr int kATile = kBM * kBK;             // A [BM rows][BK k]
  static constexpr int kBHalf = kWgBNh * kBK;          // B gate or up [128 n][BK k]
  static constexpr int kStageBytes = kATile + 2 * kBHalf;
  static constexpr int kPipeBytes = kStages * kStageBytes;
  static constexpr int kBarBytes = 2 * kStages * 8;
  static constexpr int kSmem = 1024 + kPipeBytes + kBarBytes + 8 * (kGmsqMaxExperts + 1);
  // Registers after setmaxnreg: consumers get what the producer gives up (65536 per SM).
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kSmem <= 227 * 1024, "shared memory per CTA");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kCWG <= 65536, "register file");
};

struct WgScratch {
  int* err;
  float* amax;
  int* counters;
};

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ORT_OPS_WGMMA_OK 1
#endif

#ifdef ORT_OPS_WGMMA_OK
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!ok);
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle (layout type 1), 8-row atoms
// 1024 bytes apart (SBO); the leading offset is unused for swizzled K-major operands. Stepping
// k by 32 bytes inside the 128-byte row is an add to the start address (the swizzle XOR uses
// address bits; tiles are 1024-byte aligned).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void reg_fence(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// Correctly rounded a / d (= div.rn.f32) for d in [1, 2^125) and |a| in [2^-32, 2^32] or a == 0:
// the instruction sequence div.rn.f32 compiles to on sm_90 (MUFU.RCP, a Newton step, the
// quotient and one correction FMA) without its range check (FCHK) and slow-path call, which
// only fire near the ends of the float range. Branch-free, so the compiler interleaves the
// 64 SwiGLU elements of a thread instead of serializing them on the check's branch regions.
__device__ __forceinline__ float div_rn_fast(float a, float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(d));
  const float e = __fmaf_rn(-d, r, 1.0f);
  const float r1 = __fmaf_rn(r, e, r);
  const float q0 = __fmaf_rn(a, r1, 0.0f);
  const float rem = __fmaf_rn(-d, q0, a);
  const float q1 = __fmaf_rn(r1, rem, q0);
  return a == 0.0f ? a : q1;  // 0 / d keeps a's sign
}
// Whether the activation's a / (1 + exp_f32(-z)) (epi::act_terms: num a, arg z) is in
// div_rn_fast's range. "swiglu" (z = a): a >= -86 keeps d = 1 + exp_f32(-a) < e^86 < 2^125, so
// the reciprocal, the quotient (>= 86 e^-86 > 2^-118) and the remainder stay normal floats (no
// flush to zero, nothing the slow path would fix). "swiglu_oai" (z = alpha * a, alpha any finite
// value, so a and z are not tied): z >= -40 keeps d < 2^58, and with |a| >= 2^-32 the quotient
// stays above 2^-90 and the remainder (about ulp(a) >= 2^-55) normal.
__device__ __forceinline__ bool div_fast_ok(float a, float z, bool oai) {
  const float m = fabsf(a);
  return a == 0.0f || (m >= 0x1p-32f && m <= 0x1p32f && z >= (oai ? -40.0f : -86.0f));
}

// epi::quant_code in one conversion: |S| <= amax, so |S * RN(127 / amax)| <= 127 (1 + 2^-23)
// and round-to-nearest-even to int already lies in [-127, 127]: the clamp never acts. (A NaN S
// only occurs with kErrNonFinite set, when the codes are unspecified.)
__device__ __forceinline__ int quant_code_rn(float s, float inv) {
  return __float2int_rn(__fmul_rn(s, inv));
}

// Dequantized value (float32(acc) * x_scale) * w_scale of accumulator 4 j + r (gate) or
// 64 + 4 j + r (up) of this thread; w holds the w_scale of columns 8 j + 2 t and + 1.
__device__ __forceinline__ float dequant(uint32_t acc, float xs, float2 w, int r) {
  return __fmul_rn(__fmul_rn(__int2float_rn(static_cast<int>(acc)), xs), (r & 1) ? w.y : w.x);
}
// The bias of columns col, col + 1 (zeros without a bias: c_value does not add them then).
__device__ __forceinline__ float2 bias_pair(const float* bsr, int col) {
  return bsr != nullptr ? __ldg(reinterpret_cast<const float2*>(bsr + col)) : make_float2(0.f, 0.f);
}
// C = dequant + bias (one float32 add; b: the bias of the same two columns) when there is one.
__device__ __forceinline__ float c_value(uint32_t acc, float xs, float2 w, bool has_bias, float2 b,
                                         int r) {
  const float c = dequant(acc, xs, w, r);
  return has_bias ? __fadd_rn(c, (r & 1) ? b.y : b.x) : c;
}
// Dequantize, add the bias (bsr: the expert's bias row, or nullptr), the activation of p (S
// replaces the gate accumulators: NJ n8 column groups acc[0, 4 NJ), the matching up ones after
// them), per-row max of |S| over this thread's valid columns (m0: row g, m1: row g + 8),
// non-finite C or S of valid rows noted. For "swiglu", S is finite iff C_gate, C_up and S all
// are (an Inf or NaN operand makes S Inf or NaN: exp_f32 clamps, and 0 * Inf is NaN), so one
// test of S per element suffices: fmaf(S, 0, chk) turns chk into NaN at the first non-finite S.
// "swiglu_oai" clamps (fminf(NaN, limit) is limit), so there C_gate and C_up are tested too.
// Two passes: every element by the branch-free division, the raw gate accumulator kept (and a
// bit set in `redo`) where the gate value is outside div_rn_fast's range; then, only in threads
// with such elements, those elements again by the exact division (epi::swiglu_f32). So one
// out-of-range value costs one exact element, not all 8 NJ elements of its thread (which would
// stall the warp on the exact path).
template <int NJ>
__device__ __forceinline__ void swiglu_tile_mixed(uint32_t (&acc)[8 * NJ], const GmsqParams& p,
                                                  const float* wsr, const float* bsr, int col0,
                                                  int half, int t, float xs0, float xs1, bool ok0,
                                                  bool ok1, float& m0, float& m1, bool& nonfinite) {
  static_assert(4 * NJ <= 64, "one bit an element");
  const bool oai = p.activation == kGmsqActSwigluOai;
  const bool has_bias = bsr != nullptr;
  float chk0 = 0.0f, chk1 = 0.0f;
  uint64_t redo = 0;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int col = col0 + 8 * j + 2 * t;
    if (col0 + 8 * j < half) {  // half % 16 == 0: the 8 columns of j are all in or all out
      const float2 wa = __ldg(reinterpret_cast<const float2*>(wsr + col));
      const float2 wgt = __ldg(reinterpret_cast<const float2*>(wsr + half + col));
      const float2 ba = bias_pair(bsr, col);
      const float2 bg = bias_pair(bsr, half + col);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const bool hi = r >> 1;
        const float xs = hi ? xs1 : xs0;
        const float ca = c_value(acc[4 * j + r], xs, wa, has_bias, ba, r);
        const float cg = c_value(acc[4 * NJ + 4 * j + r], xs, wgt, has_bias, bg, r);
        const epi::ActTerms at = epi::act_terms(p, ca, cg);
        const bool in = div_fast_ok(at.num, at.arg, oai);
        const float d = __fadd_rn(1.0f, epi::exp_f32(-at.arg));
        const float v = __fmul_rn(div_rn_fast(at.num, d), at.mul);
        const float vk = in ? v : 0.0f;  // out-of-range elements join the max in pass 2
        redo |= static_cast<uint64_t>(!in) << (4 * j + r);
        acc[4 * j + r] = in ? __float_as_uint(v) : acc[4 * j + r];
        if (oai && hi) chk1 = __fmaf_rn(cg, 0.0f, __fmaf_rn(ca, 0.0f, chk1));
        if (oai && !hi) chk0 = __fmaf_rn(cg, 0.0f, __fmaf_rn(ca, 0.0f, chk0));
        if (hi) {
          m1 = fmaxf(m1, fabsf(vk));
          chk1 = __fmaf_rn(vk, 0.0f, chk1);
        } else {
          m0 = fmaxf(m0, fabsf(vk));
          chk0 = __fmaf_rn(vk, 0.0f, chk0);
        }
      }
    } else {
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[4 * j + r] = 0u;
    }
  }
  if (redo != 0) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if ((redo >> (4 * j + r)) & 1u) {
          const int col = col0 + 8 * j + 2 * t;
          const bool hi = r >> 1;
          const float xs = hi ? xs1 : xs0;
          const float2 wa = __ldg(reinterpret_cast<const float2*>(wsr + col));
          const float2 wgt = __ldg(reinterpret_cast<const float2*>(wsr + half + col));
          const float ca = c_value(acc[4 * j + r], xs, wa, has_bias, bias_pair(bsr, col), r);
          const float cg =
              c_value(acc[4 * NJ + 4 * j + r], xs, wgt, has_bias, bias_pair(bsr, half + col), r);
          const float v = epi::activation_f32(p, ca, cg);
          acc[4 * j + r] = __float_as_uint(v);
          if (hi) {
            m1 = fmaxf(m1, fabsf(v));
            chk1 = __fmaf_rn(v, 0.0f, chk1);
          } else {
            m0 = fmaxf(m0, fabsf(v));
            chk0 = __fmaf_rn(v, 0.0f, chk0);
          }
        }
      }
    }
  }
  if ((ok0 && chk0 != chk0) || (ok1 && chk1 != chk1)) nonfinite = true;
}

__device__ __forceinline__ void wgmma_m64n256k32_s8(uint32_t (&d)[128], uint64_t da, uint64_t db,
                                                    uint32_t scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      " %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      " %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      " %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      " %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p;\n"
      "}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
        "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
        "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
        "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),
        "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),
        "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),
        "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),
        "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63]),
        "+r"(d[64]), "+r"(d[65]), "+r"(d[66]), "+r"(d[67]), "+r"(d[68]), "+r"(d[69]), "+r"(d[70]), "+r"(d[71]),
        "+r"(d[72]), "+r"(d[73]), "+r"(d[74]), "+r"(d[75]), "+r"(d[76]), "+r"(d[77]), "+r"(d[78]), "+r"(d[79]),
        "+r"(d[80]), "+r"(d[81]), "+r"(d[82]), "+r"(d[83]), "+r"(d[84]), "+r"(d[85]), "+r"(d[86]), "+r"(d[87]),
        "+r"(d[88]), "+r"(d[89]), "+r"(d[90]), "+r"(d[91]), "+r"(d[92]), "+r"(d[93]), "+r"(d[94]), "+r"(d[95]),
        "+r"(d[96]), "+r"(d[97]), "+r"(d[98]), "+r"(d[99]), "+r"(d[100]), "+r"(d[101]), "+r"(d[102]), "+r"(d[103]),
        "+r"(d[104]), "+r"(d[105]), "+r"(d[106]), "+r"(d[107]), "+r"(d[108]), "+r"(d[109]), "+r"(d[110]), "+r"(d[111]),
        "+r"(d[112]), "+r"(d[113]), "+r"(d[114]), "+r"(d[115]), "+r"(d[116]), "+r"(d[117]), "+r"(d[118]), "+r"(d[119]),
        "+r"(d[120]), "+r"(d[121]), "+r"(d[122]), "+r"(d[123]), "+r"(d[124]), "+r"(d[125]), "+r"(d[126]), "+r"(d[127])
      : "l"(da), "l"(db), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_m64n128k32_s8(uint32_t (&d)[64], uint64_t da, uint64_t db,
                                                    uint32_t scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p;\n"
      "}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
        "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
        "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
        "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),
        "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),
        "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),
        "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),
        "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

// The CTA's start in both kernels (C: WgCfg or WgPPCfg): the 1024-byte aligned shared memory
// (TMA's 128-byte swizzle and the wgmma descriptors assume 1024-byte aligned tiles: the ring,
// then its S full and S empty mbarriers and X more, then the tile map of C::kBM-row blocks),
// y_offset zeroed (grid-stride), the tile map (warp 0), the barriers initialized (full: count
// 1, the producer's expect_tx arrival; empty: count `releases`; the X others: count 1), the
// tensor maps prefetched, a CTA barrier; and the CTA's place: slot group `slot` of `slots`
// walks row blocks, column tile ct.
struct WgCta {
  uint8_t* smem;
  uint32_t pipe, full_bar, empty_bar;  // ring; S full mbarriers, then S empty ones, then X
  int* ends_s;                         // [E + 1] sanitized group ends
  int* blk_s;                          // [E + 1] row-block prefix
  int M, K, N, half, E, total_blocks, rows_end, slots, slot, ct, col0, KT;
};
template <class C, int X>
__device__ __forceinline__ WgCta wg_cta(uint8_t* smem_raw, const GmsqParams& p, const WgScratch& ws,
                                        int releases, const CUtensorMap* map_x,
                                        const CUtensorMap* map_w, int col_tiles) {
  constexpr int S = C::kStages;
  WgCta f;
  f.smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  f.pipe = smem_u32(f.smem);
  f.full_bar = f.pipe + C::kPipeBytes;
  f.empty_bar = f.full_bar + 8 * S;
  f.ends_s = reinterpret_cast<int*>(f.smem + C::kPipeBytes + C::kBarBytes);
  f.blk_s = f.ends_s + (kGmsqMaxExperts + 1);
  f.M = static_cast<int>(p.m);
  f.K = static_cast<int>(p.k);
  f.N = static_cast<int>(p.n);
  f.half = f.N / 2;
  f.E = static_cast<int>(p.e);
  const int tid = threadIdx.x;
  for (int i = blockIdx.x * C::kThreads + tid; i < f.M; i += gridDim.x * C::kThreads)
    p.y_offset[i] = 0.0f;
  if ((tid >> 5) == 0)
    epi::build_tile_map(p.group_list, p.group_list_type, f.M, f.E, C::kBM, tid & 31, f.ends_s,
                        f.blk_s, ws.err);
  if (tid == 32) {
    for (int s = 0; s < S; ++s) {
      mbar_init(f.full_bar + 8 * s, 1);
      mbar_init(f.full_bar + 8 * (S + s), releases);
    }
    for (int x = 0; x < X; ++x) mbar_init(f.full_bar + 8 * (2 * S + x), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map_x)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map_w)) : "memory");
  }
  __syncthreads();
  f.total_blocks = f.blk_s[f.E];
  f.rows_end = f.ends_s[f.E];
  f.slots = gridDim.x / col_tiles;
  f.slot = blockIdx.x / col_tiles;
  f.ct = blockIdx.x % col_tiles;
  f.col0 = f.ct * C::kBNh;
  f.KT = (f.K + C::kBK - 1) / C::kBK;
  return f;
}

// Codes of global row grow of a tile, 2 per n8 group j < NJ (S values s[4 j + 2 hi] and
// s[4 j + 2 hi + 1]: columns col0 + 8 j + 2 t and + 1), with the row's final max; the row's
// scale from column tile 0.
template <int NJ, int NA>
__device__ __forceinline__ void row_codes(const uint32_t (&s)[NA], int hi, const GmsqParams& p,
                                          const WgScratch& ws, int grow, int col0, int half,
                                          int t, int ct) {
  const float amax = __ldcg(ws.amax + grow);
  const float inv = amax > 0.0f ? fminf(__fdiv_rn(127.0f, amax), FLT_MAX) : 0.0f;  // saturated: DESIGN.md
  int8_t* yr = p.y + static_cast<int64_t>(grow) * half + col0 + 2 * t;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    if (col0 + 8 * j < half) {
      const uint32_t c0 =
          static_cast<uint32_t>(quant_code_rn(__uint_as_float(s[4 * j + 2 * hi]), inv)) & 0xffu;
      const uint32_t c1 =
          static_cast<uint32_t>(quant_code_rn(__uint_as_float(s[4 * j + 2 * hi + 1]), inv)) & 0xffu;
      *reinterpret_cast<uint16_t*>(yr + 8 * j) = static_cast<uint16_t>(c0 | (c1 << 8));
    }
  }
  if (ct == 0 && t == 0) p.y_scale[grow] = __fdiv_rn(amax, 127.0f);
}
#endif  // ORT_OPS_WGMMA_OK

__global__ void __launch_bounds__(WgCfg::kThreads, 1)
    gmsq_wgmma_kernel(const __grid_constant__ CUtensorMap map_x,
                      const __grid_constant__ CUtensorMap map_w, const GmsqParams p,
                      const WgScratch ws, const int col_tiles) {
#ifdef ORT_OPS_WGMMA_OK
  using C = WgCfg;
  constexpr int CWG = C::kCWG;
  constexpr int kWgBK = C::kBK, kWgBM = C::kBM, kWgThreads = C::kThreads, kWgStages = C::kStages;
  constexpr int kATile = C::kATile, kBHalf = C::kBHalf, kStageBytes = C::kStageBytes;
  extern __shared__ uint8_t smem_raw[];
  // Empty barriers: one arrival per consumer warpgroup.
  const WgCta f = wg_cta<C, 0>(smem_raw, p, ws, CWG, &map_x, &map_w, col_tiles);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp / 4;

  // The loading thread's cursor over this CTA's (row block, k step) sequence: step `ld` goes
  // to stage ld % kWgStages once the consumers released that stage's previous use.
  int ld = 0, ld_rb = f.slot, ld_kt = 0, ld_row0 = 0, ld_wrow = 0;
  auto ld_tile = [&]() {
    if (ld_rb < f.total_blocks) {
      const int e = epi::expert_of_block(f.blk_s, f.E, ld_rb);
      ld_row0 = f.ends_s[e] + (ld_rb - f.blk_s[e]) * kWgBM;
      ld_wrow = e * f.N + f.col0;  // gate rows; up rows start at ld_wrow + half
    }
  };
  auto top_up = [&](int limit) {  // issue the loads of steps ld .. limit - 1
    while (ld < limit && ld_rb < f.total_blocks) {
      const int s = ld % kWgStages;
      mbar_wait(f.empty_bar + 8 * s, ((ld / kWgStages) & 1) ^ 1);
      const uint32_t fb = f.full_bar + 8 * s;
      mbar_expect_tx(fb, kStageBytes);
      const uint32_t st = f.pipe + s * kStageBytes;
      tma_load_2d(st, &map_x, ld_kt * kWgBK, ld_row0, fb);
      tma_load_2d(st + kATile, &map_w, ld_kt * kWgBK, ld_wrow, fb);
      tma_load_2d(st + kATile + kBHalf, &map_w, ld_kt * kWgBK, ld_wrow + f.half, fb);
      ++ld;
      if (++ld_kt == f.KT) {
        ld_kt = 0;
        ld_rb += f.slots;
        ld_tile();
      }
    }
  };

  if (wg == 0) {
    // ---- producer ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(C::kProducerRegs) : "memory");
    if (tid == 0) {
      ld_tile();
      top_up(INT_MAX);
    }
  } else {
    // ---- consumers ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(C::kConsumerRegs) : "memory");
    const int cw = wg - 1;          // rows 64 cw .. 64 cw + 63 of the tile
    const int wq = warp & 3;        // rows 16 wq .. of the warpgroup's 64
    const int g = lane >> 2;
    const int t = lane & 3;
    const int ctid = tid - 128;     // 0 .. 128 CWG - 1 among the consumers
    int it = 0;
    for (int rb = f.slot; rb < f.total_blocks; rb += f.slots) {
      const int e = epi::expert_of_block(f.blk_s, f.E, rb);
      const int row0 = f.ends_s[e] + (rb - f.blk_s[e]) * kWgBM;
      const int rows = min(kWgBM, f.ends_s[e + 1] - row0);

      uint32_t acc[128];
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0;
      for (int kt = 0; kt < f.KT; ++kt, ++it) {
        const int s = it % kWgStages;
        mbar_wait(f.full_bar + 8 * s, (it / kWgStages) & 1);
        const uint32_t a0 = f.pipe + s * kStageBytes + cw * 64 * kWgBK;
        const uint32_t b0 = f.pipe + s * kStageBytes + kATile;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kWgBK / 32; ++kk)
          wgmma_m64n256k32_s8(acc, sw128_desc(a0 + 32 * kk), sw128_desc(b0 + 32 * kk), 1u);
        wgmma_commit();
        wgmma_wait<1>();  // the group of the previous k step retired: release its stage
        if (kt > 0 && (tid & 127) == 0) mbar_arrive(f.empty_bar + 8 * ((it + kWgStages - 1) % kWgStages));
      }
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 128; ++i) reg_fence(acc[i]);
      if (f.KT > 0 && (tid & 127) == 0) mbar_arrive(f.empty_bar + 8 * ((it + kWgStages - 1) % kWgStages));

      // ---- epilogue: dequantize, SwiGLU (S replaces the gate accumulators), partial row max ----
      const int rl = cw * 64 + wq * 16 + g;  // rows rl and rl + 8 of the tile
      const bool ok0 = rl < rows, ok1 = rl + 8 < rows;
      const float xs0 = ok0 ? p.x_scale[row0 + rl] : 0.0f;
      const float xs1 = ok1 ? p.x_scale[row0 + rl + 8] : 0.0f;
      const float* wsr = p.w_scale + static_cast<int64_t>(e) * f.N;
      const float* bsr = p.bias != nullptr ? p.bias + static_cast<int64_t>(e) * f.N : nullptr;
      float m0 = 0.0f, m1 = 0.0f;
      bool nonfinite = false;
      swiglu_tile_mixed<16>(acc, p, wsr, bsr, f.col0, f.half, t, xs0, xs1, ok0, ok1, m0, m1,
                            nonfinite);
      if (nonfinite) atomicOr(ws.err, kErrNonFinite);
      m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
      m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
      m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
      m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
      if (t == 0) {
        if (ok0 && m0 > 0.0f) atomicMax(reinterpret_cast<int*>(ws.amax) + row0 + rl, __float_as_int(m0));
        if (ok1 && m1 > 0.0f)
          atomicMax(reinterpret_cast<int*>(ws.amax) + row0 + rl + 8, __float_as_int(m1));
      }
      __threadfence();
      asm volatile("bar.sync 1, %0;\n" ::"n"(128 * CWG) : "memory");
      if (ctid == 0) epi::arrive_and_wait(ws.counters + rb, col_tiles);
      asm volatile("bar.sync 1, %0;\n" ::"n"(128 * CWG) : "memory");

      // ---- quantize with the rows' final max; 2 codes per (row, j) ----
#pragma unroll
      for (int hi = 0; hi < 2; ++hi)
        if (hi ? ok1 : ok0) row_codes<16>(acc, hi, p, ws, row0 + rl + 8 * hi, f.col0, f.half, t, f.ct);
    }
  }
  epi::zero_tail_rows(p.y, p.y_scale, f.M, f.half, f.rows_end,
                      static_cast<int64_t>(blockIdx.x) * kWgThreads + tid,
                      static_cast<int64_t>(gridDim.x) * kWgThreads);
#else
  __trap();  // built for sm_90a only; the launcher refuses other devices
#endif
}

// ---- ping-pong schedule ---------------------------------------------------------------------
// Each consumer warpgroup owns its own tile, 128 rows x 64 outputs (64 gate | 64 up GEMM columns,
// two m64n128k32 accumulator sets of 64 registers), and the two warpgroups take the CTA's row
// blocks in turn (tile j of the CTA's sequence goes to warpgroup j % 2). The producer loads the
// tiles' k steps in sequence order into one ring, so warpgroup 1's main loop starts while
// warpgroup 0 finishes its own, and one warpgroup's epilogue (SwiGLU, row max, handshake,
// codes) runs while the other's wgmmas keep the tensor pipe busy. Same math, same handshake
// (one arrival per (row block, column tile)), so the same bits as the cooperative kernel above.
struct WgPPCfg {
  static constexpr int kBM = 128;                      // rows of a warpgroup's tile
  static constexpr int kBNh = 64;                      // output columns of a tile
  static constexpr int kBK = 128;
  static constexpr int kStages = 6;
  static constexpr int kThreads = 384;                 // producer + 2 consumer warpgroups
  static constexpr int kATile = kBM * kBK;             // A [128 rows][128 k]
  static constexpr int kBHalf = kBNh * kBK;            // B gate or up [64 n][128 k]
  static constexpr int kStageBytes = kATile + 2 * kBHalf;
  static constexpr int kPipeBytes = kStages * kStageBytes;
  static constexpr int kBarBytes = 2 * kStages * 8 + 2 * 8;  // full, empty, order barriers
  static constexpr int kSmem = 1024 + kPipeBytes + kBarBytes + 8 * (kGmsqMaxExperts + 1);
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kSmem <= 227 * 1024, "shared memory per CTA");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 65536, "register file");
  static_assert(kBK == WgCfg::kBK, "encode_map's box depth");
};

#ifdef ORT_OPS_WGMMA_OK
template <int ID>
__device__ __forceinline__ void named_bar_128() {
  asm volatile("bar.sync %0, 128;\n" ::"n"(ID) : "memory");
}
#endif

__global__ void __launch_bounds__(WgPPCfg::kThreads, 1)
    gmsq_wgmma_pp_kernel(const __grid_constant__ CUtensorMap map_x,
                         const __grid_constant__ CUtensorMap map_w, const GmsqParams p,
                         const WgScratch ws, const int col_tiles) {
#ifdef ORT_OPS_WGMMA_OK
  using C = WgPPCfg;
  constexpr int BK = C::kBK, BM = C::kBM, S = C::kStages;
  constexpr int kATile = C::kATile, kBHalf = C::kBHalf, kStageBytes = C::kStageBytes;
  extern __shared__ uint8_t smem_raw[];
  // Empty barriers: the consuming warpgroup's release; then the two order barriers.
  const WgCta f = wg_cta<C, 2>(smem_raw, p, ws, 1, &map_x, &map_w, col_tiles);
  // order_bar + 8 c: warpgroup c may start its next main loop (the other one issued its last
  // k step). The main loops alternate strictly, so a warpgroup never waits on a full barrier
  // whose previous phase is still pending (a phase parity names only the last two phases).
  const uint32_t order_bar = f.empty_bar + 8 * S;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp / 4;

  if (wg == 0) {
    // ---- producer: the k steps of the CTA's tiles j = 0, 1, ... (row block slot + j slots) ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(C::kProducerRegs) : "memory");
    if (tid == 0) {
      int ld = 0;
      for (int rb = f.slot; rb < f.total_blocks; rb += f.slots) {
        const int e = epi::expert_of_block(f.blk_s, f.E, rb);
        const int row0 = f.ends_s[e] + (rb - f.blk_s[e]) * BM;
        const int wrow = e * f.N + f.col0;  // gate rows; up rows start at wrow + half
        for (int kt = 0; kt < f.KT; ++kt, ++ld) {
          const int s = ld % S;
          mbar_wait(f.empty_bar + 8 * s, ((ld / S) & 1) ^ 1);
          const uint32_t fb = f.full_bar + 8 * s;
          mbar_expect_tx(fb, kStageBytes);
          const uint32_t st = f.pipe + s * kStageBytes;
          tma_load_2d(st, &map_x, kt * BK, row0, fb);
          tma_load_2d(st + kATile, &map_w, kt * BK, wrow, fb);
          tma_load_2d(st + kATile + kBHalf, &map_w, kt * BK, wrow + f.half, fb);
        }
      }
    }
  } else {
    // ---- consumers: warpgroup cw takes tiles j = cw, cw + 2, ... ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(C::kConsumerRegs) : "memory");
    const int cw = wg - 1;
    const int wq = warp & 3;
    const int g = lane >> 2;
    const int t = lane & 3;
    const bool leader = (tid & 127) == 0;
    for (int j = cw;; j += 2) {
      const int rb = f.slot + j * f.slots;
      if (rb >= f.total_blocks) break;
      const int e = epi::expert_of_block(f.blk_s, f.E, rb);
      const int row0 = f.ends_s[e] + (rb - f.blk_s[e]) * BM;
      const int rows = min(BM, f.ends_s[e + 1] - row0);

      uint32_t acc0[64], acc1[64];  // rows 0-63 and 64-127 of the tile
#pragma unroll
      for (int i = 0; i < 64; ++i) acc0[i] = acc1[i] = 0;
      // Tile j - 1 (the other warpgroup's) issued its last k step: ring positions below
      // j KT have all been waited for, so the parities below name this tile's phases.
      if (j > 0) mbar_wait(order_bar + 8 * cw, ((j - 1) / 2) & 1);
      int it = j * f.KT;  // ring position of this tile's first k step
      for (int kt = 0; kt < f.KT; ++kt, ++it) {
        const int s = it % S;
        mbar_wait(f.full_bar + 8 * s, (it / S) & 1);
        const uint32_t a0 = f.pipe + s * kStageBytes;
        const uint32_t b0 = a0 + kATile;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 32; ++kk) {
          wgmma_m64n128k32_s8(acc0, sw128_desc(a0 + 32 * kk), sw128_desc(b0 + 32 * kk), 1u);
          wgmma_m64n128k32_s8(acc1, sw128_desc(a0 + 64 * BK + 32 * kk), sw128_desc(b0 + 32 * kk), 1u);
        }
        wgmma_commit();
        if (kt == f.KT - 1 && leader) mbar_arrive(order_bar + 8 * (1 - cw));
        wgmma_wait<1>();  // the previous k step's group retired: release its stage
        if (kt > 0 && leader) mbar_arrive(f.empty_bar + 8 * ((it + S - 1) % S));
      }
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        reg_fence(acc0[i]);
        reg_fence(acc1[i]);
      }
      if (leader) mbar_arrive(f.empty_bar + 8 * ((it + S - 1) % S));

      // ---- epilogue (the other warpgroup's wgmmas run meanwhile) ----
      const int rl = wq * 16 + g;  // rows rl, rl + 8 (acc0) and 64 + rl, 72 + rl (acc1)
      const bool ok00 = rl < rows, ok01 = rl + 8 < rows, ok10 = rl + 64 < rows, ok11 = rl + 72 < rows;
      const float xs00 = ok00 ? p.x_scale[row0 + rl] : 0.0f;
      const float xs01 = ok01 ? p.x_scale[row0 + rl + 8] : 0.0f;
      const float xs10 = ok10 ? p.x_scale[row0 + rl + 64] : 0.0f;
      const float xs11 = ok11 ? p.x_scale[row0 + rl + 72] : 0.0f;
      const float* wsr = p.w_scale + static_cast<int64_t>(e) * f.N;
      const float* bsr = p.bias != nullptr ? p.bias + static_cast<int64_t>(e) * f.N : nullptr;
      float m00 = 0.0f, m01 = 0.0f, m10 = 0.0f, m11 = 0.0f;
      bool nonfinite = false;
      swiglu_tile_mixed<8>(acc0, p, wsr, bsr, f.col0, f.half, t, xs00, xs01, ok00, ok01, m00, m01,
                           nonfinite);
      swiglu_tile_mixed<8>(acc1, p, wsr, bsr, f.col0, f.half, t, xs10, xs11, ok10, ok11, m10, m11,
                           nonfinite);
      if (nonfinite) atomicOr(ws.err, kErrNonFinite);
      float mx[4] = {m00, m01, m10, m11};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        mx[q] = fmaxf(mx[q], __shfl_xor_sync(0xffffffffu, mx[q], 1));
        mx[q] = fmaxf(mx[q], __shfl_xor_sync(0xffffffffu, mx[q], 2));
        const int r = rl + (q & 1) * 8 + (q >> 1) * 64;
        if (t == 0 && r < rows && mx[q] > 0.0f)
          atomicMax(reinterpret_cast<int*>(ws.amax) + row0 + r, __float_as_int(mx[q]));
      }
      __threadfence();
      if (cw == 0) named_bar_128<2>(); else named_bar_128<3>();
      if (leader) epi::arrive_and_wait(ws.counters + rb, col_tiles);
      if (cw == 0) named_bar_128<2>(); else named_bar_128<3>();

      // ---- codes with the rows' final max; 2 codes per (row, jj) ----
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = rl + (q & 1) * 8 + (q >> 1) * 64;
        if (r < rows) row_codes<8>((q >> 1) ? acc1 : acc0, q & 1, p, ws, row0 + r, f.col0, f.half, t, f.ct);
      }
    }
  }
  epi::zero_tail_rows(p.y, p.y_scale, f.M, f.half, f.rows_end,
                      static_cast<int64_t>(blockIdx.x) * C::kThreads + tid,
                      static_cast<int64_t>(gridDim.x) * C::kThreads);
#else
  __trap();  // built for sm_90a only; the launcher refuses other devices
#endif
}

// ---- host side -----------------------------------------------------------------------------

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static std::once_flag once;
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  });
  return fn;
}

// 2D uint8 map over a row-major [rows, K] matrix: box_rows x 128-byte boxes, 128-byte swizzle,
// zeros outside (rows past the end, k past K).
bool encode_map(CUtensorMap* map, const void* base, int64_t rows, int64_t k, int box_rows) {
  auto enc = tensor_map_encoder();
  if (enc == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(WgCfg::kBK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t estr[2] = {1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box,
             estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

size_t align16(size_t v) { return (v + 15) / 16 * 16; }

// Both schedules: C the tile config (WgCfg: cooperative 128 x 128 tiles; WgPPCfg: ping-pong
// 128 x 64 tiles a warpgroup), `kernel` its kernel, bnh its output columns a tile.
template <class C>
cudaError_t launch_kernel(void (*kernel)(CUtensorMap, CUtensorMap, GmsqParams, WgScratch, int),
                          int bnh, int bn_box, const GmsqParams& p, int sms, cudaStream_t stream) {
  // One CTA per SM (the ring takes most of the shared memory): co-resident = SM count.
  static_assert(2 * C::kSmem > 228 * 1024, "one CTA per SM");
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
  if (err != cudaSuccess) return err;
  CUtensorMap map_x, map_w;
  if (!encode_map(&map_x, p.x, p.m, p.k, C::kBM) ||
      !encode_map(&map_w, p.weight, p.e * p.n, p.k, bn_box))
    return cudaErrorInvalidValue;
  WgScratch s;
  s.err = p.err != nullptr ? p.err : static_cast<int*>(p.workspace);
  s.amax = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + 16);
  s.counters = reinterpret_cast<int*>(static_cast<char*>(p.workspace) + 16 +
                                      align16(4 * static_cast<size_t>(p.m)));
  const int64_t max_blocks = (p.m + C::kBM - 1) / C::kBM + p.e;  // row blocks, upper bound
  // Zero the error word, the row amax and the row-block counters (a prefix of
  // gmsq_workspace_bytes, whose counters are sized for 16-row blocks).
  const size_t zeroed =
      16 + align16(4 * static_cast<size_t>(p.m)) + align16(4 * static_cast<size_t>(max_blocks));
  err = cudaMemsetAsync(p.workspace, 0, zeroed, stream);
  if (err != cudaSuccess) return err;
  const int col_tiles = static_cast<int>((p.n / 2 + bnh - 1) / bnh);
  const int64_t slots = std::min<int64_t>(sms / col_tiles, max_blocks);
  if (slots < 1) return cudaErrorCooperativeLaunchTooLarge;  // N/2 needs more co-resident CTAs
  const epi::CooperativeLaunch launch(static_cast<unsigned>(slots * col_tiles), C::kThreads,
                                      C::kSmem, stream);
  return cudaLaunchKernelEx(&launch.cfg, kernel, map_x, map_w, p, s, col_tiles);
}

cudaError_t launch_tiles(const GmsqParams& p, int device, cudaStream_t stream) {
  int sms = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  // The ping-pong kernel needs ceil(N/2 / 64) co-resident CTAs for a row block's row max; wider
  // outputs (N/2 > 64 x the SM count, e.g. an intermediate size of 14336 on 132 SMs) take the
  // cooperative kernel's 128-column tiles (up to 128 SMs of outputs).
  if ((p.n / 2 + WgPPCfg::kBNh - 1) / WgPPCfg::kBNh <= sms)
    return launch_kernel<WgPPCfg>(gmsq_wgmma_pp_kernel, WgPPCfg::kBNh, WgPPCfg::kBNh, p, sms, stream);
  return launch_kernel<WgCfg>(gmsq_wgmma_kernel, WgCfg::kBNh, WgCfg::kBNh, p, sms, stream);
}

}  // namespace

cudaError_t launch_gmsq_wgmma(const GmsqParams& p, cudaStream_t stream) {
  if (p.weight_layout != kGmsqLayoutKMajor) return cudaErrorInvalidValue;
  if (p.m < 0 || p.m >= (int64_t{1} << 31) || p.k < 0 || p.k > kWgMaxK || p.k % 16 != 0 ||
      p.n < 0 || p.n % 32 != 0 || p.e < 0 || p.e > kGmsqMaxExperts ||
      (p.group_list_type != 0 && p.group_list_type != 1) || p.e * p.n >= (int64_t{1} << 31) ||
      p.n * (p.m / 2 + 1) >= (int64_t{1} << 40) ||
      (reinterpret_cast<uintptr_t>(p.x) & 15) != 0 || (reinterpret_cast<uintptr_t>(p.weight) & 15) != 0)
    return cudaErrorInvalidValue;
  if (p.k == 0 || p.m == 0 || p.n == 0 || p.e == 0) {
    // Nothing to multiply (no weight bytes in either layout): the layout-0 launcher's zero paths.
    GmsqParams q = p;
    q.weight_layout = 0;
    return launch_gmsq(q, stream);
  }
  int device = 0, major = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
  if (major != 9) return cudaErrorNotSupported;  // sm_90a code only
  return launch_tiles(p, device, stream);
}

}  // namespace ort_ops::gmsq_cuda
