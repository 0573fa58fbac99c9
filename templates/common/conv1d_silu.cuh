// Device side of the width-4 causal conv1d + SiLU, shared by the forward and backward kernels.
// A thread owns C channels (one 8- or 16-byte bf16 access) of a tile of consecutive tokens and walks
// it in order, keeping the three previous inputs of the window in registers. The window restarts at
// every segment start with the segment's halo (or zeros). Forward and backward evaluate the
// pre-activation with the same function, so the backward recomputes it bitwise.
#pragma once
#include "common/conv1d_silu.h"
#include "common/device.cuh"

namespace kda {

template <int C>
struct ConvTaps {
  float w[C][kConvWidth];  // w[c][j] multiplies x[t - 3 + j]
  float b[C];
};

template <int C>
struct ConvWindow {
  float r[3][C];  // x[t-3], x[t-2], x[t-1] (zeros or halo before the segment start)
};

template <int C>
__device__ __forceinline__ void zero(float (&f)[C]) {
#pragma unroll
  for (int c = 0; c < C; ++c) f[c] = 0.f;
}

template <int C>
__device__ __forceinline__ void load_taps(ConvTaps<C>& taps, const float* weight, const float* bias, int64_t ch0) {
  const float4* w4 = reinterpret_cast<const float4*>(weight + ch0 * kConvWidth);
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const float4 v = __ldg(w4 + c);
    taps.w[c][0] = v.x; taps.w[c][1] = v.y; taps.w[c][2] = v.z; taps.w[c][3] = v.w;
  }
#pragma unroll
  for (int c = 0; c < C; ++c) taps.b[c] = bias ? __ldg(bias + ch0 + c) : 0.f;
}

// Window for the first token `t` of a walk inside segment `seg` = [s, e): positions before s read
// the segment's halo (rows 0, 1, 2 = positions s-3, s-2, s-1) or zero.
template <int C>
__device__ __forceinline__ void load_window(ConvWindow<C>& win, const uint16_t* x, const uint16_t* halo, int64_t seg,
                                            int64_t s, int64_t t, int64_t D, int64_t ch0) {
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    const int64_t pos = t - 3 + k;
    if (pos >= s) load_bf16<C>(win.r[k], x + pos * D + ch0);
    else if (halo) load_bf16<C>(win.r[k], halo + (seg * 3 + pos - (s - 3)) * D + ch0);
    else zero<C>(win.r[k]);
  }
}

// Rows t .. t+U-1 (those below `end`) of a [T, D] bf16 tensor, channels ch0 .. ch0+C-1.
template <int C, int U>
__device__ __forceinline__ void load_rows(Bf16Vec<C> (&rows)[U], const uint16_t* base, int64_t t, int64_t end,
                                          int64_t D, int64_t ch0) {
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (t + u < end) rows[u].load(base + (t + u) * D + ch0);
}

template <int C>
__device__ __forceinline__ void push_window(ConvWindow<C>& win, const float (&x0)[C]) {
#pragma unroll
  for (int c = 0; c < C; ++c) {
    win.r[0][c] = win.r[1][c];
    win.r[1][c] = win.r[2][c];
    win.r[2][c] = x0[c];
  }
}

// pre = b + w0 x[t-3] + w1 x[t-2] + w2 x[t-1] + w3 x[t], in this order, fp32.
template <int C>
__device__ __forceinline__ void conv_pre(float (&pre)[C], const ConvTaps<C>& taps, const ConvWindow<C>& win,
                                         const float (&x0)[C]) {
#pragma unroll
  for (int c = 0; c < C; ++c) {
    float a = taps.b[c];
    a = fmaf(taps.w[c][0], win.r[0][c], a);
    a = fmaf(taps.w[c][1], win.r[1][c], a);
    a = fmaf(taps.w[c][2], win.r[2][c], a);
    a = fmaf(taps.w[c][3], x0[c], a);
    pre[c] = a;
  }
}

// Hardware exp2 and reciprocal (a few ulp in fp32): the results are rounded to bf16 (y, dx) or summed
// in fp32 (dweight), far coarser; the IEEE division and expf cost more instructions than the
// memory-bound walk can hide. For p < -88, exp overflows to inf and sigmoid is 0, as it should be.
__device__ __forceinline__ float sigmoid_f32(float p) { return __fdividef(1.f, 1.f + __expf(-p)); }

__device__ __forceinline__ float silu(float p) { return p * sigmoid_f32(p); }

// d silu(p) / dp = s (1 + p (1 - s)), s = sigmoid(p)
__device__ __forceinline__ float silu_grad(float p) {
  const float s = sigmoid_f32(p);
  return s * (1.f + p * (1.f - s));
}

// Sum over the 32 lanes of a warp (butterfly: every lane gets the same bits). The fused L2-norm forms call it
// with the whole warp on one token's head, which their warp-uniform tile walk guarantees.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// warp_sum of every a[i] and b[i], the 2N butterflies side by side (each value's bits as warp_sum's).
template <int N>
__device__ __forceinline__ void warp_sums(float (&a)[N], float (&b)[N]) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      a[i] += __shfl_xor_sync(0xffffffffu, a[i], m);
      b[i] += __shfl_xor_sync(0xffffffffu, b[i], m);
    }
  }
}

template <int N>
__device__ __forceinline__ void warp_sums(float (&a)[N]) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] += __shfl_xor_sync(0xffffffffu, a[i], m);
  }
}

// 1 / sqrt(head sum + eps), the hardware reciprocal square root (a couple of ulp in fp32, far below the bf16
// rounding of y and dx): the IEEE sqrt and division it replaced cost ~40 instructions a row in every lane
// (docs/conv.md). The forward and backward forms both take it from here, so the backward's r is the forward's.
__device__ __forceinline__ float norm_rstd(float head_sum, float eps) { return rsqrtf(head_sum + eps); }

// norm_rstd of the head's sum of y^2: this lane's C channels, then the warp's (C * 32 = 128 channels).
template <int C>
__device__ __forceinline__ float head_rstd(const float (&y)[C], float eps) {
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < C; ++c) ss = fmaf(y[c], y[c], ss);
  return norm_rstd(warp_sum(ss), eps);
}

}  // namespace kda
