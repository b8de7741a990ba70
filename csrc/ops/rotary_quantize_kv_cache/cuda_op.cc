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
#include <string>

#include "common/tensor.h"
#include "cuda/device_status.h"
#include "cuda/ort_cuda.h"
#include "ops/quantize_kv_cache/cuda.cuh"
#include "ops/quantize_kv_cache/cuda_outputs.h"
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
    num_slots_.store(d.cache.N * d.cache.B);
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    void* query = make_output_raw(ctx, 0, {d.T, d.Hq, d.D});
    const quantize_kv_cache::CudaCacheOutputs outputs(kOp, ctx, in.caches, 1, d.cache, stream, status_.word(kOp));
    if (d.T == 0) return;

    RotaryQuantizeKvParams p;
    p.qkv = in.qkv.data;
    p.cos = in.cos.data;
    p.sin = in.sin.data;
    p.query = query;
    p.num_heads = static_cast<int>(d.Hq);
    p.rotary_half = static_cast<int>(d.half);
    p.interleaved = attrs_.interleaved;
    p.cache = outputs.params();
    p.cache.input_fp16 = in.qkv.dtype == F16;
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
