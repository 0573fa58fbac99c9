// Launch arguments of the causal conv1d (width 4) + SiLU programs (forward and backward).
// Tensors are contiguous; bf16 data is passed as raw 16-bit words.
#pragma once
#include <cstdint>

namespace kda {

constexpr int kConvWidth = 4;
constexpr int kConvChannelAlign = 8;  // D is a multiple of 8: every row starts 16-byte aligned
constexpr int kConvPartials = kConvWidth + 1;  // dweight taps + dbias, per (tile, channel)

struct Conv1dSiluFwdArgs {
  const uint16_t* x;       // [T, D] bf16
  uint16_t* y;             // [T, D] bf16
  const float* weight;     // [D, 4]
  const float* bias;       // [D] or null
  const uint16_t* halo;    // [N, 3, D] bf16 or null: tokens s-3, s-2, s-1 before segment start s
  const void* cu_seqlens;  // [N + 1] int32 or int64
  int cu_seqlens_int64;
  int64_t T, D, N;
};

struct Conv1dSiluBwdArgs {
  const uint16_t* x;       // [T, D] bf16
  const uint16_t* dy;      // [T, D] bf16
  uint16_t* dx;            // [T, D] bf16
  const float* weight;     // [D, 4]
  const float* bias;       // [D] or null (the pre-activation is recomputed)
  const uint16_t* halo;    // [N, 3, D] bf16 or null
  float* dhalo;            // [N, 3, D] fp32 or null
  float* dweight;          // [D, 4] fp32
  float* dbias;            // [D] fp32 or null
  float* workspace;        // [tiles, D, 5] fp32 per-tile partial sums of dweight and dbias
  const void* cu_seqlens;  // [N + 1] int32 or int64
  int cu_seqlens_int64;
  int64_t T, D, N;
};

inline int64_t conv_tiles(int64_t T, int64_t tokens_per_thread) {
  return (T + tokens_per_thread - 1) / tokens_per_thread;
}

}  // namespace kda
