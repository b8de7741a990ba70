// SPDX-License-Identifier: MIT
// AVX-VNNI PagedAttentionInt8 task (VEX VPDPBUSD, Alder Lake / Sapphire Rapids / Zen 5).
#define ORT_OPS_DPBUSD(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#include "ops/paged_attention_int8/cpu_vnni_kern.h"
#include "ops/paged_attention_int8/cpu_driver.h"

namespace ort_ops::paged_attention_int8 {

void run_task_avxvnni(const Params& p, const Task& t, const Scratch& s) {
  run_task_impl<VnniKern>(p, t, s);
}

}  // namespace ort_ops::paged_attention_int8
