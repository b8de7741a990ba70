// SPDX-License-Identifier: MIT
// PagedAttentionInt8 on ORT's CUDA EP: the same inputs, attributes and error messages as the CPU
// op (op.cc), validated on the host where the values are shapes; the kernels of cuda.cu run on
// the session's compute stream with scratch (split partials + the status word) from ORT's CUDA
// allocator.
//
// block_tables, seq_lens and cu_seqlens_q live on the device, so their values are checked by
// the kernel itself (it never reads out of bounds on bad values) and reported in a status word.
// To fail the Run as the contract requires, Compute copies that word back and synchronizes the
// stream once per Run (a few microseconds; ORT's session overhead is ~45 us).
#include "ops/paged_attention_int8/cuda_op.h"

#include <cuda_runtime.h>

#include <cmath>
#include <memory>
#include <string>

#include "common/tensor.h"
#include "ops/paged_attention_int8/cuda.cuh"

namespace ort_ops {
namespace {

constexpr const char* kOp = "PagedAttentionInt8";
constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr auto I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw OpError(ORT_EP_FAIL, str_cat(kOp, " (CUDA): ", what, " failed: ", cudaGetErrorName(err), " (",
                                       cudaGetErrorString(err), ")"));
}

class Scratch {
 public:
  Scratch(Ort::KernelContext& ctx, size_t bytes) {
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    Ort::MemoryInfo info("Cuda", OrtDeviceAllocator, device, OrtMemTypeDefault);
    alloc_ = ctx.GetAllocator(*static_cast<const OrtMemoryInfo*>(info));
    if (alloc_ == nullptr) fail_unsupported(kOp, "no CUDA allocator in this session");
    ptr_ = alloc_->Alloc(alloc_, bytes);
    if (ptr_ == nullptr) throw OpError(ORT_FAIL, str_cat(kOp, ": could not allocate ", bytes, " bytes of scratch"));
  }
  ~Scratch() {
    if (ptr_) alloc_->Free(alloc_, ptr_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  char* get() const { return static_cast<char*>(ptr_); }

 private:
  OrtAllocator* alloc_ = nullptr;
  void* ptr_ = nullptr;
};

class PagedAttentionInt8Cuda final : public KernelImpl {
 public:
  explicit PagedAttentionInt8Cuda(const OrtKernelInfo* info) {
    const std::string qk = attr_string(info, "qk_quant", "s8");
    const std::string pv = attr_string(info, "pv_quant", "s8");
    if (qk != "s8" && qk != "none") fail_invalid(kOp, "attribute 'qk_quant' must be s8 or none, got '", qk, "'");
    if (pv != "s8" && pv != "u8" && pv != "none")
      fail_invalid(kOp, "attribute 'pv_quant' must be s8, u8 or none, got '", pv, "'");
    if (qk != "s8") fail_unsupported(kOp, "(CUDA) attribute 'qk_quant' must be s8 on CUDA, got '", qk, "'");
    pv_ = pv == "s8" ? PvQuant::kS8 : pv == "u8" ? PvQuant::kU8 : PvQuant::kNone;
    partition_size_ = attr_int(info, "partition_size", 256);
    if (partition_size_ <= 0 || partition_size_ % 32 != 0)
      fail_invalid(kOp, "attribute 'partition_size' must be a positive multiple of 32, got ", partition_size_);
    has_scale_ = has_attr(info, "scale");
    if (has_scale_) {
      scale_ = attr_float(info, "scale", 0.0f);
      if (!std::isfinite(scale_)) fail_invalid(kOp, "attribute 'scale' must be finite, got ", scale_);
    }
  }

  void compute(Ort::KernelContext& ctx) override {
    const InputView q = read_input(ctx, 0);
    const InputView kc = read_input(ctx, 1), vc = read_input(ctx, 2);
    const InputView ks = read_input(ctx, 3), vs = read_input(ctx, 4);
    const InputView bt = read_input(ctx, 5), sl = read_input(ctx, 6), cu = read_input(ctx, 7);
    require_dtype(kOp, "query", q, {F32, F16});
    require_dtype(kOp, "key_cache", kc, {I8});
    require_dtype(kOp, "value_cache", vc, {I8});
    require_dtype(kOp, "key_scale", ks, {F32});
    require_dtype(kOp, "value_scale", vs, {F32});
    require_dtype(kOp, "block_tables", bt, {I32});
    require_dtype(kOp, "seq_lens", sl, {I32});
    require_rank(kOp, "query", q, 3);
    const int64_t T = q.dim(0), Hq = q.dim(1), D = q.dim(2);
    require_rank(kOp, "key_cache", kc, 4);
    const int64_t N = kc.dim(0), Hkv = kc.dim(1), B = kc.dim(2);
    require_shape(kOp, "key_cache", kc, {N, Hkv, B, D});
    if (D != 64 && D != 128 && D != 256)
      fail_unsupported(kOp, "(CUDA) head_dim must be one of {64, 128, 256}, got ", D);
    if (B < 16 || B > 256 || (B & (B - 1)) != 0)
      fail_unsupported(kOp, "(CUDA) block_size (dim 2 of input 'key_cache') must be a power of two in 16..256, got ", B);
    if (Hkv <= 0 || Hq % Hkv != 0)
      fail_invalid(kOp, "query heads (", Hq, ") must be a multiple of kv heads (", Hkv, ", dim 1 of input 'key_cache')");
    require_shape(kOp, "value_cache", vc, {N, Hkv, D, B});
    require_shape(kOp, "key_scale", ks, {N, Hkv, B});
    require_shape(kOp, "value_scale", vs, {N, Hkv, B});
    require_rank(kOp, "block_tables", bt, 2);
    const int64_t S = bt.dim(0), M = bt.dim(1);
    require_shape(kOp, "seq_lens", sl, {S});
    if (cu.present) {
      require_dtype(kOp, "cu_seqlens_q", cu, {I32});
      require_shape(kOp, "cu_seqlens_q", cu, {S + 1});
    } else if (T != S) {
      fail_invalid(kOp, "input 'query' must have T == S == ", S, " rows in decode (no 'cu_seqlens_q'), got T = ", T);
    }
    if (T >= (int64_t{1} << 31) / Hq || M * B >= (int64_t{1} << 31) || N * Hkv * B * D >= (int64_t{1} << 40))
      fail_unsupported(kOp, "(CUDA) tensor sizes beyond 32-bit token/position indices");
    void* out = make_output_raw(ctx, 0, q.shape);
    if (T == 0) return;

    PagedAttentionParams p;
    p.query = q.data;
    p.query_fp16 = q.dtype == F16;
    p.key_cache = kc.ptr<int8_t>();
    p.value_cache = vc.ptr<int8_t>();
    p.key_scale = ks.ptr<float>();
    p.value_scale = vs.ptr<float>();
    p.block_tables = bt.ptr<int32_t>();
    p.seq_lens = sl.ptr<int32_t>();
    p.cu_seqlens_q = cu.present ? cu.ptr<int32_t>() : nullptr;
    p.output = out;
    p.num_tokens = static_cast<int>(T);
    p.num_seqs = static_cast<int>(S);
    p.num_heads = static_cast<int>(Hq);
    p.num_kv_heads = static_cast<int>(Hkv);
    p.head_dim = static_cast<int>(D);
    p.block_size = static_cast<int>(B);
    p.max_blocks = static_cast<int>(M);
    p.num_blocks = static_cast<int>(N);
    p.max_q_len = cu.present ? static_cast<int>(T) : 1;
    p.max_context = static_cast<int>(M * B);
    p.scale = has_scale_ ? scale_ : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
    p.pv_quant = pv_;
    p.partition_size = static_cast<int>(partition_size_);
    if (const char* why = paged_attention_unsupported(p)) fail_unsupported(kOp, "(CUDA) ", why);

    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    const size_t ws = (paged_attention_workspace_bytes(p) + 255) / 256 * 256;
    Scratch scratch(ctx, ws + 256);
    p.workspace = ws ? scratch.get() : nullptr;
    p.status = reinterpret_cast<int*>(scratch.get() + ws);
    check_cuda(cudaMemsetAsync(p.status, 0, sizeof(int), stream), "status reset");
    check_cuda(launch_paged_attention_int8(p, stream), "kernel launch");
    int status = 0;
    check_cuda(cudaMemcpyAsync(&status, p.status, sizeof(int), cudaMemcpyDeviceToHost, stream), "status copy");
    check_cuda(cudaStreamSynchronize(stream), "stream synchronize");
    if (status & kPaSeqLenOutOfRange)
      fail_invalid(kOp, "input 'seq_lens' must be in 0..", M * B,
                   " (max_blocks * block_size) and >= each sequence's query count");
    if (status & kPaCuSeqlensBad)
      fail_invalid(kOp, "input 'cu_seqlens_q' must rise from 0 to T = ", T, " (non-decreasing)");
    if (status & kPaBlockOutOfRange)
      fail_invalid(kOp, "input 'block_tables' must hold block ids in 0..", N - 1,
                   " for every position below seq_lens");
    if (status & kPaQueryNonFinite) fail_invalid(kOp, "input 'query' must be finite, got NaN or Inf");
  }

 private:
  PvQuant pv_ = PvQuant::kS8;
  int64_t partition_size_ = 256;
  bool has_scale_ = false;
  float scale_ = 0.0f;
};

}  // namespace

const CustomOp& paged_attention_int8_cuda_op() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  static const CustomOp op(
      OpSpec{kOp,
             "CUDAExecutionProvider",
             {{ANY}, {I8}, {I8}, {F32}, {F32}, {I32}, {I32}, {I32, true}},
             {{ANY}}},
      [](const OrtKernelInfo* info) -> std::unique_ptr<KernelImpl> {
        return std::make_unique<PagedAttentionInt8Cuda>(info);
      });
  return op;
}

}  // namespace ort_ops
