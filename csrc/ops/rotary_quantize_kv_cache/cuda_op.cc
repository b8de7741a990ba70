// SPDX-License-Identifier: MIT
// RotaryQuantizeKVCache on ORT's CUDA EP: the CPU op's attributes, checks and messages
// (validate.cc, shared with op.cc) plus the kernel's head_dim limit, the kernel of cuda.cu on the
// session's compute stream.
//
// As QuantizeKVCache's CUDA op: slot_mapping is on the device and never read by the host; the
// kernel checks it (range, no live slot twice) before writing any cache byte and leaves a
// non-finite rotated K or V vector unwritten, reporting through the node's status word
// (cuda/device_status.h) at its next Compute or by ort_ops_take_device_error() after the Run. So
// a Run is its launches alone: the host never waits for the GPU. Cache outputs that are not their
// input's own buffer get a device-to-device copy of the cache first.
#include "ops/rotary_quantize_kv_cache/cuda_op.h"

#include <cuda_runtime.h>

#include <atomic>
#include <optional>
#include <string>

#include "common/tensor.h"
#include "cuda/device_status.h"
#include "cuda/ort_cuda.h"
#include "ops/quantize_kv_cache/cuda.cuh"
#include "ops/rotary_quantize_kv_cache/cuda.cuh"
#include "ops/rotary_quantize_kv_cache/validate.h"

namespace ort_ops {
namespace {

namespace rqk = rotary_quantize_kv_cache;

using rqk::kOp;

constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;

void check_cuda(cudaError_t err, const char* what) { cuda_util::check_cuda(kOp, err, what); }

std::string describe(int bits, int64_t num_slots) {
  if (bits & kQkvSlotBad)
    return str_cat(kOp, ": input 'slot_mapping' must hold slots < ", num_slots,
                   " (num_blocks * block_size), negative to skip a token, and no slot >= 0 twice; "
                   "nothing of that Run was written to the caches");
  return str_cat(kOp, ": input 'qkv' must be finite in the K (after rotation) and the V of live tokens, got NaN or "
                 "Inf (those vectors were not written)");
}

class RotaryQuantizeKVCacheCuda final : public KernelImpl {
 public:
  explicit RotaryQuantizeKVCacheCuda(const OrtKernelInfo* info)
      : attrs_(rqk::read_attrs(info)), status_([this](int bits) { return describe(bits, num_slots_.load()); }) {}

  void compute(Ort::KernelContext& ctx) override {
    status_.raise_pending();
    const rqk::Inputs in = rqk::read_inputs(ctx);
    const rqk::Dims d = rqk::validate_inputs(in, attrs_);
    if (d.D > 512) fail_unsupported(kOp, "(CUDA) head_dim must be <= 512, got ", d.D);
    if (d.T * d.Hq >= (int64_t{1} << 30)) fail_unsupported(kOp, "(CUDA) T * num_heads must be < 2^30");
    const quantize_kv_cache::Caches& caches = in.caches;
    const int64_t num_slots = d.cache.N * d.cache.B;
    num_slots_.store(num_slots);

    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    void* query = make_output_raw(ctx, 0, {d.T, d.Hq, d.D});
    auto* kc_out = make_output<int8_t>(ctx, 1, caches.key_cache.shape);
    auto* vc_out = make_output<int8_t>(ctx, 2, caches.value_cache.shape);
    auto* ks_out = make_output<float>(ctx, 3, caches.key_scale.shape);
    auto* vs_out = make_output<float>(ctx, 4, caches.value_scale.shape);
    auto copy_unless_same = [&](const InputView& in, void* out, size_t bytes) {
      if (out != in.data && bytes)
        check_cuda(cudaMemcpyAsync(out, in.data, bytes, cudaMemcpyDeviceToDevice, stream), "cache copy");
    };
    copy_unless_same(caches.key_cache, kc_out, caches.key_cache.numel);
    copy_unless_same(caches.value_cache, vc_out, caches.value_cache.numel);
    copy_unless_same(caches.key_scale, ks_out, caches.key_scale.numel * sizeof(float));
    copy_unless_same(caches.value_scale, vs_out, caches.value_scale.numel * sizeof(float));
    if (d.T == 0) return;

    const size_t ws = quantize_kv_cache_workspace_bytes(d.T);
    std::optional<cuda_util::OrtCudaScratch> scratch;  // only for the check kernel (T > 64)
    if (ws) scratch.emplace(kOp, ctx, ws);

    RotaryQuantizeKvParams p;
    p.qkv = in.qkv.data;
    p.cos = in.cos.data;
    p.sin = in.sin.data;
    p.query = query;
    p.num_heads = static_cast<int>(d.Hq);
    p.rotary_half = static_cast<int>(d.half);
    p.interleaved = attrs_.interleaved;
    QuantizeKvCacheParams& c = p.cache;
    c.input_fp16 = in.qkv.dtype == F16;
    c.slot_mapping = caches.slot_mapping.ptr<int64_t>();
    c.key_cache = kc_out;
    c.value_cache = vc_out;
    c.key_scale = ks_out;
    c.value_scale = vs_out;
    c.num_tokens = static_cast<int>(d.T);
    c.num_kv_heads = static_cast<int>(d.Hkv);
    c.head_dim = static_cast<int>(d.D);
    c.block_size = static_cast<int>(d.cache.B);
    c.num_slots = num_slots;
    c.status = status_.word(kOp);
    c.workspace = ws ? scratch->get() : nullptr;
    check_cuda(launch_rotary_quantize_kv_cache(p, stream), "kernel launch");
  }

 private:
  rqk::Attrs attrs_;
  std::atomic<int64_t> num_slots_{0};  // of the latest Run, for the message
  cuda_util::DeviceStatus status_;
};

}  // namespace

const CustomOp& rotary_quantize_kv_cache_cuda_op() {
  static const CustomOp op(rotary_quantize_kv_cache::signature(), kCudaEp, make_kernel<RotaryQuantizeKVCacheCuda>);
  return op;
}

}  // namespace ort_ops
