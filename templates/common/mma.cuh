// Warp-level tensor-core helpers (sm_80+ mma.sync m16n8k16, bf16 in, fp32 accumulate) and
// ldmatrix fragment loads from shared memory. Shared tiles are row-major bf16 with a row pitch
// that is a multiple of 8 elements and not of 64 (we pad rows by 8 elements): the eight 16-byte
// rows an ldmatrix reads then fall in different banks.
//
// Fragment layouts (PTX ISA, mma.m16n8k16): lane = 4 * group + tig.
//   A 16x16: a[0] = (group, 2tig..+1), a[1] = (group+8, 2tig..), a[2] = (group, 2tig+8..), a[3] = (group+8, 2tig+8..)
//   B 16x8 : b[0] = (k = 2tig..+1, n = group), b[1] = (k = 2tig+8..+9, n = group)
//   C 16x8 : c[0..1] = (group, 2tig..+1), c[2..3] = (group+8, 2tig..+1)
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace kda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A fragment of the 16x16 tile at `tile` (row-major, pitch `ld` elements).
__device__ __forceinline__ void ldsm_a(uint32_t (&a)[4], const __nv_bfloat16* tile, int ld) {
  const int lane = threadIdx.x & 31;
  const __nv_bfloat16* p = tile + (lane & 15) * ld + (lane >> 4) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(smem_addr(p)));
}

// A fragment of the 16x16 tile whose TRANSPOSE is stored at `tile`: A[m][k] = tile[k][m].
__device__ __forceinline__ void ldsm_a_trans(uint32_t (&a)[4], const __nv_bfloat16* tile, int ld) {
  const int lane = threadIdx.x & 31;
  // matrices: (m0-7,k0-7) (m8-15,k0-7) (m0-7,k8-15) (m8-15,k8-15); stored rows are k.
  const int k = (lane & 7) + ((lane >> 4) << 3);
  const int m = ((lane >> 3) & 1) << 3;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(smem_addr(tile + k * ld + m)));
}

// Four 8x8 matrices (ldmatrix .x4, .trans when kTrans) from this lane's row address p: for tiles whose layout
// (a swizzle) ldsm_a's pitch arithmetic does not cover.
template <bool kTrans>
__device__ __forceinline__ void ldsm_x4(uint32_t (&a)[4], const __nv_bfloat16* p) {
  if (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(smem_addr(p)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(smem_addr(p)));
}

// B fragments of two adjacent 16x8 tiles (n0..n0+7 and n0+8..n0+15) of a k x n tile stored
// row-major as [k][n] at `tile` (k = 16 rows): b0 for n 0-7, b1 for n 8-15.
__device__ __forceinline__ void ldsm_b_kn(uint32_t (&b0)[2], uint32_t (&b1)[2], const __nv_bfloat16* tile, int ld) {
  const int lane = threadIdx.x & 31;
  // matrices: (k0-7,n0-7) (k8-15,n0-7) (k0-7,n8-15) (k8-15,n8-15)
  const int k = (lane & 7) + (((lane >> 3) & 1) << 3);
  const int n = (lane >> 4) << 3;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(b0[0]), "=r"(b0[1]), "=r"(b1[0]), "=r"(b1[1]) : "r"(smem_addr(tile + k * ld + n)));
}

// B fragments of two adjacent 16x8 tiles of a k x n tile stored TRANSPOSED as [n][k] at `tile`.
__device__ __forceinline__ void ldsm_b_nk(uint32_t (&b0)[2], uint32_t (&b1)[2], const __nv_bfloat16* tile, int ld) {
  const int lane = threadIdx.x & 31;
  // matrices: (n0-7,k0-7) (n0-7,k8-15) (n8-15,k0-7) (n8-15,k8-15); stored rows are n.
  const int n = (lane & 7) + ((lane >> 4) << 3);
  const int k = ((lane >> 3) & 1) << 3;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(b0[0]), "=r"(b0[1]), "=r"(b1[0]), "=r"(b1[1]) : "r"(smem_addr(tile + n * ld + k)));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// TF32 on the tensor cores, three products per fp32 product (3xTF32): x = hi + lo with hi, lo tf32,
// a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi (the lo lo term, ~2^-22 relative, dropped): ~fp32 accuracy
// where a plain tf32 product keeps 10 mantissa bits.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
  const float rest = x - __uint_as_float(hi);
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(rest));
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c += a b, a 16 x 8 (fragment: (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)), b 8 x 8 ((t, g),
// (t + 4, g)), g = lane / 4, t = lane % 4; in 3xTF32.
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const float (&a)[4], const float (&b)[2]) {
  uint32_t ah[4], al[4], bh[2], bl[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) split_tf32(a[i], ah[i], al[i]);
  split_tf32(b[0], bh[0], bl[0]);
  split_tf32(b[1], bh[1], bl[1]);
  mma_tf32(c, al, bh);
  mma_tf32(c, ah, bl);
  mma_tf32(c, ah, bh);
}

}  // namespace kda
