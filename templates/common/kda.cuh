// Device helpers shared by the KDA kernels.
#pragma once
#include "common/device.cuh"
#include "common/kda.h"
#include "common/mma.cuh"

namespace kda {

constexpr int kPitch = kHeadDim + 8;  // bf16 row pitch of 128-wide shared tiles (ldmatrix: no bank conflicts)

__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }

// Kernels that keep Gamma in log2 units (Gamma x log2 e) take every exp of it as one ex2: the
// hardware op __expf also ends in, without the FMUL by log2 e before it.
constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The gate as every program sums it: at least -kGateFloor (g = -inf, a reset, becomes finite); NaN stays NaN.
__device__ __forceinline__ float floored_gate(float g) { return g < -kGateFloor ? -kGateFloor : g; }

// The gate's activation of one (head, channel), in hardware ex2 / lg2 / rcp.approx (libm's expf and log1pf
// are slower over a pack's every gate value: docs/forward.md): every operation an approx op or an _rn intrinsic, so
// that the programs that form it (kda_fwd_chunk, kda_bwd_gate) get the same bits. Errors: sigmoid 1-3e-7
// absolute; softplus ~1e-7 absolute for small z, about an ulp of itself above z ~ 2 (both against fp64):
// far under the bf16 operands' 4e-3.
struct GateChannel {
  int kind;
  float a;   // exp(A_log) of the head
  float dt;  // dt_bias of the channel
  float lower_bound;
};

__device__ __forceinline__ GateChannel gate_channel(const KdaGate& gate, int64_t h, int64_t d) {
  GateChannel c;
  c.kind = gate.kind;
  c.a = gate.a_log ? expf(gate.a_log[h]) : 1.f;
  c.dt = gate.dt_bias ? gate.dt_bias[h * kHeadDim + d] : 0.f;
  c.lower_bound = gate.lower_bound;
  return c;
}

constexpr float kLn2 = 0.6931471805599453f;
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float lg2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// softplus(z) = max(z, 0) + log1p(e) and sigmoid(z), from e = exp(-|z|) in (0, 1] (no overflow; z = +-inf
// gives what torch's softplus and sigmoid give; NaN stays NaN).
struct SoftplusSigmoid {
  float softplus, sigmoid;
};
__device__ __forceinline__ SoftplusSigmoid softplus_sigmoid(float z) {
  const float e = exp2_approx(__fmul_rn(-fabsf(z), kLog2e)), one_e = __fadd_rn(1.f, e);
  SoftplusSigmoid r;
  r.softplus = __fadd_rn(fmaxf(z, 0.f), __fmul_rn(lg2_approx(one_e), kLn2));
  // x / (1 + e) as the reciprocal's product: __fdividef's bits (1 + e is in [1, 2], never in its scaled ranges)
  // without its three range-check instructions
  r.sigmoid = __fmul_rn(rcp_approx(one_e), z >= 0.f ? 1.f : e);
  return r;
}

// The log decay of raw gate x under activation kKind (not kGateRaw), from the head's a = exp(A_log) and the
// channel's dt_bias: every caller forms it with these operations in this order (the same bits everywhere).
template <int kKind>
__device__ __forceinline__ float activated_gate_of(float a, float dt, float lower_bound, float x) {
  const float z = __fadd_rn(x, dt);
  if (kKind == kGateSoftplus) return __fmul_rn(-a, softplus_sigmoid(z).softplus);
  return __fmul_rn(lower_bound, softplus_sigmoid(__fmul_rn(a, z)).sigmoid);
}

// The log decay of raw gate x (x itself for kGateRaw).
__device__ __forceinline__ float activated_gate(const GateChannel& c, float x) {
  if (c.kind == kGateRaw) return x;
  if (c.kind == kGateSoftplus) return activated_gate_of<kGateSoftplus>(c.a, c.dt, c.lower_bound, x);
  return activated_gate_of<kGateSigmoid>(c.a, c.dt, c.lower_bound, x);
}

// beta of token-major index i (t * H + h) as every program that reads it forms it: the logits' sigmoid in fp32 (FLA's
// contract: its beta is the fp32 sigmoid, never rounded to bf16), in the gate's approx ops so that kda_fwd_chunk,
// kda_bwd_chunk and kda_bwd_gate get the same bits; kBetaPlain reads bf16 beta as it is.
__device__ __forceinline__ float activated_beta(const KdaBeta& act, const uint16_t* beta, int64_t i) {
  const float x = act.logits_f32 ? act.logits_f32[i] : bf16_bits_to_float(beta[i]);
  if (act.kind == kBetaPlain) return x;
  const float s = softplus_sigmoid(x).sigmoid;
  return act.kind == kBetaSigmoid2 ? __fmul_rn(2.f, s) : s;
}

// d g / d x and d g / d A_log of activation kKind (not kGateRaw) at raw x.
template <int kKind>
__device__ __forceinline__ void gate_derivatives_of(float a, float dt, float lower_bound, float x, float& d_x,
                                                    float& d_alog) {
  const float z = __fadd_rn(x, dt);
  if (kKind == kGateSoftplus) {
    const SoftplusSigmoid f = softplus_sigmoid(z);
    d_x = __fmul_rn(-a, f.sigmoid);
    d_alog = __fmul_rn(-a, f.softplus);  // g itself: A = exp(A_log)
  } else {
    const float az = __fmul_rn(a, z), s = softplus_sigmoid(az).sigmoid;
    const float slope = __fmul_rn(lower_bound, __fmul_rn(s, __fsub_rn(1.f, s)));  // d g / d (a z)
    d_x = __fmul_rn(slope, a);
    d_alog = __fmul_rn(slope, az);
  }
}

// d g / d x and d g / d A_log of the activation at raw x (kind != kGateRaw).
__device__ __forceinline__ void gate_derivatives(const GateChannel& c, float x, float& d_x, float& d_alog) {
  if (c.kind == kGateSoftplus) gate_derivatives_of<kGateSoftplus>(c.a, c.dt, c.lower_bound, x, d_x, d_alog);
  else gate_derivatives_of<kGateSigmoid>(c.a, c.dt, c.lower_bound, x, d_x, d_alog);
}

// The gate's parameters of a thread's eight channels c0 + 8 (tid % (kCols / 8)) .. + 7, the channels it
// activates in activate_gate_tile (loaded before the tiles' wait so that their latency hides behind it).
struct GateVec {
  int kind;
  float a;  // exp(A_log) of the head
  float lower_bound;
  float dt[8];  // dt_bias of the eight channels
};

template <int kCols, int kThreads>
__device__ __forceinline__ GateVec gate_vec(const KdaGate& gate, int64_t h, int c0, int tid) {
  GateVec v;
  const GateChannel c = gate_channel(gate, h, c0);  // a and lower_bound as every program forms them
  v.kind = c.kind;
  v.a = c.a;
  v.lower_bound = c.lower_bound;
  const int col = c0 + (tid % (kCols / 8)) * 8;
#pragma unroll
  for (int e = 0; e < 8; ++e) v.dt[e] = gate.dt_bias ? gate.dt_bias[h * kHeadDim + col + e] : 0.f;
  return v;
}

template <int kKind, int kCols, int kPitchG, int kThreads>
__device__ __forceinline__ void activate_gate_rows(float (*G)[kPitchG], uint16_t (*raw)[kCols], const GateVec& v,
                                                   int len, int tid) {
  constexpr int kVecs = kCols / 8, kRowsPerStep = kThreads / kVecs;
  static_assert(kThreads % kVecs == 0 && kChunk % kRowsPerStep == 0, "whole rows a step");
  const int col = (tid % kVecs) * 8;
#pragma unroll
  for (int step = 0; step < kChunk / kRowsPerStep; ++step) {
    const int r = tid / kVecs + step * kRowsPerStep;
    float x[8];
    if (raw) {
      const uint4 w = *reinterpret_cast<const uint4*>(&raw[r][col]);
      const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        x[2 * e] = __uint_as_float(u[e] << 16);
        x[2 * e + 1] = __uint_as_float(u[e] & 0xFFFF0000u);
      }
    } else {
      const float4 p = *reinterpret_cast<const float4*>(&G[r][col]), q = *reinterpret_cast<const float4*>(&G[r][col + 4]);
      x[0] = p.x; x[1] = p.y; x[2] = p.z; x[3] = p.w; x[4] = q.x; x[5] = q.y; x[6] = q.z; x[7] = q.w;
    }
    // every row activated (rows >= len hold zeros), then rows >= len zeroed: a select, not a branch an element
    // (a branch around each element's MUFU chain kept the eight chains from overlapping)
    float y[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = activated_gate_of<kKind>(v.a, v.dt[e], v.lower_bound, x[e]);
    const bool valid = r < len;
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = valid ? y[e] : 0.f;  // rows >= len: no decay
    *reinterpret_cast<float4*>(&G[r][col]) = make_float4(y[0], y[1], y[2], y[3]);
    *reinterpret_cast<float4*>(&G[r][col + 4]) = make_float4(y[4], y[5], y[6], y[7]);
  }
}

// The raw gate of one chunk's kCols channels activated into G ([kChunk][kPitchG] fp32, rows >= len zero: no
// decay): from the bf16 tile raw ([kChunk][kCols]) or, raw null, from G itself (an fp32 raw gate). Eight
// channels a thread per step with the kind dispatched once: per element its arithmetic only (the loop over
// single elements spent ~40 instructions an element, its chain of two MUFU ops not overlapped).
template <int kCols, int kPitchG, int kThreads>
__device__ __forceinline__ void activate_gate_tile(float (*G)[kPitchG], uint16_t (*raw)[kCols], const GateVec& v,
                                                   int len, int tid) {
  if (v.kind == kGateSoftplus) activate_gate_rows<kGateSoftplus, kCols, kPitchG, kThreads>(G, raw, v, len, tid);
  else activate_gate_rows<kGateSigmoid, kCols, kPitchG, kThreads>(G, raw, v, len, tid);
}

// Rows [0, len) of one head of a token-major [T, H, 128] bf16 tensor into a [64][kPitch] shared
// tile; rows [len, 64) are zero so that short chunks need no special cases in the products.
__device__ __forceinline__ void load_chunk_rows(__nv_bfloat16 (*dst)[kPitch], const uint16_t* src, int64_t t0,
                                                int len, int64_t H, int64_t h, int tid, int nthreads) {
  for (int i = tid; i < kChunk * (kHeadDim / 8); i += nthreads) {
    const int r = i / (kHeadDim / 8), col = (i % (kHeadDim / 8)) * 8;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < len) val = load_nc_16(src + ((t0 + r) * H + h) * kHeadDim + col);
    *reinterpret_cast<uint4*>(&dst[r][col]) = val;
  }
}

template <int N>
__device__ __forceinline__ void zero_acc(float (&acc)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

}  // namespace kda

namespace kda {

// *p = v where pred: a predicated store (an unrolled loop's `if (pred) *p = v` became a branch around each
// store). No memory clobber: for outputs the kernel does not read back. st.global on a generic pointer: on sm_90
// a global address is the same in both spaces.
__device__ __forceinline__ void store_if(bool pred, uint16_t* p, uint16_t v) {
  asm volatile("{\n .reg .pred q;\n setp.ne.u32 q, %0, 0;\n @q st.global.u16 [%1], %2;\n}" ::"r"(
                   static_cast<unsigned>(pred)), "l"(p), "h"(v));
}
__device__ __forceinline__ void store_if(bool pred, float* p, float v) {
  asm volatile("{\n .reg .pred q;\n setp.ne.u32 q, %0, 0;\n @q st.global.f32 [%1], %2;\n}" ::"r"(
                   static_cast<unsigned>(pred)), "l"(p), "f"(v));
}

// 16-byte global -> shared copy on the async path; `valid = false` writes zeros instead.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
// 4-byte global -> shared copy on the async path (one element of a [T, H] tensor); `valid = false` writes 0.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(kPending)); }

// Async version of load_chunk_rows for a [64][kPitch] tile (rows >= len zero-filled).
__device__ __forceinline__ void cp_chunk_rows(__nv_bfloat16 (*dst)[kPitch], const uint16_t* src, int64_t t0, int len,
                                              int64_t H, int64_t h, int tid, int nthreads) {
  for (int i = tid; i < kChunk * (kHeadDim / 8); i += nthreads) {
    const int r = i / (kHeadDim / 8), col = (i % (kHeadDim / 8)) * 8;
    const bool valid = r < len;
    cp_async_16(&dst[r][col], src + ((t0 + (valid ? r : 0)) * H + h) * kHeadDim + col, valid);
  }
}

}  // namespace kda

namespace kda {

// Async copy of columns [col0, col0 + ncols) of rows [0, len) of one head of a token-major
// [T, H, 128] tensor into a [64][kPitch] tile (at the same column offsets minus col0).
__device__ __forceinline__ void cp_chunk_cols(__nv_bfloat16 (*dst)[kPitch], const uint16_t* src, int64_t t0, int len,
                                              int64_t H, int64_t h, int col0, int ncols, int tid, int nthreads) {
  const int vecs = ncols / 8;
  for (int i = tid; i < kChunk * vecs; i += nthreads) {
    const int r = i / vecs, col = (i % vecs) * 8;
    const bool valid = r < len;
    cp_async_16(&dst[r][col], src + ((t0 + (valid ? r : 0)) * H + h) * kHeadDim + col0 + col, valid);
  }
}

}  // namespace kda

namespace kda {

// The gate tile of one chunk onto the async path (columns [c0, c0 + kCols) of head h, rows >= len zero): the raw
// bf16 gate, 8 a copy, into raw when raw16 is given, else the fp32 gate g, 4 a copy, into G.
template <int kThreads, int kCols, int kPitchG>
__device__ __forceinline__ void cp_gate_tile(float (*G)[kPitchG], uint16_t (*raw)[kCols], const float* g,
                                             const uint16_t* raw16, int64_t t0, int len, int64_t H, int64_t h,
                                             int c0, int tid) {
  if (!raw16) {
    for (int i = tid; i < kChunk * (kCols / 4); i += kThreads) {
      const int r = i / (kCols / 4), col = (i % (kCols / 4)) * 4;
      const bool valid = r < len;
      cp_async_16(&G[r][col], g + ((t0 + (valid ? r : 0)) * H + h) * kHeadDim + c0 + col, valid);
    }
  } else {
    for (int i = tid; i < kChunk * (kCols / 8); i += kThreads) {
      const int r = i / (kCols / 8), col = (i % (kCols / 8)) * 8;
      const bool valid = r < len;
      cp_async_16(&raw[r][col], raw16 + ((t0 + (valid ? r : 0)) * H + h) * kHeadDim + c0 + col, valid);
    }
  }
}

// A warp's 16-row slice of a 128 x (8 NT) fp32 state in mma accumulator layout (rows m0 + g8 and
// m0 + g8 + 8, columns 8 nt + 2 tg, +1), to or from a row-major matrix with 128-float rows.
template <int NT>
__device__ __forceinline__ void store_state(float* dst, const float (&st)[NT][4], int m0) {
  const int lane = threadIdx.x & 31, g8 = lane >> 2, tg = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int col = nt * 8 + 2 * tg;
    *reinterpret_cast<float2*>(dst + (m0 + g8) * kHeadDim + col) = make_float2(st[nt][0], st[nt][1]);
    *reinterpret_cast<float2*>(dst + (m0 + g8 + 8) * kHeadDim + col) = make_float2(st[nt][2], st[nt][3]);
  }
}

template <int NT>
__device__ __forceinline__ void load_state(float (&st)[NT][4], const float* src, int m0) {
  const int lane = threadIdx.x & 31, g8 = lane >> 2, tg = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int col = nt * 8 + 2 * tg;
    const float2 lo = *reinterpret_cast<const float2*>(src + (m0 + g8) * kHeadDim + col);
    const float2 hi = *reinterpret_cast<const float2*>(src + (m0 + g8 + 8) * kHeadDim + col);
    st[nt][0] = lo.x; st[nt][1] = lo.y; st[nt][2] = hi.x; st[nt][3] = hi.y;
  }
}

}  // namespace kda
