// SPDX-License-Identifier: MIT
// Status words of the CUDA ops (device_status.h): pinned host memory mapped into the device,
// a registry of the live instances so that one call can take every pending error.
#include "cuda/device_status.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "common/status.h"

namespace ort_ops::cuda_util {
namespace {

std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}
std::vector<DeviceStatus*>& registry() {
  static std::vector<DeviceStatus*> live;
  return live;
}

// Reads and clears a word the device may OR into concurrently: an atomic exchange, so a bit
// set between the read and the clear is never lost.
int exchange_zero(int* host) { return __atomic_exchange_n(host, 0, __ATOMIC_SEQ_CST); }

}  // namespace

DeviceStatus::DeviceStatus(std::function<std::string(int)> describe) : describe_(std::move(describe)) {
  std::lock_guard<std::mutex> lock(registry_mu());
  registry().push_back(this);
}

DeviceStatus::~DeviceStatus() {
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto& live = registry();
    live.erase(std::remove(live.begin(), live.end(), this), live.end());
  }
  // A session is destroyed after its Runs returned (ORT synchronized them), so no kernel writes.
  for (const Word& w : words_) cudaFreeHost(w.host);
}

int* DeviceStatus::word(const char* op) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess)
    throw OpError(ORT_EP_FAIL, str_cat(op, " (CUDA): cudaGetDevice failed: ", cudaGetErrorName(err)));
  std::lock_guard<std::mutex> lock(mu_);
  for (const Word& w : words_)
    if (w.device == device) return w.dev;
  Word w{device, nullptr, nullptr};
  err = cudaHostAlloc(reinterpret_cast<void**>(&w.host), sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable);
  if (err == cudaSuccess) {
    *w.host = 0;
    err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&w.dev), w.host, 0);
    if (err != cudaSuccess) cudaFreeHost(w.host);
  }
  if (err != cudaSuccess)
    throw OpError(ORT_EP_FAIL, str_cat(op, " (CUDA): could not allocate its mapped status word: ",
                                       cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
  words_.push_back(w);
  return w.dev;
}

int DeviceStatus::take() {
  std::lock_guard<std::mutex> lock(mu_);
  int bits = 0;
  for (const Word& w : words_) bits |= exchange_zero(w.host);
  return bits;
}

void DeviceStatus::raise_pending() {
  // A plain read first: the common case (no error) costs one load of host memory.
  bool any = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Word& w : words_) any = any || __atomic_load_n(w.host, __ATOMIC_ACQUIRE) != 0;
  }
  if (!any) return;
  const int bits = take();
  if (bits) throw OpError(ORT_INVALID_ARGUMENT, describe_(bits) + " (found on the device in an earlier Run)");
}

int take_device_error(char* buf, size_t len) {
  std::lock_guard<std::mutex> lock(registry_mu());
  int count = 0;
  std::string first;
  for (DeviceStatus* s : registry()) {
    const int bits = s->take();
    if (bits == 0) continue;
    if (count++ == 0) first = s->describe(bits);
  }
  if (buf != nullptr && len > 0) {
    const size_t n = std::min(first.size(), len - 1);
    std::memcpy(buf, first.data(), n);
    buf[n] = '\0';
  }
  return count;
}

}  // namespace ort_ops::cuda_util
