// SPDX-License-Identifier: MIT
// AVX2 PagedAttentionInt8 task: the shared driver over Avx2Kern. Only this file (and the VNNI
// ones) get the ISA flags.
#include "ops/paged_attention_int8/cpu_avx2_kern.h"
#include "ops/paged_attention_int8/cpu_driver.h"

namespace ort_ops::paged_attention_int8 {

void run_task_avx2(const Params& p, const Task& t, const Scratch& s) {
  run_task_impl<Avx2Kern>(p, t, s);
}

}  // namespace ort_ops::paged_attention_int8
