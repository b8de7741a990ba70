// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant CUDA kernels: the mma.sync-side device helpers shared by the tiled
// kernel (cuda.cu) and the decode stream kernel (cuda_stream.cu): 16-byte cp.async, ldmatrix,
// the m16n8k32 s8 MMA and the 4x4 byte transpose that turns four k rows of the contract's
// [K, N] weight into B registers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ptx.cuh"

namespace ort_ops::gmsq_cuda::mma {

// cp.async, ldmatrix and the MMA: csrc/cuda/ptx.cuh.
using ptx::cp_async16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x4;
using ptx::lds32;
using ptx::smem_addr;

__device__ __forceinline__ void mma_s8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  ptx::mma_i8<false>(d, a[0], a[1], a[2], a[3], b0, b1);
}

// 4x4 byte transpose: w[r] holds bytes (k = r, columns 0..3); out[i] holds (k = 0..3, column i),
// k ascending from the low byte, which is the order the MMA's B register wants.
__device__ __forceinline__ void transpose4x4(const uint32_t (&w)[4], uint32_t& o0, uint32_t& o1,
                                             uint32_t& o2, uint32_t& o3) {
  const uint32_t x0 = __byte_perm(w[0], w[1], 0x5140);  // w0.b0 w1.b0 w0.b1 w1.b1
  const uint32_t x1 = __byte_perm(w[0], w[1], 0x7362);  // w0.b2 w1.b2 w0.b3 w1.b3
  const uint32_t y0 = __byte_perm(w[2], w[3], 0x5140);
  const uint32_t y1 = __byte_perm(w[2], w[3], 0x7362);
  o0 = __byte_perm(x0, y0, 0x5410);
  o1 = __byte_perm(x0, y0, 0x7632);
  o2 = __byte_perm(x1, y1, 0x5410);
  o3 = __byte_perm(x1, y1, 0x7632);
}

// B registers of one k32 step kb (0 or 1 of a 64-deep stage) for the 8 n8 tiles of a warp's
// two 32-column quads q, from a [64 k][row_bytes] shared tile whose 16-byte chunks are swizzled
// (chunk ^ 2t on k rows 4t..4t+3): lane_off[q] is the lane's byte offset of quad q at k row 4t.
// b[4q + i] is n8 tile i of quad q, whose column g is physical column 4g + i of the quad.
__device__ __forceinline__ void load_b_transposed(uint32_t bs_addr, const uint32_t (&lane_off)[2],
                                                  int kb, int row_bytes, uint32_t (&b)[8][2]) {
#pragma unroll
  for (int q = 0; q < 2; ++q)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t w[4];
#pragma unroll
      for (int r = 0; r < 4; ++r)
        w[r] = lds32(bs_addr + lane_off[q] + (kb * 32 + h * 16 + r) * row_bytes);
      transpose4x4(w, b[q * 4 + 0][h], b[q * 4 + 1][h], b[q * 4 + 2][h], b[q * 4 + 3][h]);
    }
}

}  // namespace ort_ops::gmsq_cuda::mma
