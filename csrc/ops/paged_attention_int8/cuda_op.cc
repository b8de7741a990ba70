// SPDX-License-Identifier: MIT
// PagedAttentionInt8 on ORT's CUDA EP: the same inputs, attributes and error messages as the CPU
// op, validated on the host where the values are shapes (validate.cc, shared with op.cc, plus
// the CUDA kernels' limits here); the kernels of cuda.cu run on the session's compute stream
// with scratch (split partials + the status word) from ORT's CUDA allocator.
//
// block_tables, seq_lens and cu_seqlens_q live on the device, so their values are checked by
// the kernel itself (it never reads out of bounds on bad values) and reported in a status word.
// To fail the Run as the contract requires, Compute synchronizes the stream once per Run and
// reads the word. The word sits in pinned host memory mapped into the device (one per Run in
// flight, from a pool): the host zeroes it before the launch, the kernels OR bits into it only on
// bad input, and the host reads it after the sync. So a Run is the launch(es) and one sync: no
// memset node and no device-to-host copy, which cost 7-11 us of wall time per Run on the H200
// (memset + launch + pageable copy + sync 29.1 us against 17.8 for launch + sync at batch 1 / 4k,
// 86.7 against 79.7 at batch 32 / 4k; NOTES_attention_cuda.md, v10).
#include "ops/paged_attention_int8/cuda_op.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/tensor.h"
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
  if (D != 64 && D != 128 && D != 256) fail_unsupported(kOp, "(CUDA) head_dim must be one of {64, 128, 256}, got ", D);
  if (B < 16 || B > 256 || (B & (B - 1)) != 0)
    fail_unsupported(kOp, "(CUDA) block_size (dim 2 of input 'key_cache') must be a power of two in 16..256, got ", B);
}

constexpr pa::DeviceChecks kCudaChecks{check_cuda_attrs, check_cuda_head_dim_and_block_size};

// A status word in pinned host memory, mapped into one device's address space.
struct StatusWord {
  int device = -1;
  int* host = nullptr;  // cudaHostAlloc(cudaHostAllocMapped)
  int* dev = nullptr;   // the same word as the device sees it
  ~StatusWord() {
    if (host) cudaFreeHost(host);
  }
};

// The status words of one kernel instance: a Run takes one (or makes one) and gives it back after
// its sync, so concurrent Runs never share a word and none is written by a kernel still in flight.
class StatusPool {
 public:
  class Lease {
   public:
    Lease(StatusPool& pool, std::unique_ptr<StatusWord> word) : pool_(pool), word_(std::move(word)) {}
    ~Lease() { pool_.put(std::move(word_)); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    const StatusWord* operator->() const { return word_.get(); }

   private:
    StatusPool& pool_;
    std::unique_ptr<StatusWord> word_;
  };

  std::unique_ptr<StatusWord> take(int device) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if ((*it)->device == device) {
          std::unique_ptr<StatusWord> w = std::move(*it);
          free_.erase(it);
          return w;
        }
    }
    auto w = std::make_unique<StatusWord>();
    w->device = device;
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&w->host), sizeof(int), cudaHostAllocMapped),
               "pinned status word");
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&w->dev), w->host, 0), "mapped status word");
    return w;
  }

 private:
  void put(std::unique_ptr<StatusWord> w) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(w));
  }
  std::mutex mu_;
  std::vector<std::unique_ptr<StatusWord>> free_;
};


class PagedAttentionInt8Cuda final : public KernelImpl {
 public:
  explicit PagedAttentionInt8Cuda(const OrtKernelInfo* info) : attrs_(pa::parse_attrs(info, kCudaChecks)) {
    pv_ = attrs_.pv_quant == "s8" ? PvQuant::kS8 : attrs_.pv_quant == "u8" ? PvQuant::kU8 : PvQuant::kNone;
  }

  void compute(Ort::KernelContext& ctx) override {
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
    if (const char* why = paged_attention_unsupported(p)) fail_unsupported(kOp, "(CUDA) ", why);

    // A step with as many query rows as sequences is almost always decode (one row each): try
    // the decode kernel on cu_seqlens_q (it reads each count on the device), and only if some
    // count is not 1 (a status bit) run the general kernel as well. Real models pass
    // cu_seqlens_q on every step, so this is how their decode steps reach the decode kernel.
    PagedAttentionParams pd = p;
    pd.max_q_len = 1;
    pd.decode_with_cu = true;
    const bool try_decode = cu.present && T == S && paged_attention_decode_kernel_applies(pd);

    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    size_t ws = paged_attention_workspace_bytes(p);
    if (try_decode) ws = std::max(ws, paged_attention_workspace_bytes(pd));
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    StatusPool::Lease word(status_words_, status_words_.take(device));
    cuda_util::OrtCudaScratch scratch(kOp, ctx, std::max<size_t>(ws, 16));
    p.workspace = pd.workspace = ws ? scratch.get() : nullptr;
    p.status = pd.status = word->dev;
    volatile int* status_word = word->host;
    int status = 0;
    auto run = [&](const PagedAttentionParams& launch) {
      *status_word = 0;  // no kernel writes this word now: every Run that had it synchronized
      const cudaError_t launched = launch_paged_attention_int8(launch, stream);
      // Synchronized also after a failed launch (an earlier kernel of it may be queued), so that the
      // word goes back to the pool with nothing in flight.
      const cudaError_t synced = cudaStreamSynchronize(stream);
      check_cuda(launched, "kernel launch");
      check_cuda(synced, "stream synchronize");
      status = *status_word;
    };
    run(try_decode ? pd : p);
    if (try_decode && (status & kPaNotOneQueryEach)) run(p);
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
  pa::Attrs attrs_;
  PvQuant pv_ = PvQuant::kS8;
  StatusPool status_words_;
};

}  // namespace

const CustomOp& paged_attention_int8_cuda_op() {
  static const CustomOp op(paged_attention_int8::signature(), kCudaEp, make_kernel<PagedAttentionInt8Cuda>);
  return op;
}

}  // namespace ort_ops
