// Device side of the per-head L2 norm: 16 lanes own a row (8 bf16 each, one 16-byte load); each
// half-warp takes `rows_per_group` rows at a time and issues all their loads before the first
// reduction, so that several rows are in flight per half-warp (the kernel is bandwidth-bound).
#pragma once
#include "common/device.cuh"
#include "common/l2norm.h"

namespace kda {

constexpr int kL2NormLanes = kL2NormWidth / 8;  // 16 lanes x 8 bf16 = one row

// Sum over the 16 lanes of a half-warp (both halves of the warp reduce independently).
__device__ __forceinline__ float half_warp_sum(float x) {
#pragma unroll
  for (int m = kL2NormLanes / 2; m >= 1; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// CTAs for `rows` rows: one row group per half-warp, capped (the kernels grid-stride beyond it).
inline unsigned l2norm_grid(int64_t rows, int half_warps_per_cta, int rows_per_group) {
  constexpr int64_t kMaxCtas = 1 << 20;
  const int64_t groups = (rows + rows_per_group - 1) / rows_per_group;
  const int64_t ctas = (groups + half_warps_per_cta - 1) / half_warps_per_cta;
  return static_cast<unsigned>(ctas < 1 ? 1 : (ctas > kMaxCtas ? kMaxCtas : ctas));
}

}  // namespace kda
