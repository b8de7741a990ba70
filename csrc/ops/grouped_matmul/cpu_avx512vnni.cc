// SPDX-License-Identifier: MIT
// AVX-512 VNNI grouped-GEMM tile (EVEX VPDPBUSD on zmm: 64 u8 x s8 products per instruction).
// Same x + 128 / column-sum correction as cpu_avxvnni.cc; 6 rows x 64 columns per micro-kernel
// (24 of the 32 zmm registers hold accumulators). Only this file gets AVX-512 flags.
#include <cstring>
#include <type_traits>

#include "ops/grouped_matmul/tile_simd.h"

// GCC 12 warns inside its own _mm512_cvtepi32_ps / _mm512_slli_epi32 (the header's
// `__m512 __Y = __Y` undefined-value placeholder), not about our code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace ort_ops::grouped_matmul {
namespace {

struct Avx512VnniTraits {
  using Vec = __m512i;
  static constexpr int KPER = 4;
  static constexpr int VW = 16;
  static constexpr int NV = 4;
  static constexpr int MR = 6;
  static constexpr int GEMV_KU = 4;  // packed k steps held in registers by the few-row path
  static constexpr bool kUnsignedX = true;
  static Vec zero() { return _mm512_setzero_si512(); }
  static Vec load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static Vec bcast(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static Vec dot(Vec c, Vec x, Vec w) { return _mm512_dpbusd_epi32(c, x, w); }
  // 64 columns per group: 4 k-rows interleaved into quads by in-lane unpacks (lanes 16 apart).
  static constexpr int64_t PACK_G = 64;
  static constexpr int64_t perm(int64_t p) { return ((p % 16) / 4) * 16 + (p / 16) * 4 + p % 4; }
  static void pack_regs(const int8_t* const rows[4], Vec v[4]) {
    __m512i r[4];
    for (int i = 0; i < 4; ++i) r[i] = _mm512_loadu_si512(rows[i]);
    const __m512i lo01 = _mm512_unpacklo_epi8(r[0], r[1]), hi01 = _mm512_unpackhi_epi8(r[0], r[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(r[2], r[3]), hi23 = _mm512_unpackhi_epi8(r[2], r[3]);
    v[0] = _mm512_unpacklo_epi16(lo01, lo23);
    v[1] = _mm512_unpackhi_epi16(lo01, lo23);
    v[2] = _mm512_unpacklo_epi16(hi01, hi23);
    v[3] = _mm512_unpackhi_epi16(hi01, hi23);
  }
  static void store(void* p, Vec v) { _mm512_storeu_si512(p, v); }
  // Column sums ride on the same instruction: 1 (unsigned) times each packed weight (signed).
  static Vec colsum_add(Vec c, Vec v) { return _mm512_dpbusd_epi32(c, _mm512_set1_epi8(1), v); }
  static Vec times128(Vec v) { return _mm512_slli_epi32(v, 7); }
  static void store_c(Vec acc, const int32_t* corr, float xs, const float* ws, float* out) {
    acc = _mm512_sub_epi32(acc, _mm512_load_si512(corr));
    __m512 f = _mm512_cvtepi32_ps(acc);
    f = _mm512_mul_ps(f, _mm512_set1_ps(xs));
    f = _mm512_mul_ps(f, _mm512_load_ps(ws));
    _mm512_store_ps(out, f);
  }
};

// ---- AMX: the same packed tile, TDPBUSD on 16-row x 64-byte tiles ----
// The packed tile [steps][512 columns][4 bytes] is already AMX's B layout: 16 steps (64 k) of
// 16 columns are one B tile with a row stride of kStepBytes. A tiles are 16 prepared x rows
// (u8 quads, k padded to 64) of 64 bytes each. Tiles 0-3 accumulate a 32-row x 32-column block
// (rows 0-15 / 16-31 times columns 0-15 / 16-31), 4-5 hold A, 6-7 hold B. The int32 sums are
// the VNNI path's (wrapping int32 adds, exact), and the epilogue is store_c + finish_row, so the
// outputs match every other variant bit for bit.
#define ORT_OPS_AMX __attribute__((target("amx-tile,amx-int8")))

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One 32-column chunk of the rows [r0, r0 + 16 * (1 + TWO)) into ct [32][32] (int32).
template <bool TWO>
ORT_OPS_AMX inline void amx_block(const uint8_t* xp, int64_t xstride, const uint8_t* bp, int64_t ktiles,
                                  int32_t* ct) {
  _tile_zero(0);
  _tile_zero(1);
  if (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t t = 0; t < ktiles; ++t) {
    _tile_loadd(4, xp + t * 64, xstride);
    _tile_loadd(6, bp + t * 16 * kStepBytes, kStepBytes);
    _tile_loadd(7, bp + t * 16 * kStepBytes + 64, kStepBytes);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    if (TWO) {
      _tile_loadd(5, xp + 16 * xstride + t * 64, xstride);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
  }
  _tile_stored(0, ct, 128);
  _tile_stored(1, ct + 16, 128);
  if (TWO) {
    _tile_stored(2, ct + 16 * 32, 128);
    _tile_stored(3, ct + 16 * 32 + 16, 128);
  }
}

// Panels: A rows [0, 16) at xp (and [16, 32) when `two`) times the B tiles in 6 and 7, signed
// by signed, into the sums in tiles 0-3.
ORT_OPS_AMX inline void panel_mac(const int8_t* xp, int64_t xstride, bool two) {
  _tile_loadd(4, xp, xstride);
  _tile_dpbssd(0, 4, 6);
  _tile_dpbssd(1, 4, 7);
  if (two) {
    _tile_loadd(5, xp + 16 * xstride, xstride);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
}

// Panels: tiles 0-3 to the sums at c ([32 rows][cols] int32, ldb bytes a row); rows 16-31 only
// when `two`.
ORT_OPS_AMX inline void panel_store(int32_t* c, int64_t cols, int64_t ldb, bool two) {
  _tile_stored(0, c, ldb);
  _tile_stored(1, c + 16, ldb);
  if (two) {
    _tile_stored(2, c + 16 * cols, ldb);
    _tile_stored(3, c + 16 * cols + 16, ldb);
  }
}

}  // namespace

ORT_OPS_AMX bool tile_amx(const TileArgs& a, int64_t* bad_row) {
  using T = Avx512VnniTraits;
  const int64_t ktiles = (a.k + 63) / 64;
  PackedTile pt;
  prepare_tile<T>(a, ktiles * 16, pt);  // zero steps past k fill the last A/B tile pair
  const uint8_t* pk = pt.pk;

  AmxConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  constexpr int64_t CW = 32;
  thread_local std::vector<float> cvec(32 * kTileCols + 16);
  float* cbuf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(cvec.data()) + 63) & ~uintptr_t{63});
  alignas(64) int32_t ct[32 * 32];
  bool ok = true;
  for (int64_t r0 = 0; r0 < a.rows && ok; r0 += 32) {
    const int64_t nr = std::min<int64_t>(32, a.rows - r0);
    const uint8_t* xp = a.xprep + r0 * a.xprep_stride;
    for (int64_t ch = 0; ch < kTileCols / CW; ++ch) {
      if (!chunk_live(a, ch * CW / T::PACK_G, T::PACK_G)) {  // packing permutes within 64 columns
        for (int64_t i = 0; i < nr; ++i) std::fill(cbuf + i * kTileCols + ch * CW, cbuf + i * kTileCols + (ch + 1) * CW, 0.0f);
        continue;
      }
      if (nr > 16)
        amx_block<true>(xp, a.xprep_stride, pk + ch * CW * 4, ktiles, ct);
      else
        amx_block<false>(xp, a.xprep_stride, pk + ch * CW * 4, ktiles, ct);
      for (int64_t i = 0; i < nr; ++i)
        for (int64_t j = 0; j < CW; j += 16) {
          const int64_t col = ch * CW + j;
          T::store_c(_mm512_load_si512(ct + i * 32 + j), pt.corr + col, a.x_scale[r0 + i], pt.wsp + col,
                     cbuf + i * kTileCols + col);
        }
    }
    for (int64_t i = 0; i < nr; ++i)
      if (!finish_row(a, cbuf + i * kTileCols, pt.colmap, a.out + (r0 + i) * a.ldo)) {
        *bad_row = r0 + i;
        ok = false;
        break;
      }
  }
  _tile_release();
  return ok;
}

namespace {

// ---- panel_amx: one expert's rows over a column part, all of K, in AMX tiles ----
// The steps: the part's geometry and thread buffers, x back to signed bytes, the tile
// configuration, then the int32 sums into acc ([rows_pad][cols]: "EN16K4" weights read in
// place, chunk by chunk; the contract's [K, N] weights packed kPanelK deep into a slab that all
// 32-row blocks multiply), then the epilogue (store_c and finish_row_n per row).
#define ORT_OPS_AMX_STEP [[gnu::always_inline]] ORT_OPS_AMX inline

// Columns and strides of one panel part. SwiGLU parts have two segments (A columns at col0,
// G columns at N/2 + col0), each padded to wpad packed columns.
struct PanelGeom {
  int nseg;
  int64_t n, kdim, width, xstride;
  int64_t seg_col[2];
  int64_t wpad;      // packed columns per segment
  int64_t cols;      // packed columns of the part
  int64_t rows_pad;  // AMX loads and stores whole 16-row tiles
  int64_t ldb;       // bytes per packed step of the slab
};

// The part's buffers (thread-local, 64-byte aligned, grown on demand).
struct PanelBufs {
  uint8_t* slab;    // [kPanelK / 4 steps][cols][4] packed weights
  int32_t* acc;     // [rows_pad][cols] int32 sums
  int32_t* zeros;   // store_c's correction: none, x is signed here
  int32_t* colmap;  // packed column -> natural column
  float* wsp;       // weight scale per packed column (0 for padding)
  float* cpk;       // one row's C in packed order
  float* cnat;      // the same in natural order
  int8_t* xs;       // [rows_pad][xstride] signed x
};

[[gnu::always_inline]] inline PanelGeom panel_geometry(const TileArgs& a) {
  constexpr int64_t G = Avx512VnniTraits::PACK_G;
  PanelGeom g;
  const bool swiglu = a.mode == Mode::kSwiglu;
  g.nseg = swiglu ? 2 : 1;
  g.n = a.n;
  g.kdim = a.k;
  g.width = a.width;
  g.xstride = a.xprep_stride;
  g.seg_col[0] = a.col0;
  g.seg_col[1] = g.n / 2 + a.col0;
  g.wpad = (g.width + G - 1) / G * G;
  g.cols = g.nseg * g.wpad;
  g.rows_pad = (a.rows + 31) / 32 * 32;
  g.ldb = g.cols * 4;
  return g;
}

[[gnu::always_inline]] inline PanelBufs panel_buffers(const PanelGeom& g) {
  auto aligned = [](auto& v, size_t count) {
    if (v.size() < count + 64) v.resize(count + 64);
    using E = typename std::remove_reference_t<decltype(v)>::value_type;
    return reinterpret_cast<E*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
  };
  thread_local std::vector<uint8_t> slab_v, x_v;
  thread_local std::vector<int32_t> acc_v, int_v;
  thread_local std::vector<float> flt_v;
  PanelBufs b;
  b.slab = aligned(slab_v, static_cast<size_t>(kPanelK / 4 * g.ldb));
  b.acc = aligned(acc_v, static_cast<size_t>(g.rows_pad * g.cols));
  int32_t* ints = aligned(int_v, static_cast<size_t>(2 * g.cols));
  b.zeros = ints;
  b.colmap = ints + g.cols;
  float* flts = aligned(flt_v, static_cast<size_t>(3 * g.cols));
  b.wsp = flts;
  b.cpk = flts + g.cols;
  b.cnat = flts + 2 * g.cols;
  std::fill(b.zeros, b.zeros + g.cols, 0);
  b.xs = reinterpret_cast<int8_t*>(aligned(x_v, static_cast<size_t>(g.rows_pad * g.xstride)));
  return b;
}

// x back to signed bytes (prepared rows are x ^ 0x80 for VPDPBUSD): TDPBSSD multiplies signed
// by signed, so no column sums are needed. Rows past the expert's are zeros.
[[gnu::always_inline]] inline void signed_x(const TileArgs& a, const PanelGeom& g, int8_t* xs) {
  const int64_t xstride = g.xstride;
  for (int64_t r = 0; r < g.rows_pad; ++r)
    for (int64_t i = 0; i < xstride; i += 64) {
      const __m512i v = r < a.rows ? _mm512_loadu_si512(a.xprep + r * xstride + i) : _mm512_set1_epi8(-128);
      _mm512_storeu_si512(xs + r * xstride + i, _mm512_xor_si512(v, _mm512_set1_epi8(-128)));
    }
}

// Every tile 16 rows x 64 bytes.
ORT_OPS_AMX_STEP void configure_tiles() {
  AmxConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// ---- "EN16K4" weights (a.quads): B tiles in place ----
// The weight is already B tiles: per 16-column tile ct the k quads of all K,
// w[((ct * k4 + step) * 16 + col % 16) * 4 + k % 4], so one 1 KB B tile is 16 consecutive
// steps, contiguous, and a 32-column chunk is two sequential streams over all of K. The
// chunk's sums stay in tile registers for all of K (no slabs). Chunks whose columns do not
// start a column tile (the G half when N/2 % 16 != 0) or run past the part, and the last k
// tile when K % 64 != 0, are gathered into an edge buffer with zeros past the width and K.
struct QuadsB {
  const int8_t* w;
  int64_t k4, ktiles_all, ntiles;
};

// 32 packed columns from a packed column: natural first column, live columns, whether read in
// place.
struct QuadsHalf {
  int64_t c0, live;
  bool direct;
};

// The two B tiles (columns 0-15, 16-31) of one k tile: in place, or gathered into an edge
// buffer.
struct BTiles {
  const uint8_t *p0, *p1;
  int64_t ld;
};

[[gnu::always_inline]] inline const int8_t* quad(const QuadsB& q, int64_t step, int64_t col) {
  return q.w + (((col / 16) * q.k4 + step) * 16 + col % 16) * 4;
}

[[gnu::always_inline]] inline QuadsHalf quads_half(const PanelGeom& g, const QuadsB& q, int64_t ch) {
  const int64_t sg = ch / g.wpad, c = ch % g.wpad;
  QuadsHalf h{g.seg_col[sg] + c, c < g.width ? std::min<int64_t>(32, g.width - c) : 0, false};
  h.direct = h.live == 32 && h.c0 % 16 == 0 && h.c0 / 16 + 1 < q.ntiles;
  return h;
}

[[gnu::always_inline]] inline BTiles quads_btiles(const QuadsB& q, const QuadsHalf& h, int64_t t,
                                                  uint8_t (*e)[32 * 4]) {
  if (h.direct && (t + 1) * 16 <= q.k4) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(quad(q, t * 16, h.c0));
    return BTiles{p, p + q.k4 * 64, 64};
  }
  for (int64_t s = 0; s < 16; ++s)
    for (int64_t c = 0; c < 32; ++c) {
      const int64_t step = t * 16 + s;
      if (step < q.k4 && c < h.live)
        std::memcpy(e[s] + c * 4, quad(q, step, h.c0 + c), 4);
      else
        std::memset(e[s] + c * 4, 0, 4);
    }
  return BTiles{e[0], e[0] + 64, int64_t{32 * 4}};
}

// More than 16 rows: the 32-column chunk at packed column ch times every 32-row block in
// turn, so the chunk's weights (K * 128 bytes) come from memory once and from L2 for the other
// blocks.
ORT_OPS_AMX_STEP void quads_chunk_blocks(const TileArgs& a, const PanelGeom& g, const QuadsB& q,
                                         const QuadsHalf& h0, int64_t ch, const int8_t* xs,
                                         int32_t* acc, uint8_t (*edge)[32 * 4]) {
  for (int64_t rb = 0; rb < a.rows; rb += 32) {
    const bool two = a.rows - rb > 16;
    const int8_t* xp = xs + rb * g.xstride;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t = 0; t < q.ktiles_all; ++t) {
      const BTiles b = quads_btiles(q, h0, t, edge);
      _tile_loadd(6, b.p0, b.ld);
      _tile_loadd(7, b.p1, b.ld);
      panel_mac(xp + t * 64, g.xstride, two);
    }
    panel_store(acc + rb * g.cols + ch, g.cols, g.ldb, two);
  }
}

// Up to 16 rows: the 64-column chunk at packed column ch (four column tiles, four streams in
// flight), its sums in tiles 0-3.
ORT_OPS_AMX_STEP void quads_chunk_one(const PanelGeom& g, const QuadsB& q, const QuadsHalf& h0,
                                      const QuadsHalf& h1, int64_t ch, const int8_t* xs,
                                      int32_t* acc, uint8_t (*edge)[16][32 * 4]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t t = 0; t < q.ktiles_all; ++t) {
    _tile_loadd(4, xs + t * 64, g.xstride);
    const BTiles b0 = quads_btiles(q, h0, t, edge[0]);
    _tile_loadd(6, b0.p0, b0.ld);
    _tile_dpbssd(0, 4, 6);
    _tile_loadd(7, b0.p1, b0.ld);
    _tile_dpbssd(1, 4, 7);
    const BTiles b1 = quads_btiles(q, h1, t, edge[1]);
    _tile_loadd(5, b1.p0, b1.ld);
    _tile_dpbssd(2, 4, 5);
    _tile_loadd(6, b1.p1, b1.ld);
    _tile_dpbssd(3, 4, 6);
  }
  int32_t* c = acc + ch;
  _tile_stored(0, c, g.ldb);
  _tile_stored(1, c + 16, g.ldb);
  _tile_stored(2, c + 32, g.ldb);
  _tile_stored(3, c + 48, g.ldb);
}

// All sums of an "EN16K4" part. Up to 16 rows: 64 columns a chunk; more rows: 32 columns a
// chunk. wpad is a multiple of 64, so both halves of a 64-column chunk are in one segment.
ORT_OPS_AMX_STEP void quads_sums(const TileArgs& a, const PanelGeom& g, const int8_t* xs,
                                 int32_t* acc) {
  const QuadsB q{a.w, g.kdim / 4, (g.kdim + 63) / 64, (g.n + 15) / 16};
  alignas(64) uint8_t edge[2][16][32 * 4];
  const bool one = a.rows <= 16;
  for (int64_t ch = 0; ch < g.cols; ch += one ? 64 : 32) {
    const QuadsHalf h0 = quads_half(g, q, ch);
    if (h0.live == 0) continue;  // padding columns: never stored, wsp 0
    if (!one) {
      quads_chunk_blocks(a, g, q, h0, ch, xs, acc, edge[0]);
      continue;
    }
    quads_chunk_one(g, q, h0, quads_half(g, q, ch + 32), ch, xs, acc, edge);
  }
}

// ---- the contract's [K, N] weights: packed into a slab kPanelK deep ----
// Steps [0, ktiles * 16) of the slab from k0: per segment and 64-column group, 4 k rows
// interleaved into quads (pack_regs); steps past K are zeros.
[[gnu::always_inline]] inline void pack_slab(const PanelGeom& g, const int8_t* w, int64_t k0,
                                             int64_t ktiles, uint8_t* slab) {
  using T = Avx512VnniTraits;
  constexpr int64_t G = T::PACK_G;
  constexpr int64_t kPanelPrefetchRows = 8;
  alignas(64) int8_t tmp[4][G];
  for (int64_t s = 0; s < ktiles * 16; ++s) {
    const int64_t k = k0 + s * 4;
    uint8_t* dst = slab + s * g.ldb;
    for (int sg = 0; sg < g.nseg; ++sg)
      for (int64_t c = 0; c < g.wpad; c += G) {
        const int8_t* rp[4];
        for (int i = 0; i < 4; ++i) {
          if (k + i < g.kdim) {
            rp[i] = safe_cols<G>(w + (k + i) * g.n + g.seg_col[sg] + c, g.width - c, tmp[i]);
          } else {
            std::memset(tmp[i], 0, G);
            rp[i] = tmp[i];
          }
        }
        // Rows two steps ahead into L2 (each step reads 4 rows N bytes apart).
        for (int i = 0; i < 4; ++i)
          if (k + kPanelPrefetchRows + i < g.kdim)
            _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPanelPrefetchRows + i) * g.n + g.seg_col[sg] + c),
                         _MM_HINT_T1);
        __m512i v[4];
        T::pack_regs(rp, v);
        uint8_t* d = dst + (sg * g.wpad + c) * 4;
        for (int j = 0; j < 4; ++j) T::store(d + j * 64, v[j]);
      }
  }
}

// Every 32-row block times the slab (ktiles k tiles from k0), 32 columns at a time, adding to
// the sums in acc (k0 == 0: starting from zero).
ORT_OPS_AMX_STEP void slab_sums(const TileArgs& a, const PanelGeom& g, const int8_t* xs,
                                const uint8_t* slab, int64_t k0, int64_t ktiles, int32_t* acc) {
  const int64_t cols = g.cols, ldb = g.ldb;
  for (int64_t rb = 0; rb < a.rows; rb += 32) {
    const bool two = a.rows - rb > 16;
    const int8_t* xp = xs + rb * g.xstride + k0;  // quads: byte offset = k
    for (int64_t ch = 0; ch < cols; ch += 32) {
      int32_t* c = acc + rb * cols + ch;
      // Rows 16-31 of the block exist only when `two`: their sums are neither loaded nor kept.
      if (k0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, c, ldb);
        _tile_loadd(1, c + 16, ldb);
        if (two) {
          _tile_loadd(2, c + 16 * cols, ldb);
          _tile_loadd(3, c + 16 * cols + 16, ldb);
        }
      }
      const uint8_t* bp = slab + ch * 4;
      for (int64_t t = 0; t < ktiles; ++t) {
        _tile_loadd(6, bp + t * 16 * ldb, ldb);
        _tile_loadd(7, bp + t * 16 * ldb + 64, ldb);
        panel_mac(xp + t * 64, g.xstride, two);
      }
      panel_store(c, cols, ldb, two);
    }
  }
}

// Epilogue: the tile path's operations (store_c, then finish_row) over the part's columns.
// Returns false with *bad_row set at the first row whose C is not finite.
[[gnu::always_inline]] inline bool panel_epilogue(const TileArgs& a, const PanelGeom& g,
                                                  const PanelBufs& b, int64_t* bad_row) {
  using T = Avx512VnniTraits;
  constexpr int64_t G = T::PACK_G;
  const int64_t cols = g.cols, wpad = g.wpad;
  for (int64_t p = 0; p < cols; ++p) {
    const int64_t q = p % wpad, j = a.quads ? q : (q / G) * G + T::perm(q % G);
    b.colmap[p] = static_cast<int32_t>((p / wpad) * wpad + j);
    b.wsp[p] = j < g.width ? a.w_scale[g.seg_col[p / wpad] + j] : 0.0f;
  }
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t p = 0; p < cols; p += 16)
      T::store_c(T::load(reinterpret_cast<const uint8_t*>(b.acc + r * cols + p)), b.zeros + p, a.x_scale[r], b.wsp + p,
                 b.cpk + p);
    if (!finish_row_n(a, b.cpk, b.colmap, a.out + r * a.ldo, cols, wpad, b.cnat)) {
      *bad_row = r;
      return false;
    }
  }
  return true;
}

}  // namespace

ORT_OPS_AMX bool panel_amx(const TileArgs& a, int64_t* bad_row) {
  const PanelGeom g = panel_geometry(a);
  const PanelBufs b = panel_buffers(g);
  signed_x(a, g, b.xs);
  configure_tiles();
  if (a.quads) quads_sums(a, g, b.xs, b.acc);
  for (int64_t k0 = 0; k0 < (a.quads ? 0 : g.kdim); k0 += kPanelK) {
    const int64_t ktiles = (std::min(kPanelK, g.kdim - k0) + 63) / 64;
    pack_slab(g, a.w, k0, ktiles, b.slab);
    slab_sums(a, g, b.xs, b.slab, k0, ktiles, b.acc);
  }
  _tile_release();
  return panel_epilogue(a, g, b, bad_row);
}

bool tile_avx512vnni(const TileArgs& a, int64_t* bad_row) {
  return tile_simd<Avx512VnniTraits>(a, bad_row);
}

void gemv_partial_avx512vnni(const GemvArgs& g) { gemv_partial_simd<Avx512VnniTraits>(g); }
bool gemv_finish_avx512vnni(const GemvFinishArgs& f, int64_t* bad_row) {
  return gemv_finish_simd<Avx512VnniTraits>(f, bad_row);
}

}  // namespace ort_ops::grouped_matmul
