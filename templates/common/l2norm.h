// C ABI of the per-head L2 norm (q, k before KDA): rows of 128 bf16, fp32 arithmetic.
//   forward:  rstd = 1 / sqrt(sum x^2 + eps),  y = x * rstd
//   backward: dx = rstd * (dy - y * sum(dy * y)),  y = x * rstd recomputed in fp32
#pragma once
#include <cstdint>

namespace kda {

constexpr int kL2NormWidth = 128;  // the head dim of every KDA program

struct L2NormArgs {
  const uint16_t* x;   // [rows, 128] bf16
  const uint16_t* dy;  // [rows, 128] bf16 (backward)
  const float* rstd_in;  // [rows] (backward: the forward's rstd)
  uint16_t* y;         // [rows, 128] bf16 (forward)
  float* rstd;         // [rows] (forward)
  uint16_t* dx;        // [rows, 128] bf16 (backward)
  int64_t rows;
  float eps;
};

}  // namespace kda
