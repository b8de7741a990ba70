// SPDX-License-Identifier: MIT
#include "ops/quantize_kv_cache/cpu_write.h"

#include <cstring>

#include "common/parallel.h"
#include "common/tensor.h"

namespace ort_ops::quantize_kv_cache {

QuantizedRows quantize_live_rows(Ort::KernelContext& ctx, const char* op, const Dims& d, const int64_t* slot,
                                 dynamic_quant::QuantizeRowFn quantize_row, const TokenRowsFn& rows,
                                 const NonFiniteNames& names) {
  const int64_t T = d.T, H = d.H, D = d.D;
  QuantizedRows out;
  out.kq.resize(static_cast<size_t>(T * H * D));
  out.vq.resize(static_cast<size_t>(T * H * D));
  out.ksc.resize(static_cast<size_t>(T * H));
  out.vsc.resize(static_cast<size_t>(T * H));
  parallel_for(ctx, static_cast<size_t>(T), [&](size_t ti) {
    const int64_t t = static_cast<int64_t>(ti);
    if (slot[t] < 0) return;
    std::vector<float> kbuf(static_cast<size_t>(H * D)), vbuf(static_cast<size_t>(H * D));
    const TokenRows src = rows(t, kbuf.data(), vbuf.data());
    for (int64_t h = 0; h < H; ++h) {
      const int64_t r = t * H + h;
      if (D == 0) {
        out.ksc[r] = out.vsc[r] = 0.0f;
        continue;
      }
      if (!quantize_row(src.k + h * D, nullptr, D, out.kq.data() + r * D, &out.ksc[r]))
        fail_invalid(op, names.key, ", got NaN or Inf in token ", t, ", kv head ", h);
      if (!quantize_row(src.v + h * D, nullptr, D, out.vq.data() + r * D, &out.vsc[r]))
        fail_invalid(op, names.value, ", got NaN or Inf in token ", t, ", kv head ", h);
    }
  });
  return out;
}

namespace {
void copy_unless_same(const InputView& in, void* out, size_t bytes) {
  if (out != in.data && bytes) std::memcpy(out, in.data, bytes);
}
}  // namespace

void write_caches(Ort::KernelContext& ctx, const Caches& in, size_t first_output, const Dims& d,
                  const int64_t* slot, const QuantizedRows& rows) {
  const InputView &kc = in.key_cache, &vc = in.value_cache, &ks = in.key_scale, &vs = in.value_scale;
  auto* kc_out = make_output<int8_t>(ctx, first_output + 0, kc.shape);
  auto* vc_out = make_output<int8_t>(ctx, first_output + 1, vc.shape);
  auto* ks_out = make_output<float>(ctx, first_output + 2, ks.shape);
  auto* vs_out = make_output<float>(ctx, first_output + 3, vs.shape);
  copy_unless_same(kc, kc_out, kc.numel * sizeof(int8_t));
  copy_unless_same(vc, vc_out, vc.numel * sizeof(int8_t));
  copy_unless_same(ks, ks_out, ks.numel * sizeof(float));
  copy_unless_same(vs, vs_out, vs.numel * sizeof(float));
  const int64_t H = d.H, D = d.D, B = d.B;
  parallel_for(ctx, static_cast<size_t>(d.T), [&](size_t ti) {
    const int64_t t = static_cast<int64_t>(ti);
    if (slot[t] < 0) return;
    const int64_t blk = slot[t] / B, off = slot[t] % B;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t r = t * H + h;
      const int64_t bh = blk * H + h;
      std::memcpy(kc_out + (bh * B + off) * D, rows.kq.data() + r * D, static_cast<size_t>(D));
      int8_t* vdst = vc_out + bh * D * B + off;
      for (int64_t i = 0; i < D; ++i) vdst[i * B] = rows.vq[r * D + i];
      ks_out[bh * B + off] = rows.ksc[r];
      vs_out[bh * B + off] = rows.vsc[r];
    }
  });
}

}  // namespace ort_ops::quantize_kv_cache
