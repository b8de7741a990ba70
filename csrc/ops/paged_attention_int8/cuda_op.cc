// SPDX-License-Identifier: MIT
// PagedAttentionInt8 on ORT's CUDA EP: the same inputs, attributes and error messages as the CPU
// op, validated on the host where the values are shapes (validate.cc, shared with op.cc, plus
// the CUDA kernels' limits here); the kernels of cuda.cu run on the session's compute stream
// with scratch (split partials + the status word) from ORT's CUDA allocator.
//
// block_tables, seq_lens and cu_seqlens_q live on the device and the host never reads them: the
// kernels check every value they use (they never read out of bounds on bad values) and report
// through the op's status word (cuda/device_status.h), at the op's next Compute or by
// ort_ops_take_device_error() after the Run. The grid is sized from shapes alone (max_blocks *
// block_size bounds the context, T the query rows), and T == S with cu_seqlens_q means decode
// (every sequence has at least one query row, DESIGN.md), so a Run is its launches: the host never
// waits for the GPU and the node can be captured in a CUDA graph.
#include "ops/paged_attention_int8/cuda_op.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>

#include "common/tensor.h"
#include "cuda/device_status.h"
#include "cuda/ort_cuda.h"
#include "ops/paged_attention_int8/cuda.cuh"
#include "ops/paged_attention_int8/validate.h"

namespace ort_ops {
namespace {

namespace pa = paged_attention_int8;

using pa::kOp;

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr auto I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;

void check_cuda(cudaError_t err, const char* what) { cuda_util::check_cuda(kOp, err, what); }

// What the kernels of cuda.cu take (cuda.cuh): qk_quant s8 only.
void check_cuda_attrs(const pa::Attrs& a) {
  if (!a.qk_s8) fail_unsupported(kOp, "(CUDA) attribute 'qk_quant' must be s8 on CUDA, got 'none'");
}

// Head dims with a kernel instance; blocks of >= 16 keys for the 16-byte V loads of one block.
void check_cuda_head_dim_and_block_size(int64_t D, int64_t B) {
  if (D != 32 && D != 64 && D != 128 && D != 256)
    fail_unsupported(kOp, "(CUDA) head_dim must be one of {32, 64, 128, 256}, got ", D);
  if (B < 16 || B > 256 || (B & (B - 1)) != 0)
    fail_unsupported(kOp, "(CUDA) block_size (dim 2 of input 'key_cache') must be a power of two in 16..256, got ", B);
}

constexpr pa::DeviceChecks kCudaChecks{check_cuda_attrs, check_cuda_head_dim_and_block_size};

// The message for the bits a launch set (cuda.cuh), with the dims of the latest Run.
std::string describe(int bits, int64_t context_bound, int64_t num_blocks, int64_t num_tokens) {
  if (bits & kPaSeqLenOutOfRange)
    return str_cat(kOp, ": input 'seq_lens' must be in 1..", context_bound,
                   " (max_blocks * block_size) and >= each sequence's query count");
  if (bits & (kPaCuSeqlensBad | kPaNotOneQueryEach))
    return str_cat(kOp, ": input 'cu_seqlens_q' must rise from 0 to T = ", num_tokens,
                   " with at least one query row per sequence");
  if (bits & kPaBlockOutOfRange)
    return str_cat(kOp, ": input 'block_tables' must hold block ids in 0..", num_blocks - 1,
                   " for every position a query sees (below seq_lens, within the window)");
  if (bits & kPaSinkNonFinite) return str_cat(kOp, ": input 'head_sink' must be finite, got NaN or Inf");
  return str_cat(kOp, ": input 'query' must be finite, got NaN or Inf");
}

class PagedAttentionInt8Cuda final : public KernelImpl {
 public:
  explicit PagedAttentionInt8Cuda(const OrtKernelInfo* info)
      : attrs_(pa::parse_attrs(info, kCudaChecks)),
        status_([this](int bits) { return describe(bits, context_bound_.load(), num_blocks_.load(), tokens_.load()); }) {
    pv_ = attrs_.pv_quant == "s8" ? PvQuant::kS8 : attrs_.pv_quant == "u8" ? PvQuant::kU8 : PvQuant::kNone;
  }

  void compute(Ort::KernelContext& ctx) override {
    status_.raise_pending();
    const pa::Inputs in = pa::read_inputs(ctx);
    const pa::Dims dims = pa::validate_inputs(in, kCudaChecks);
    const InputView& q = in.query;
    const InputView& cu = in.cu_seqlens_q;
    const int64_t T = dims.T, Hq = dims.Hq, D = dims.D, N = dims.N, Hkv = dims.Hkv, B = dims.B, S = dims.S,
                  M = dims.M;
    if (T >= (int64_t{1} << 31) / Hq || M * B >= (int64_t{1} << 31) || N * Hkv * B * D >= (int64_t{1} << 40))
      fail_unsupported(kOp, "(CUDA) tensor sizes beyond 32-bit token/position indices");
    void* out = make_output_raw(ctx, 0, q.shape);
    if (T == 0) return;

    PagedAttentionParams p;
    p.query = q.data;
    p.query_fp16 = q.dtype == F16;
    p.key_cache = in.key_cache.ptr<int8_t>();
    p.value_cache = in.value_cache.ptr<int8_t>();
    p.key_scale = in.key_scale.ptr<float>();
    p.value_scale = in.value_scale.ptr<float>();
    p.block_tables = in.block_tables.ptr<int32_t>();
    p.seq_lens = in.seq_lens.ptr<int32_t>();
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
    p.scale = attrs_.softmax_scale(D);
    p.pv_quant = pv_;
    p.partition_size = static_cast<int>(attrs_.partition_size);
    p.window = static_cast<int>(std::min<int64_t>(attrs_.window, INT32_MAX));  // beyond any context: no limit
    p.softcap = attrs_.softcap;
    p.head_sink = in.head_sink.present ? in.head_sink.ptr<float>() : nullptr;  // values not checked on CUDA
    if (const char* why = paged_attention_unsupported(p)) fail_unsupported(kOp, "(CUDA) ", why);

    // With cu_seqlens_q, T == S means one query row per sequence (each has at least one): the
    // decode kernel, which checks that on the device. Real models pass cu_seqlens_q on every
    // step, so this is how their decode steps reach the decode kernel.
    if (cu.present && T == S) {
      PagedAttentionParams pd = p;
      pd.max_q_len = 1;
      pd.decode_with_cu = true;
      if (paged_attention_decode_kernel_applies(pd)) p = pd;
    }
    context_bound_.store(M * B);
    num_blocks_.store(N);
    tokens_.store(T);

    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    const size_t ws = paged_attention_workspace_bytes(p);
    p.status = status_.word(kOp);
    std::optional<cuda_util::OrtCudaScratch> scratch;  // none at one split: no allocator round trip
    if (ws) scratch.emplace(kOp, ctx, ws);
    p.workspace = ws ? scratch->get() : nullptr;
    check_cuda(launch_paged_attention_int8(p, stream), "kernel launch");
  }

 private:
  pa::Attrs attrs_;
  PvQuant pv_ = PvQuant::kS8;
  std::atomic<int64_t> context_bound_{0}, num_blocks_{0}, tokens_{0};  // of the latest Run, for messages
  cuda_util::DeviceStatus status_;
};

}  // namespace

const CustomOp& paged_attention_int8_cuda_op() {
  static const CustomOp op(paged_attention_int8::signature(), kCudaEp, make_kernel<PagedAttentionInt8Cuda>);
  return op;
}

}  // namespace ort_ops
