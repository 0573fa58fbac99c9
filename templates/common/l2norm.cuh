// Device side of the per-head L2 norm: 16 lanes own a row (8 bf16 each, one 16-byte load); each
// half-warp takes `rows_per_group` rows at a time and issues all their loads before the first
// reduction, so that several rows are in flight per half-warp (the kernel is bandwidth-bound).
#pragma once
#include "common/device.cuh"
#include "common/l2norm.h"

namespace kda {

constexpr int kL2NormLanes = kL2NormWidth / 8;  // 16 lanes x 8 bf16 = one row

// Sum over the 16 lanes of a half-warp (both halves of the warp reduce independently). The xor
// butterfly gives every lane the same bits (each step adds the same two values, in either order).
__device__ __forceinline__ float half_warp_sum(float x) {
#pragma unroll
  for (int m = kL2NormLanes / 2; m >= 1; m >>= 1) x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}

// The norm of one row. A row is held by the 16 lanes of a half-warp, lane l owning
// channels 8 l .. 8 l + 7 in f; every lane of the warp must call it (shuffles). Returns the row's
// rstd = 1 / sqrt(sum x^2 + eps): per lane an fma chain over its 8 channels in order, then the
// half-warp butterfly; each operation an _rn intrinsic, so that no unit contracts or reorders it.
__device__ __forceinline__ float l2norm_row_rstd(const float (&f)[8], float eps) {
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) ss = __fmaf_rn(f[j], f[j], ss);
  ss = half_warp_sum(ss);
  return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(ss, eps)));
}

// A normalised element before its bf16 rounding (round to nearest even, pack_bf16): x rstd, one
// rounding in fp32.
__device__ __forceinline__ float l2norm_scaled(float x, float rstd) { return __fmul_rn(x, rstd); }

// Eight bf16 (a 16-byte piece of a row) normalised with their row's rstd: l2norm_scaled, then
// rounded to bf16.
__device__ __forceinline__ uint4 l2norm_scaled_8(uint4 v, float rstd) {
  float f[8];
  unpack_bf16(v.x, f[0], f[1]);
  unpack_bf16(v.y, f[2], f[3]);
  unpack_bf16(v.z, f[4], f[5]);
  unpack_bf16(v.w, f[6], f[7]);
  return make_uint4(pack_bf16(l2norm_scaled(f[0], rstd), l2norm_scaled(f[1], rstd)),
                    pack_bf16(l2norm_scaled(f[2], rstd), l2norm_scaled(f[3], rstd)),
                    pack_bf16(l2norm_scaled(f[4], rstd), l2norm_scaled(f[5], rstd)),
                    pack_bf16(l2norm_scaled(f[6], rstd), l2norm_scaled(f[7], rstd)));
}

// CTAs for `rows` rows: one row group per half-warp, capped (the kernels grid-stride beyond it).
inline unsigned l2norm_grid(int64_t rows, int half_warps_per_cta, int rows_per_group) {
  constexpr int64_t kMaxCtas = 1 << 20;
  const int64_t groups = (rows + rows_per_group - 1) / rows_per_group;
  const int64_t ctas = (groups + half_warps_per_cta - 1) / half_warps_per_cta;
  return static_cast<unsigned>(ctas < 1 ? 1 : (ctas > kMaxCtas ? kMaxCtas : ctas));
}

}  // namespace kda
