// SPDX-License-Identifier: MIT
#include "common/cpu_features.h"

#include <cstdlib>
#include <cstring>

#include "common/status.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define ORT_OPS_X86 1
#endif

namespace ort_ops {

namespace {

#ifdef ORT_OPS_X86
unsigned long long xgetbv0() {
  unsigned eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#ifdef ORT_OPS_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  const bool fma = c & (1u << 12);
  const bool f16c = c & (1u << 29);
  const bool avx = c & (1u << 28);
  if (!osxsave || !avx) return f;
  const unsigned long long xcr0 = xgetbv0();
  const bool ymm_os = (xcr0 & 0x6) == 0x6;
  const bool zmm_os = (xcr0 & 0xE6) == 0xE6;
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = b & (1u << 5);
  const bool avx512f = b & (1u << 16);
  const bool avx512bw = b & (1u << 30);
  const bool avx512vl = b & (1u << 31);
  const bool avx512vnni = c & (1u << 11);
  __cpuid_count(7, 1, a, b, c, d);
  const bool avxvnni = a & (1u << 4);
  f.avx2 = avx2 && fma && f16c && ymm_os;
  f.avx_vnni = f.avx2 && avxvnni;
  f.avx512_vnni = f.avx2 && zmm_os && avx512f && avx512bw && avx512vl && avx512vnni;
#endif
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

CpuIsa best_isa() {
  const auto& f = cpu_features();
  if (f.avx512_vnni) return CpuIsa::kAvx512Vnni;
  if (f.avx_vnni) return CpuIsa::kAvxVnni;
  if (f.avx2) return CpuIsa::kAvx2;
  return CpuIsa::kScalar;
}

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvxVnni: return "avxvnni";
    case CpuIsa::kAvx512Vnni: return "avx512vnni";
  }
  return "scalar";
}

CpuIsa selected_isa(const char* op) {
  CpuIsa best = best_isa();
  const char* env = std::getenv("ORT_OPS_CPU_ISA");
  if (env == nullptr || *env == '\0') return best;
  for (CpuIsa cap : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvxVnni, CpuIsa::kAvx512Vnni}) {
    if (std::strcmp(env, isa_name(cap)) == 0) {
      // Capped: the fastest path that is both requested (or below) and supported. The VNNI
      // paths sit above AVX2: a machine with AVX-512 VNNI but no AVX-VNNI uses AVX2 under an
      // avxvnni cap.
      if (static_cast<int>(best) <= static_cast<int>(cap)) return best;
      if (cap == CpuIsa::kAvxVnni && best == CpuIsa::kAvx512Vnni)
        return cpu_features().avx_vnni ? CpuIsa::kAvxVnni : CpuIsa::kAvx2;
      return cap;
    }
  }
  fail_invalid(op, "environment variable ORT_OPS_CPU_ISA must be one of scalar, avx2, avxvnni, "
               "avx512vnni, got '", env, "'");
}

}  // namespace ort_ops
