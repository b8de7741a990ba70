// SPDX-License-Identifier: MIT
// QuantizeKVCache on ORT's CUDA EP: the CPU op's inputs, checks and messages (validate.cc, shared
// with op.cc) plus the CUDA kernel's limits, the kernel of cuda.cu on the session's compute stream.
//
// slot_mapping is on the device and is never read by the host: the kernels check it (range, no
// live slot twice) before writing anything, and a non-finite K/V vector is left unwritten. What
// they find is reported through the op's status word (cuda/device_status.h): at the op's next
// Compute, or by ort_ops_take_device_error() after the Run. So a Run is its launches alone: the
// host never waits for the GPU. Outputs that are not their input's own buffer (no IOBinding in
// place) get a device-to-device copy of the cache first; in place, only the T new slots are written.
#include "ops/quantize_kv_cache/cuda_op.h"

#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "common/tensor.h"
#include "cuda/device_status.h"
#include "cuda/ort_cuda.h"
#include "ops/quantize_kv_cache/cuda.cuh"
#include "ops/quantize_kv_cache/cuda_outputs.h"
#include "ops/quantize_kv_cache/validate.h"

namespace ort_ops {
namespace {

namespace kvc = quantize_kv_cache;

using kvc::kOp;

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr auto I64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;

void check_cuda(cudaError_t err, const char* what) { cuda_util::check_cuda(kOp, err, what); }

// The kernel reads key and value as one dtype.
void check_same_float_dtype(const InputView& key, const InputView& value) {
  if (value.dtype != key.dtype)
    fail_unsupported(kOp, "(CUDA) input 'value' must have the dtype of 'key' (", dtype_name(key.dtype), "), got ",
                     dtype_name(value.dtype));
}

std::string describe(int bits, int64_t num_slots) {
  if (bits & kQkvSlotBad)
    return str_cat(kOp, ": input 'slot_mapping' must hold slots < ", num_slots,
                   " (num_blocks * block_size), negative to skip a token, and no slot >= 0 twice; "
                   "nothing of that Run was written");
  return str_cat(kOp, ": inputs 'key' and 'value' must be finite, got NaN or Inf (those vectors were not written)");
}

class QuantizeKVCacheCuda final : public KernelImpl {
 public:
  explicit QuantizeKVCacheCuda(const OrtKernelInfo*)
      : status_([this](int bits) { return describe(bits, num_slots_.load()); }) {}

  void compute(Ort::KernelContext& ctx) override {
    status_.raise_pending();
    const kvc::Inputs in = kvc::read_inputs(ctx);
    const kvc::Dims dims = kvc::validate_inputs(in, {check_same_float_dtype});
    const InputView &key = in.key, &value = in.value;
    const int64_t T = dims.T, H = dims.H, D = dims.D, N = dims.N, B = dims.B;
    if (D > 512) fail_unsupported(kOp, "(CUDA) head_dim must be <= 512, got ", D);
    if (T * H >= (int64_t{1} << 30)) fail_unsupported(kOp, "(CUDA) T * kv heads must be < 2^30");

    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    num_slots_.store(N * B);
    const kvc::CudaCacheOutputs outputs(kOp, ctx, in.caches(), 0, dims, stream, status_.word(kOp));
    if (T == 0 || D == 0) return;
    QuantizeKvCacheParams p = outputs.params();
    p.key = key.data;
    p.value = value.data;
    p.input_fp16 = key.dtype == F16;
    check_cuda(launch_quantize_kv_cache(p, stream), "kernel launch");
  }

 private:
  std::atomic<int64_t> num_slots_{0};  // of the latest Run, for the message
  cuda_util::DeviceStatus status_;
};

}  // namespace

const CustomOp& quantize_kv_cache_cuda_op() {
  static const CustomOp op(quantize_kv_cache::signature(), kCudaEp, make_kernel<QuantizeKVCacheCuda>);
  return op;
}

}  // namespace ort_ops
