// SPDX-License-Identifier: MIT
// The one definition of ORT_OPS_CUDA_EXPORT: the plain C entry points over the CUDA launchers
// (raw device pointers + stream) that tests and benchmarks drive through ctypes. The library is
// built with hidden visibility, so only what is marked here (and register.cc's entry points)
// is exported.
#pragma once

#ifdef _WIN32
#define ORT_OPS_CUDA_EXPORT extern "C" __declspec(dllexport)
#else
#define ORT_OPS_CUDA_EXPORT extern "C" __attribute__((visibility("default")))
#endif
