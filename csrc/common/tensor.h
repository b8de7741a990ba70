// SPDX-License-Identifier: MIT
// Thin views of kernel inputs/outputs with the validation helpers every op.cc uses.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "common/status.h"
#include "onnxruntime_cxx_api.h"

namespace ort_ops {

const char* dtype_name(ONNXTensorElementDataType t);
size_t dtype_size(ONNXTensorElementDataType t);  // bytes per element (1 for types the ops never take)
std::string shape_str(const std::vector<int64_t>& shape);

// One input as the kernel sees it. `present` is false for an absent optional input.
struct InputView {
  bool present = false;
  ONNXTensorElementDataType dtype = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  int64_t numel = 0;

  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  int64_t dim(int64_t i) const { return shape[i < 0 ? i + rank() : i]; }
  template <class T>
  const T* ptr() const { return static_cast<const T*>(data); }
};

// Reads input `index` (absent or empty-named optional inputs give present == false).
InputView read_input(const Ort::KernelContext& ctx, size_t index);

// Validation helpers: each throws OpError "<op>: input '<name>' must ..., got ...". require_dtype
// also refuses a buffer that is not aligned to its element size.
void require_present(const char* op, const char* name, const InputView& t);
void require_dtype(const char* op, const char* name, const InputView& t,
                   std::initializer_list<ONNXTensorElementDataType> allowed);
void require_rank(const char* op, const char* name, const InputView& t, int64_t rank);
void require_shape(const char* op, const char* name, const InputView& t,
                   const std::vector<int64_t>& expected);

// Output `index` with `shape`; returns its data pointer.
template <class T>
T* make_output(Ort::KernelContext& ctx, size_t index, const std::vector<int64_t>& shape) {
  auto v = ctx.GetOutput(index, shape.data(), shape.size());
  return v.GetTensorMutableData<T>();
}

inline void* make_output_raw(Ort::KernelContext& ctx, size_t index,
                             const std::vector<int64_t>& shape) {
  auto v = ctx.GetOutput(index, shape.data(), shape.size());
  return v.GetTensorMutableRawData();
}

}  // namespace ort_ops
