// SPDX-License-Identifier: MIT
// The adapter between ORT's OrtCustomOp and our kernels. An op declares an OpSpec (name,
// execution provider, input/output dtypes and which are optional) and a factory; kernels throw
// OpError and the adapter hands ORT a status, so no exception ever crosses the C boundary.
//
// Input dtypes: the float activation inputs are declared UNDEFINED (any type) so that the
// kernel, not ORT's type checker, reports a wrong dtype with the message format of STYLE.md.
// ORT infers a dynamically typed output only from a single dynamically typed input, so an op
// with a float output whose type follows its input has exactly one dynamic input, or (when
// several float inputs share one dtype) an infer_outputs function that sets the output's type.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/domain.h"
#include "common/status.h"
#include "onnxruntime_cxx_api.h"

namespace ort_ops {

struct IoSpec {
  ONNXTensorElementDataType type;  // UNDEFINED: any type, checked by the kernel
  bool optional = false;
};

// ORT's OrtCustomOp::InferOutputShapeFn: sets output types and shapes at graph resolution.
using InferOutputsFn = OrtStatusPtr(ORT_API_CALL*)(const OrtCustomOp* op, OrtShapeInferContext* ctx);

struct OpSpec {
  const char* name;
  const char* execution_provider;  // kCpuEp or kCudaEp
  std::vector<IoSpec> inputs;
  std::vector<IoSpec> outputs;
  InferOutputsFn infer_outputs = nullptr;
};

inline constexpr const char* kCpuEp = "CPUExecutionProvider";
inline constexpr const char* kCudaEp = "CUDAExecutionProvider";

// What an op takes and gives, whatever the execution provider: declared once per op (in
// ops/<op>/validate.cc, beside the input checks both devices share) and registered for each
// provider with that provider's kernel, so the CPU and CUDA registrations cannot drift.
struct OpSignature {
  const char* name;
  std::vector<IoSpec> inputs;
  std::vector<IoSpec> outputs;
  InferOutputsFn infer_outputs = nullptr;  // nullptr: ORT's own type inference (see above)
};

class KernelImpl {
 public:
  virtual ~KernelImpl() = default;
  virtual void compute(Ort::KernelContext& ctx) = 0;
};

using KernelFactory = std::unique_ptr<KernelImpl> (*)(const OrtKernelInfo* info);

template <class Kernel>
std::unique_ptr<KernelImpl> make_kernel(const OrtKernelInfo* info) {
  return std::make_unique<Kernel>(info);
}

struct KernelAdapter {
  std::unique_ptr<KernelImpl> impl;
  const char* op_name;
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
};

class CustomOp : public Ort::CustomOpBase<CustomOp, KernelAdapter, /*WithStatus=*/true> {
 public:
  CustomOp(const OpSignature& sig, const char* execution_provider, KernelFactory factory)
      : CustomOp(OpSpec{sig.name, execution_provider, sig.inputs, sig.outputs, sig.infer_outputs}, factory) {}
  CustomOp(OpSpec spec, KernelFactory factory) : spec_(std::move(spec)), factory_(factory) {
    // CustomOpBase stamps the headers' ORT_API_VERSION (21); an older runtime refuses a custom op
    // newer than itself. We use no OrtCustomOp field past version kMinOrtApiVersion.
    OrtCustomOp::version = kMinOrtApiVersion;
    OrtCustomOp::InferOutputShapeFn = spec_.infer_outputs;
  }

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return spec_.name; }
  const char* GetExecutionProviderType() const { return spec_.execution_provider; }
  size_t GetInputTypeCount() const { return spec_.inputs.size(); }
  ONNXTensorElementDataType GetInputType(size_t i) const { return spec_.inputs[i].type; }
  size_t GetOutputTypeCount() const { return spec_.outputs.size(); }
  ONNXTensorElementDataType GetOutputType(size_t i) const { return spec_.outputs[i].type; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return spec_.inputs[i].optional ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return spec_.outputs[i].optional ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }

 private:
  OpSpec spec_;
  KernelFactory factory_;
};

// Attribute readers: the default when the attribute is absent.
int64_t attr_int(const OrtKernelInfo* info, const char* name, int64_t default_value);
float attr_float(const OrtKernelInfo* info, const char* name, float default_value);
std::string attr_string(const OrtKernelInfo* info, const char* name, const std::string& default_value);
bool has_attr(const OrtKernelInfo* info, const char* name);

}  // namespace ort_ops
