// SPDX-License-Identifier: MIT
// Helpers for CUDA-EP ops (cuda_op.cc files): CUDA error -> OpError naming the op, and device
// scratch from ORT's CUDA allocator (no cudaMalloc in Compute).
#pragma once

#include <cuda_runtime.h>

#include "common/status.h"
#include "onnxruntime_cxx_api.h"

namespace ort_ops::cuda_util {

inline void check_cuda(const char* op, cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw OpError(ORT_EP_FAIL, str_cat(op, " (CUDA): ", what, " failed: ", cudaGetErrorName(err),
                                       " (", cudaGetErrorString(err), ")"));
}

// Device scratch from ORT's CUDA allocator, freed when the op returns (after the sync).
class OrtCudaScratch {
 public:
  OrtCudaScratch(const char* op, Ort::KernelContext& ctx, size_t bytes) {
    int device = 0;
    check_cuda(op, cudaGetDevice(&device), "cudaGetDevice");
    Ort::MemoryInfo info("Cuda", OrtDeviceAllocator, device, OrtMemTypeDefault);
    alloc_ = ctx.GetAllocator(*static_cast<const OrtMemoryInfo*>(info));
    if (alloc_ == nullptr) fail_unsupported(op, "no CUDA allocator in this session");
    ptr_ = alloc_->Alloc(alloc_, bytes);
    if (ptr_ == nullptr)
      throw OpError(ORT_FAIL, str_cat(op, ": could not allocate ", bytes, " bytes of scratch"));
  }
  ~OrtCudaScratch() {
    if (ptr_) alloc_->Free(alloc_, ptr_);
  }
  OrtCudaScratch(const OrtCudaScratch&) = delete;
  OrtCudaScratch& operator=(const OrtCudaScratch&) = delete;
  char* get() const { return static_cast<char*>(ptr_); }

 private:
  OrtAllocator* alloc_ = nullptr;
  void* ptr_ = nullptr;
};

}  // namespace ort_ops::cuda_util
