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

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .._runtime.tensor import is_real

L2NORM_EPS = 1e-6


def _work_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in x's dtype (a bf16 sum of 128 squares would lose the norm's low
    bits, hence fp32 at least)."""
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
    xf = x.to(_work_dtype(x))
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


# FLA's gate reads A_log and dt_bias as fp32 whatever their float dtype; so do the kernels (kernel_gate).
GATE_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_gate_args(g: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
                    lower_bound: Optional[float], safe_gate: bool = False) -> None:
    """The gate's parameters: A_log [HV] (or any shape of HV elements), dt_bias [HV * K] (or [HV, K]), both
    floating point on g's device; lower_bound < 0, in [-5, 0) with safe_gate; A_log required without lower_bound.
    kda_gate's checks, and the ops' (kda_aot.chunk_kda with use_gate_in_kernel) before any kernel."""
    HV, K = g.shape[-2], g.shape[-1]
    if not g.is_floating_point():
        raise TypeError(f"g: the raw gate must be floating point, got {g.dtype}")
    if A_log is None and lower_bound is None:
        raise ValueError("A_log: required with use_gate_in_kernel=True unless lower_bound is set "
                         "(the gate -exp(A_log) * softplus(g + dt_bias))")
    for name, t, numel in (("A_log", A_log, HV), ("dt_bias", dt_bias, HV * K)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in GATE_PARAM_DTYPES:
            raise TypeError(f"{name}: expected float32, bfloat16, float16 or float64, got {t.dtype}")
        if t.numel() != numel:
            spelled = f"[HV] for HV = {HV}" if name == "A_log" else f"[HV * K] for HV = {HV}, K = {K}"
            raise ValueError(f"{name}: expected {numel} elements ({spelled}), got shape {list(t.shape)}")
        if t.device != g.device:
            raise ValueError(f"{name}: on {t.device} but g is on {g.device}")
    if lower_bound is not None:
        if not is_real(lower_bound):
            raise TypeError(f"lower_bound: expected a float, got {type(lower_bound).__name__}")
        if safe_gate and not -5 <= lower_bound < 0:
            raise ValueError(f"lower_bound: must lie in [-5, 0) with safe_gate=True, got {lower_bound}")
        # the gate lower_bound * sigmoid(..) is a log decay, <= 0; -inf would make it NaN where sigmoid is 0
        if not (math.isfinite(lower_bound) and lower_bound < 0):
            raise ValueError(f"lower_bound: must be a finite number < 0 (the gate is lower_bound * sigmoid(...), "
                             f"a log decay), got {lower_bound}")
    elif safe_gate:
        raise ValueError("lower_bound: required with safe_gate=True and use_gate_in_kernel=True")


def kda_gate(g: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
             lower_bound: Optional[float], safe_gate: bool = False) -> Tensor:
    """The activated log decay [.., HV, K] in fp32 (fp64 for an fp64 g) from the raw gate g [.., HV, K]."""
    check_gate_args(g, A_log, dt_bias, lower_bound, safe_gate)
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


def beta_sigmoid(b: Tensor, allow_neg_eigval: bool = False, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """beta = sigmoid(b), or 2 sigmoid(b) with allow_neg_eigval, computed in fp32 (fp64 for fp64 b) and returned in
    `dtype` (the kernels' beta operand is bf16)."""
    if not b.is_floating_point():
        raise TypeError(f"beta: the raw beta must be floating point with use_beta_sigmoid_in_kernel, got {b.dtype}")
    beta = torch.sigmoid(b.to(_work_dtype(b)))
    if allow_neg_eigval:
        beta = 2.0 * beta
    return beta.to(dtype)
