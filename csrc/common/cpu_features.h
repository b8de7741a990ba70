// SPDX-License-Identifier: MIT
// Run-time CPU feature detection (CPUID and the OS's XSAVE state in XCR0) and the ISA choice.
// ORT_OPS_CPU_ISA=scalar|avx2|avxvnni|avx512vnni caps the choice; it is read each time a kernel
// is created, so tests can exercise every variant in one process.
#pragma once

#include <string>

namespace ort_ops {

enum class CpuIsa : int { kScalar = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3 };

struct CpuFeatures {
  bool avx2 = false;      // with FMA, F16C and OS support for YMM state
  bool avx_vnni = false;  // VEX-encoded VPDPBUSD (Alder Lake, Zen 5)
  bool avx512_vnni = false;  // AVX-512 F/BW/VL/VNNI with OS support for ZMM state
};

const CpuFeatures& cpu_features();
CpuIsa best_isa();
// best_isa() capped by ORT_OPS_CPU_ISA; throws OpError naming `op` for an unknown value.
CpuIsa selected_isa(const char* op);
const char* isa_name(CpuIsa isa);

}  // namespace ort_ops
