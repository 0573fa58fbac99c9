// Warpgroup tensor-core helpers (sm_90a wgmma): D[64 x N] += A[64 x 16] B[16 x N], bf16 in, fp32
// accumulate, A from registers, B from shared memory through a matrix descriptor.
//
// Why: a warpgroup reads its B tile from shared memory once for all of its 64 rows, where eight
// mma.sync warps (16 rows each) read it once per warp, and one instruction replaces a warp's eight
// mma.sync and their ldmatrix (the walks' step is bound by its memory instructions, not by these
// reads: docs/forward.md).
//
// Register layouts (PTX ISA, wgmma .m64nNk16): warp w of the warpgroup owns rows 16 w .. 16 w + 15;
// its A fragment is that of mma.m16n8k16 (kda::ldsm_a), its accumulator d[j][0..3] that of the
// mma C tile j (rows g, g + 8; columns 8 j + 2 t, + 1).
//
// B layout (no swizzle, "MN-major": the n index contiguous): 8 x 8 core matrices of 128 contiguous
// bytes (8 k-rows of 16 bytes), the core matrices of one 8-row k-group side by side along n.
// A thread storing a bf16 pair (k, n..n+1) from an accumulator fragment hits 32 different banks
// per warp.
#pragma once
#include <cstdint>

#include "common/mma.cuh"

namespace kda {

// Byte offset of element (k, n) of a B tile with `n_cols` columns.
__host__ __device__ constexpr uint32_t wgmma_b_offset(int k, int n, int n_cols) {
  return static_cast<uint32_t>((k >> 3) * (n_cols * 16) + (n >> 3) * 128 + (k & 7) * 16 + (n & 7) * 2);
}

// Descriptor of the k16 slice starting at row k0 of a B tile at `tile` with `n_cols` columns:
// leading byte offset = between the slice's two k-groups, stride byte offset = between n-adjacent
// core matrices (CUTLASS make_gmma_desc<Major::MN>, INTERLEAVE).
// With n0 (a multiple of 8): the slice's columns n0 .. (a column block of the same tile).
__device__ __forceinline__ uint64_t wgmma_b_desc(const void* tile, int k0, int n_cols, int n0 = 0) {
  const uint32_t addr = smem_addr(tile) + static_cast<uint32_t>((k0 >> 3) * n_cols * 16 + (n0 >> 3) * 128);
  uint64_t d = static_cast<uint64_t>((addr & 0x3FFFFu) >> 4);
  d |= static_cast<uint64_t>((n_cols * 16) >> 4) << 16;  // leading byte offset
  d |= static_cast<uint64_t>(128 >> 4) << 32;            // stride byte offset
  return d;                                               // base offset 0, no swizzle
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Shared-memory writes of this thread become visible to the async proxy (wgmma's B reads).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// After wgmma_wait: the accumulators are read only after this point (the compiler sees them
// written here, so no read moves above the wait).
template <int NT>
__device__ __forceinline__ void wgmma_fence_acc(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
    asm volatile("" : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])::"memory");
}

#define KDA_WG_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])

// d[64 x 8 NT] += a[64 x 16] B[16 x 8 NT], B (MN-major) at descriptor `b`.
template <int NT>
__device__ __forceinline__ void wgmma_bf16(float (&d)[NT][4], const uint32_t (&a)[4], uint64_t b);

template <>
__device__ __forceinline__ void wgmma_bf16<2>(float (&d)[2][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, "
      "{%8, %9, %10, %11}, %12, p, 1, 1, 1;\n}\n"
      : KDA_WG_D4(0), KDA_WG_D4(1)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<4>(float (&d)[4][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1, 1;\n}\n"
      : KDA_WG_D4(0), KDA_WG_D4(1), KDA_WG_D4(2), KDA_WG_D4(3)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<8>(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : KDA_WG_D4(0), KDA_WG_D4(1), KDA_WG_D4(2), KDA_WG_D4(3), KDA_WG_D4(4), KDA_WG_D4(5), KDA_WG_D4(6),
        KDA_WG_D4(7)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<16>(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : KDA_WG_D4(0), KDA_WG_D4(1), KDA_WG_D4(2), KDA_WG_D4(3), KDA_WG_D4(4), KDA_WG_D4(5), KDA_WG_D4(6),
        KDA_WG_D4(7), KDA_WG_D4(8), KDA_WG_D4(9), KDA_WG_D4(10), KDA_WG_D4(11), KDA_WG_D4(12), KDA_WG_D4(13),
        KDA_WG_D4(14), KDA_WG_D4(15)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

#undef KDA_WG_D4

}  // namespace kda
