// SPDX-License-Identifier: MIT
#include "common/tensor.h"

#include <algorithm>
#include <cstdint>

namespace ort_ops {

const char* dtype_name(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "float64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return "int8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16: return "int16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return "bool";
    default: return "other";
  }
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

InputView read_input(const Ort::KernelContext& ctx, size_t index) {
  InputView v;
  if (index >= ctx.GetInputCount()) return v;
  Ort::ConstValue value = ctx.GetInput(index);
  if (!value) return v;  // absent optional input
  auto info = value.GetTensorTypeAndShapeInfo();
  v.present = true;
  v.dtype = info.GetElementType();
  v.shape = info.GetShape();
  v.numel = static_cast<int64_t>(info.GetElementCount());
  v.data = value.GetTensorRawData();
  return v;
}

void require_present(const char* op, const char* name, const InputView& t) {
  if (!t.present) fail_invalid(op, "input '", name, "' is required");
}

size_t dtype_size(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64:
      return 8;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32:
      return 4;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16:
      return 2;
    default:
      return 1;
  }
}

void require_dtype(const char* op, const char* name, const InputView& t,
                   std::initializer_list<ONNXTensorElementDataType> allowed) {
  if (std::find(allowed.begin(), allowed.end(), t.dtype) != allowed.end()) {
    // Kernels read elements through typed pointers (and SIMD code may assume element alignment).
    // ORT passes a buffer bound through IOBinding on as it is, at any address, so a misaligned
    // one is refused here instead of being read with undefined behaviour.
    const size_t size = dtype_size(t.dtype);
    if (t.numel > 0 && reinterpret_cast<uintptr_t>(t.data) % size != 0)
      fail_invalid(op, "input '", name, "' must be aligned to its element size (", size,
                   " bytes), got address ", t.data);
    return;
  }
  std::string expected;
  for (auto a : allowed) expected += std::string(expected.empty() ? "" : " or ") + dtype_name(a);
  fail_invalid(op, "input '", name, "' must be ", expected, ", got ", dtype_name(t.dtype));
}

void require_rank(const char* op, const char* name, const InputView& t, int64_t rank) {
  if (t.rank() != rank)
    fail_invalid(op, "input '", name, "' must have rank ", rank, ", got shape ", shape_str(t.shape));
}

void require_shape(const char* op, const char* name, const InputView& t,
                   const std::vector<int64_t>& expected) {
  if (t.shape != expected)
    fail_invalid(op, "input '", name, "' must have shape ", shape_str(expected), ", got ",
                 shape_str(t.shape));
}

}  // namespace ort_ops
