// SPDX-License-Identifier: MIT
// Work splitting over ORT's intra-op thread pool (KernelContext_ParallelFor). Exceptions thrown
// by a task are caught on the worker and the first one is rethrown on the calling thread.
#pragma once

#include <cstddef>
#include <exception>
#include <mutex>

#include "onnxruntime_cxx_api.h"

namespace ort_ops {

template <class F>
void parallel_for(const Ort::KernelContext& ctx, size_t total, F&& fn) {
  if (total == 0) return;
  if (total == 1) {
    fn(size_t{0});
    return;
  }
  struct Shared {
    F* fn;
    std::exception_ptr error;
    std::mutex mu;
  } shared{&fn, nullptr, {}};
  auto trampoline = [](void* data, size_t i) {
    auto* s = static_cast<Shared*>(data);
    try {
      (*s->fn)(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(s->mu);
      if (!s->error) s->error = std::current_exception();
    }
  };
  ctx.ParallelFor(trampoline, total, 0, &shared);
  if (shared.error) std::rethrow_exception(shared.error);
}

}  // namespace ort_ops
