// Checks shared by the L2-norm forward and backward bindings.
#pragma once
#include "common/binding.h"
#include "common/l2norm.h"

namespace kda {

// A [..., 128] bf16 row tensor, contiguous, 16-byte aligned; returns its row count.
inline int64_t check_l2norm_rows(const Tensor& t) {
  expect_dtype(t, kBFloat16);
  if (t.shape.empty() || t.shape.back() != kL2NormWidth)
    fail_value(t.name + ": expected shape [..., 128] (one head per row), got " + join(t.shape));
  expect_contiguous(t);
  expect_aligned(t, 16);
  return t.numel() / kL2NormWidth;
}

inline void expect_same_rows(const Tensor& t, const Tensor& like) {
  expect_dtype(t, kBFloat16);
  expect_shape(t, like.shape, (like.name + ".shape").c_str());
  expect_contiguous(t);
  expect_aligned(t, 16);
}

// rstd [...] fp32: the row tensor's shape without its last dimension.
inline void expect_rstd(const Tensor& rstd, const Tensor& rows) {
  expect_dtype(rstd, kFloat32);
  const std::vector<int64_t> want(rows.shape.begin(), rows.shape.end() - 1);
  expect_shape(rstd, want, (rows.name + ".shape[:-1]").c_str());
  expect_contiguous(rstd);
  expect_aligned(rstd, 4);
}

inline void check_eps(double eps) {
  if (!(eps > 0.0)) fail_value("eps: expected a positive number, got " + std::to_string(eps));
}

}  // namespace kda
