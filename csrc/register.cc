// SPDX-License-Identifier: MIT
// The library's two exported C functions: RegisterCustomOps (ORT calls it from
// SessionOptions.register_custom_ops_library) and ort_ops_build_info (read by ort_ops._lib).
// A new op adds one line to all_ops().
#include <mutex>
#include <string>
#include <vector>

#include "common/cpu_features.h"
#include "common/domain.h"
#include "common/op_base.h"
#include "ops/dynamic_quant/op.h"
#include "ops/paged_attention_int8/op.h"
#include "ops/quantize_kv_cache/op.h"
#include "ops/rotary_quantize_kv_cache/op.h"
#include "ops/grouped_matmul_dequant/op.h"
#include "ops/grouped_matmul_swiglu_quant/op.h"
#include "ops/moe_finalize_routing/op.h"
#include "ops/moe_init_routing/op.h"
#include "ops/swiglu/op.h"

#ifdef ORT_OPS_WITH_CUDA
#include "cuda/cuda_info.h"
#include "cuda/device_status.h"
#include "ops/dynamic_quant/cuda_op.h"
#include "ops/grouped_matmul_dequant/cuda_op.h"
#include "ops/grouped_matmul_swiglu_quant/cuda_op.h"
#include "ops/moe_finalize_routing/cuda_op.h"
#include "ops/moe_init_routing/cuda_op.h"
#include "ops/paged_attention_int8/cuda_op.h"
#include "ops/quantize_kv_cache/cuda_op.h"
#include "ops/rotary_quantize_kv_cache/cuda_op.h"
#include "ops/swiglu/cuda_op.h"
#endif

#ifndef ORT_OPS_VERSION
#define ORT_OPS_VERSION "0.0.0"
#endif
#ifndef ORT_OPS_CUDA_ARCHS
#define ORT_OPS_CUDA_ARCHS ""
#endif

#if defined(_WIN32)
#define ORT_OPS_EXPORT extern "C" __declspec(dllexport)
#else
#define ORT_OPS_EXPORT extern "C" __attribute__((visibility("default")))
#endif

namespace ort_ops {
namespace {

std::vector<const CustomOp*> all_ops() {
  return {
      &dynamic_quant_cpu_op(),
      &paged_attention_int8_cpu_op(),
      &quantize_kv_cache_cpu_op(),
      &rotary_quantize_kv_cache_cpu_op(),
      &grouped_matmul_swiglu_quant_cpu_op(),
      &grouped_matmul_dequant_cpu_op(),
      &moe_init_routing_cpu_op(),
      &moe_finalize_routing_cpu_op(),
      &swiglu_cpu_op(),
#ifdef ORT_OPS_WITH_CUDA
      &dynamic_quant_cuda_op(),
      &grouped_matmul_swiglu_quant_cuda_op(),
      &paged_attention_int8_cuda_op(),
      &quantize_kv_cache_cuda_op(),
      &rotary_quantize_kv_cache_cuda_op(),
      &grouped_matmul_dequant_cuda_op(),
      &moe_init_routing_cuda_op(),
      &moe_finalize_routing_cuda_op(),
      &swiglu_cuda_op(),
#endif
  };
}

}  // namespace
}  // namespace ort_ops

ORT_OPS_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                         const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ort_ops::kMinOrtApiVersion);
  if (api == nullptr) {
    // Too old a runtime: report with the oldest API every ORT has.
    const OrtApi* v1 = api_base->GetApi(1);
    std::string msg = std::string("ort_ops: needs ONNX Runtime C API version ") +
                      std::to_string(ort_ops::kMinOrtApiVersion) + " (ORT 1." +
                      std::to_string(ort_ops::kMinOrtApiVersion) + ") or newer, this runtime is " +
                      api_base->GetVersionString();
    return v1 ? v1->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  Ort::InitApi(api);
  static std::mutex mu;
  static std::vector<Ort::CustomOpDomain> domains;  // must outlive every session using it
  std::lock_guard<std::mutex> lock(mu);
  try {
    if (domains.empty()) {
      Ort::CustomOpDomain domain(ort_ops::kDomain);
      for (const ort_ops::CustomOp* op : ort_ops::all_ops()) domain.Add(op);
      domains.push_back(std::move(domain));
    }
    Ort::UnownedSessionOptions(options).Add(domains.front());
  } catch (const Ort::Exception& e) {
    return api->CreateStatus(e.GetOrtErrorCode(), e.what());
  }
  return nullptr;
}

// The CPU kernel variant a session created now would use: ORT_OPS_CPU_ISA is read each call.
ORT_OPS_EXPORT const char* ort_ops_selected_cpu_isa() {
  try {
    return ort_ops::isa_name(ort_ops::selected_isa("ort_ops"));
  } catch (const std::exception&) {
    return "invalid ORT_OPS_CPU_ISA";
  }
}

ORT_OPS_EXPORT const char* ort_ops_build_info() {
  static const std::string info = [] {
    using namespace ort_ops;
    const auto& f = cpu_features();
    std::string s = "{";
    s += "\"version\": \"" ORT_OPS_VERSION "\"";
    s += ", \"ort_api_version\": " + std::to_string(kMinOrtApiVersion);
    s += ", \"min_ort_version\": \"1." + std::to_string(kMinOrtApiVersion) + "\"";
    s += ", \"headers_ort_api_version\": " + std::to_string(ORT_API_VERSION);
#ifdef ORT_OPS_WITH_CUDA
    s += ", \"cuda\": true, \"cuda_archs\": \"" ORT_OPS_CUDA_ARCHS "\"";
    s += ", \"cuda_runtime\": \"" + ort_ops::cuda_runtime_summary() + "\"";
#else
    s += ", \"cuda\": false, \"cuda_archs\": \"\"";
#endif
    s += std::string(", \"cpu_isa\": {\"avx2\": ") + (f.avx2 ? "true" : "false") +
         ", \"avxvnni\": " + (f.avx_vnni ? "true" : "false") +
         ", \"avx512vnni\": " + (f.avx512_vnni ? "true" : "false") + "}";
    s += std::string(", \"best_cpu_isa\": \"") + isa_name(best_isa()) + "\"";
    s += "}";
    return s;
  }();
  return info.c_str();
}

// Takes the errors that CUDA ops' kernels found in input values on the device since the last
// call (cuda/device_status.h): writes the first message into buf, returns how many ops had one.
// 0 in a build without CUDA.
ORT_OPS_EXPORT int ort_ops_take_device_error(char* buf, size_t len) {
#ifdef ORT_OPS_WITH_CUDA
  return ort_ops::cuda_util::take_device_error(buf, len);
#else
  if (buf != nullptr && len > 0) buf[0] = '\0';
  return 0;
#endif
}
