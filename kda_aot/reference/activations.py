"""The elementwise math around the KDA recurrence, in torch, differentiable: q and k's L2 norm, the gate's and beta's
activations (flash-linear-attention's use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel).
fp32 arithmetic at least (fp64 for fp64 inputs), any head dim, CPU or GPU. The kernels compute the same formulas
(the l2norm records, kda_fwd_chunk and kda_bwd_gate for the gate, every program that reads beta for beta); the
reference and CP paths, and the tests, call these.

    l2norm:    y = x / sqrt(sum x^2 + eps) over the last dim (eps L2NORM_EPS, FLA's)
    kda_gate:  g = -exp(A_log) * softplus(g_raw + dt_bias)                    (lower_bound None)
               g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))      (lower_bound set;
                   without A_log: lower_bound * sigmoid(g_raw + dt_bias))
    beta_sigmoid: beta = sigmoid(b), or 2 sigmoid(b) with allow_neg_eigval (beta in [0, 2))
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

L2NORM_EPS = 1e-6


def _work_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in x's dtype (a bf16 sum of 128 squares would lose the norm's low
    bits, hence fp32 at least)."""
    xf = x.to(_work_dtype(x))
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def kda_gate(g: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
             lower_bound: Optional[float]) -> Tensor:
    """The activated log decay [.., HV, K] in fp32 (fp64 for an fp64 g) from the raw gate g [.., HV, K]."""
    HV, K = g.shape[-2], g.shape[-1]
    work = _work_dtype(g)
    x = g.to(work)
    if dt_bias is not None:
        x = x + dt_bias.to(work).reshape(HV, K)
    if lower_bound is None:
        return -A_log.to(work).reshape(HV, 1).exp() * F.softplus(x)
    if A_log is not None:
        x = A_log.to(work).reshape(HV, 1).exp() * x
    return float(lower_bound) * torch.sigmoid(x)


def beta_sigmoid(b: Tensor, allow_neg_eigval: bool, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """beta = sigmoid(b), or 2 sigmoid(b) with allow_neg_eigval, computed in fp32 (fp64 for fp64 b) and returned in
    `dtype` (the kernels' beta operand is bf16)."""
    if not b.is_floating_point():
        raise TypeError(f"beta: the raw beta must be floating point with use_beta_sigmoid_in_kernel, got {b.dtype}")
    beta = torch.sigmoid(b.to(_work_dtype(b)))
    if allow_neg_eigval:
        beta = 2.0 * beta
    return beta.to(dtype)
