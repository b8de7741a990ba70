// SPDX-License-Identifier: MIT
// AVX-512 VNNI PagedAttentionInt8 task: EVEX VPDPBUSD on 256-bit vectors (AVX512VL), for
// CPUs with AVX-512 VNNI but no AVX-VNNI (Cascade Lake, Ice Lake). A 32-token W group is one
// 256-bit operand, so wider vectors would only pair two output dims.
#define ORT_OPS_DPBUSD(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
#include "ops/paged_attention_int8/cpu_vnni_kern.h"
#include "ops/paged_attention_int8/cpu_driver.h"

namespace ort_ops::paged_attention_int8 {

void run_task_avx512vnni(const Params& p, const Task& t, const Scratch& s) {
  run_task_impl<VnniKern>(p, t, s);
}

}  // namespace ort_ops::paged_attention_int8
