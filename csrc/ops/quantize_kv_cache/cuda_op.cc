// SPDX-License-Identifier: MIT
// QuantizeKVCache on ORT's CUDA EP: the CPU op's inputs, checks and messages (op.cc), the
// kernel of cuda.cu on the session's compute stream.
//
// slot_mapping is on the device; it is copied to the host (T int64, once per Run) so that an
// out-of-range or repeated slot fails the Run before anything is written, as on the CPU. A
// non-finite K/V vector is reported by the kernel in a status word (from ORT's CUDA allocator)
// that Compute reads back after one stream synchronization; such a vector is never written, the
// others of that Run are. Outputs that are not their input's own buffer (no IOBinding in place)
// get a device-to-device copy of the cache first; in place, only the T new slots are written.
#include "ops/quantize_kv_cache/cuda_op.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <vector>

#include "common/tensor.h"
#include "ops/quantize_kv_cache/cuda.cuh"

namespace ort_ops {
namespace {

constexpr const char* kOp = "QuantizeKVCache";
constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr auto I64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw OpError(ORT_EP_FAIL, str_cat(kOp, " (CUDA): ", what, " failed: ", cudaGetErrorName(err), " (",
                                       cudaGetErrorString(err), ")"));
}

class QuantizeKVCacheCuda final : public KernelImpl {
 public:
  explicit QuantizeKVCacheCuda(const OrtKernelInfo*) {}

  void compute(Ort::KernelContext& ctx) override {
    const InputView key = read_input(ctx, 0), value = read_input(ctx, 1);
    const InputView slots = read_input(ctx, 2);
    const InputView kc = read_input(ctx, 3), vc = read_input(ctx, 4);
    const InputView ks = read_input(ctx, 5), vs = read_input(ctx, 6);
    require_dtype(kOp, "key", key, {F32, F16});
    require_dtype(kOp, "value", value, {F32, F16});
    if (value.dtype != key.dtype)
      fail_unsupported(kOp, "(CUDA) input 'value' must have the dtype of 'key' (", dtype_name(key.dtype), "), got ",
                   dtype_name(value.dtype));
    require_dtype(kOp, "slot_mapping", slots, {I64});
    require_dtype(kOp, "key_cache", kc, {I8});
    require_dtype(kOp, "value_cache", vc, {I8});
    require_dtype(kOp, "key_scale", ks, {F32});
    require_dtype(kOp, "value_scale", vs, {F32});
    require_rank(kOp, "key", key, 3);
    const int64_t T = key.dim(0), H = key.dim(1), D = key.dim(2);
    require_shape(kOp, "value", value, key.shape);
    require_shape(kOp, "slot_mapping", slots, {T});
    require_rank(kOp, "key_cache", kc, 4);
    const int64_t N = kc.dim(0), B = kc.dim(2);
    require_shape(kOp, "key_cache", kc, {N, H, B, D});
    require_shape(kOp, "value_cache", vc, {N, H, D, B});
    require_shape(kOp, "key_scale", ks, {N, H, B});
    require_shape(kOp, "value_scale", vs, {N, H, B});
    if (D > 512) fail_unsupported(kOp, "(CUDA) head_dim must be <= 512, got ", D);
    if (T * H >= (int64_t{1} << 30)) fail_unsupported(kOp, "(CUDA) T * kv heads must be < 2^30");

    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    std::vector<int64_t> slot(static_cast<size_t>(T));
    if (T) {
      check_cuda(cudaMemcpyAsync(slot.data(), slots.data, sizeof(int64_t) * T, cudaMemcpyDeviceToHost, stream),
                 "slot_mapping copy");
      check_cuda(cudaStreamSynchronize(stream), "stream synchronize");
    }
    const int64_t num_slots = N * B;
    std::vector<int64_t> live;
    for (int64_t t = 0; t < T; ++t) {
      if (slot[t] < 0) continue;
      if (slot[t] >= num_slots)
        fail_invalid(kOp, "input 'slot_mapping' must hold slots < ", num_slots,
                     " (num_blocks * block_size), got slot_mapping[", t, "] = ", slot[t]);
      live.push_back(slot[t]);
    }
    std::sort(live.begin(), live.end());
    const auto dup = std::adjacent_find(live.begin(), live.end());
    if (dup != live.end()) fail_invalid(kOp, "input 'slot_mapping' must not repeat a slot, got slot ", *dup, " twice");

    auto* kc_out = make_output<int8_t>(ctx, 0, kc.shape);
    auto* vc_out = make_output<int8_t>(ctx, 1, vc.shape);
    auto* ks_out = make_output<float>(ctx, 2, ks.shape);
    auto* vs_out = make_output<float>(ctx, 3, vs.shape);
    auto copy_unless_same = [&](const InputView& in, void* out, size_t bytes) {
      if (out != in.data && bytes)
        check_cuda(cudaMemcpyAsync(out, in.data, bytes, cudaMemcpyDeviceToDevice, stream), "cache copy");
    };
    copy_unless_same(kc, kc_out, kc.numel);
    copy_unless_same(vc, vc_out, vc.numel);
    copy_unless_same(ks, ks_out, ks.numel * sizeof(float));
    copy_unless_same(vs, vs_out, vs.numel * sizeof(float));
    if (live.empty() || D == 0) return;

    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    Ort::MemoryInfo info("Cuda", OrtDeviceAllocator, device, OrtMemTypeDefault);
    OrtAllocator* alloc = ctx.GetAllocator(*static_cast<const OrtMemoryInfo*>(info));
    if (alloc == nullptr) fail_unsupported(kOp, "no CUDA allocator in this session");
    std::unique_ptr<void, std::function<void(void*)>> status_buf(alloc->Alloc(alloc, 256),
                                                                 [alloc](void* q) { alloc->Free(alloc, q); });
    if (!status_buf) throw OpError(ORT_FAIL, str_cat(kOp, ": could not allocate the status word"));

    QuantizeKvCacheParams p;
    p.key = key.data;
    p.value = value.data;
    p.input_fp16 = key.dtype == F16;
    p.slot_mapping = slots.ptr<int64_t>();
    p.key_cache = kc_out;
    p.value_cache = vc_out;
    p.key_scale = ks_out;
    p.value_scale = vs_out;
    p.num_tokens = static_cast<int>(T);
    p.num_kv_heads = static_cast<int>(H);
    p.head_dim = static_cast<int>(D);
    p.block_size = static_cast<int>(B);
    p.num_slots = num_slots;
    p.status = static_cast<int*>(status_buf.get());
    check_cuda(cudaMemsetAsync(p.status, 0, sizeof(int), stream), "status reset");
    check_cuda(launch_quantize_kv_cache(p, stream), "kernel launch");
    int status = 0;
    check_cuda(cudaMemcpyAsync(&status, p.status, sizeof(int), cudaMemcpyDeviceToHost, stream), "status copy");
    check_cuda(cudaStreamSynchronize(stream), "stream synchronize");
    if (status & kQkvNonFinite)
      fail_invalid(kOp, "inputs 'key' and 'value' must be finite, got NaN or Inf");
    if (status & kQkvSlotOutOfRange)  // checked above; kept so a kernel-side report is never lost
      fail_invalid(kOp, "input 'slot_mapping' must hold slots < ", num_slots, " (num_blocks * block_size)");
  }
};

}  // namespace

const CustomOp& quantize_kv_cache_cuda_op() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  static const CustomOp op(
      OpSpec{kOp,
             "CUDAExecutionProvider",
             {{ANY}, {ANY}, {I64}, {I8}, {I8}, {F32}, {F32}},
             {{I8}, {I8}, {F32}, {F32}}},
      [](const OrtKernelInfo* info) -> std::unique_ptr<KernelImpl> {
        return std::make_unique<QuantizeKVCacheCuda>(info);
      });
  return op;
}

}  // namespace ort_ops
