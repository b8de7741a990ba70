// SPDX-License-Identifier: MIT
// One error style for every op: kernels throw OpError; the adapter in op_base.h turns it into an
// OrtStatus whose message names the op, the input and what was expected.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "onnxruntime_c_api.h"

namespace ort_ops {

class OpError : public std::runtime_error {
 public:
  OpError(OrtErrorCode code, std::string msg) : std::runtime_error(std::move(msg)), code_(code) {}
  OrtErrorCode code() const { return code_; }

 private:
  OrtErrorCode code_;
};

template <class... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

// Bad input: "<op>: <message>".
template <class... Args>
[[noreturn]] void fail_invalid(const char* op, Args&&... args) {
  throw OpError(ORT_INVALID_ARGUMENT, str_cat(op, ": ", std::forward<Args>(args)...));
}

// Valid but unsupported configuration (a head_dim we have no kernel for, ...).
template <class... Args>
[[noreturn]] void fail_unsupported(const char* op, Args&&... args) {
  throw OpError(ORT_NOT_IMPLEMENTED, str_cat(op, ": ", std::forward<Args>(args)...));
}

#define ORT_OPS_ENFORCE(cond, op, ...)                   \
  do {                                                   \
    if (!(cond)) ::ort_ops::fail_invalid(op, __VA_ARGS__); \
  } while (0)

}  // namespace ort_ops
