// SPDX-License-Identifier: MIT
// Where a CUDA op's kernels report bad input values that only the device sees (block ids,
// seq_lens, slots, group_list, expert ids, NaN/Inf), without the host ever waiting for the GPU.
//
// Each op instance (one node of a session) owns one status word per device: an int in pinned
// host memory mapped into the device (cudaHostAllocMapped). Its kernels atomically OR bits into
// it, and only on bad input; nothing clears it on the device, so nothing is written per Run (no
// memset node, no copy, no stream synchronization) and a CUDA graph replay reports through the
// same word. The host takes (reads and clears) the word:
//   - at the start of the op instance's next Compute, which then fails with the op's named error
//     (so an error is never lost: at the latest, the next Run of that node reports it);
//   - or earlier, when the caller asks: ort_ops_take_device_error() (ort_ops.check_device_errors()
//     in Python) takes every instance's word after a Run has returned. ORT synchronizes the
//     stream at the end of a Run, so by then every kernel of that Run has written its bits.
// The outputs of a Run whose kernels set a bit are not the op's result (the kernels never read
// or write out of bounds; what each leaves unwritten is said at its status bits).
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace ort_ops::cuda_util {

class DeviceStatus {
 public:
  // describe(bits) turns a non-zero word into the op's error message ("<op>: input '...' ...").
  explicit DeviceStatus(std::function<std::string(int)> describe);
  ~DeviceStatus();
  DeviceStatus(const DeviceStatus&) = delete;
  DeviceStatus& operator=(const DeviceStatus&) = delete;

  // The device address of this instance's word on the current device (allocated on first use;
  // call outside CUDA-graph capture first, as ORT's warm-up Run does). Throws OpError naming
  // `op` when pinned memory cannot be had.
  int* word(const char* op);

  // Throws the op's error (OpError, ORT_INVALID_ARGUMENT) if a kernel of an earlier Run set a bit;
  // the word is cleared first, so the next good Run succeeds.
  void raise_pending();

  // Takes the bits of every device's word (0 when none) and clears them.
  int take();
  std::string describe(int bits) const { return describe_(bits); }

 private:
  struct Word {
    int device;
    int* host;
    int* dev;
  };
  std::function<std::string(int)> describe_;
  std::mutex mu_;
  std::vector<Word> words_;
};

}  // namespace ort_ops::cuda_util

namespace ort_ops::cuda_util {
// Takes the pending device-side error of every live CUDA op instance. Writes the first message
// (NUL-terminated, truncated to `len`) and returns how many instances had one (0: none).
// Exported as ort_ops_take_device_error (register.cc).
int take_device_error(char* buf, size_t len);
}  // namespace ort_ops::cuda_util
