// Checks shared by the conv1d + SiLU forward and backward bindings.
#pragma once
#include "common/binding.h"
#include "common/conv1d_silu.h"

namespace kda {

struct ConvDims {
  int64_t T, D, N;
  int cu_int64;
};

// x [1, T, D] bf16, weight [D, 4] fp32, bias [D] fp32 or None, halo [N, 3, D] bf16 or None,
// cu_seqlens [N + 1] int32/int64. The contents of cu_seqlens are checked on the host by
// kda_aot (they are device data here).
inline ConvDims check_conv_inputs(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& halo,
                                  const Tensor& cu) {
  expect_dtype(x, kBFloat16);
  if (x.shape.size() != 3 || x.shape[0] != 1)
    fail_value("x: expected shape [1, T, D] (packed documents, batch 1), got " + join(x.shape));
  const int64_t T = x.shape[1], D = x.shape[2];
  if (T < 1) fail_value("x: T must be at least 1");
  if (D < 1 || D % kConvChannelAlign != 0)
    fail_value("x: D must be a positive multiple of 8 (16-byte rows), got " + std::to_string(D));
  expect_contiguous(x);
  expect_aligned(x, 16);

  expect_dtype(weight, kFloat32);
  if (weight.shape.size() != 2 || weight.shape[1] != kConvWidth)
    fail_value("weight: expected shape [D, 4] (width-4 causal conv), got " + join(weight.shape));
  expect_shape(weight, {D, kConvWidth}, "[D, 4]");
  expect_contiguous(weight);
  expect_aligned(weight, 16);

  if (bias.present) {
    expect_dtype(bias, kFloat32);
    expect_shape(bias, {D}, "[D]");
    expect_contiguous(bias);
    expect_aligned(bias, 16);
  }

  expect_dtype2(cu, kInt32, kInt64);
  if (cu.shape.size() != 1 || cu.shape[0] < 2)
    fail_value("cu_seqlens: expected shape [N + 1] with N >= 1, got " + join(cu.shape));
  expect_contiguous(cu);
  expect_aligned(cu, dtype_size(cu.dtype));
  const int64_t N = cu.shape[0] - 1;

  if (halo.present) {
    expect_dtype(halo, kBFloat16);
    expect_shape(halo, {N, 3, D}, "[N, 3, D]");
    expect_contiguous(halo);
    expect_aligned(halo, 16);
  }
  return {T, D, N, cu.dtype == kInt64 ? 1 : 0};
}

}  // namespace kda
