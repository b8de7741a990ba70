// SPDX-License-Identifier: MIT
// The custom-op domain and opset version; mirrors ort_ops/_domain.py.
#pragma once

namespace ort_ops {
inline constexpr const char* kDomain = "ort_ops";
inline constexpr int kOpsetVersion = 1;
// The ORT C API version the library asks for in RegisterCustomOps. 18 (ORT 1.18) is the oldest
// that has every entry point we call (KernelContext_ParallelFor, GetScratchBuffer, ...).
inline constexpr unsigned kMinOrtApiVersion = 18;
}  // namespace ort_ops
