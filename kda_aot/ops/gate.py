"""The gate and beta activations of flash-linear-attention's chunk_kda (use_gate_in_kernel,
use_beta_sigmoid_in_kernel): their checks, and where each runs. The formulas are kda_aot.reference.activations'
(kda_gate, beta_sigmoid).

On the GPU the gate's activation runs inside the kernels (kernel_gate: kda_fwd_chunk forms it before its
cumulative sum, kda_bwd_gate again for dg, dA_log and dt_bias); elsewhere, and under context parallelism, it
runs as the torch operations here, before the KDA op. beta's activation runs inside the kernels for
kda_aot.chunk_kda (kernel_beta: every program that reads beta forms it from the logits); under context
parallelism as the torch operation here (beta_sigmoid).
"""
from typing import Optional

import torch
from torch import Tensor

from ..reference.activations import beta_sigmoid, check_gate_args, kda_gate
from ..schedule.kda import BETA_SIGMOID, BETA_SIGMOID_2, GATE_SIGMOID, GATE_SOFTPLUS

def kernel_gate(g: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor], lower_bound: Optional[float],
                safe_gate: bool) -> tuple:
    """use_gate_in_kernel on the GPU, checked: the raw gate as the kernels read it (bf16 as it is, as FLA's
    f_proj gives it: dg comes back in bf16 too; any other float as fp32) and the kernels' activation
    arguments (A_log [HV] fp32 or None, dt_bias [HV, K] fp32 or None, gate kind 1 softplus / 2 sigmoid, lower
    bound), which kda_fwd_chunk and kda_bwd_gate form the log decay from (kda_gate: the same formula in torch)."""
    check_gate_args(g, A_log, dt_bias, lower_bound, safe_gate)
    HV, K = g.shape[-2], g.shape[-1]
    a = None if A_log is None else A_log.float().reshape(HV)
    dt = None if dt_bias is None else dt_bias.float().reshape(HV, K)
    kind = GATE_SOFTPLUS if lower_bound is None else GATE_SIGMOID
    raw = g if g.dtype == torch.bfloat16 else g.float()
    return raw, (a, dt, kind, 0.0 if lower_bound is None else float(lower_bound))


def kernel_beta(b: Tensor, allow_neg_eigval: bool) -> tuple:
    """use_beta_sigmoid_in_kernel for kda_aot.chunk_kda, checked: the logits as the kernels read them (bf16 as
    they are, any other float as fp32: FLA's sigmoid reads them in fp32) and beta's kind (kda.BETA_SIGMOID, or
    BETA_SIGMOID_2 with allow_neg_eigval). The kernels form beta in fp32 and never round it to bf16, as FLA."""
    if not b.is_floating_point():
        raise TypeError(f"beta: the raw beta must be floating point with use_beta_sigmoid_in_kernel, got {b.dtype}")
    return (b if b.dtype == torch.bfloat16 else b.float()), (BETA_SIGMOID_2 if allow_neg_eigval else BETA_SIGMOID)


def activate(g: Tensor, beta: Tensor, *, use_gate_in_kernel: bool, A_log, dt_bias,
             lower_bound, safe_gate: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool,
             beta_dtype: torch.dtype, raw_gate_in_kernels: bool = False,
             beta_logits_in_kernels: bool = False) -> tuple:
    """FLA's per-token input activations, checked: (g as the log decay, beta), on shapes the caller checked
    (check_kda_shapes: g [B, T, HV, K], beta [B, T, HV]); a narrower float
    g without use_gate_in_kernel is widened to fp32 exactly, unless raw_gate_in_kernels (kernel_gate's raw gate,
    which the kernels read as it is);
    beta_logits_in_kernels: beta is kernel_beta's logits, which the kernels activate (not activated here).
    Per token: under context parallelism each rank activates its own tokens."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: needs use_beta_sigmoid_in_kernel=True (beta = 2 sigmoid(b))")
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound, safe_gate)
    else:
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            if t is not None:
                raise ValueError(f"{name}: only used with use_gate_in_kernel=True (g is the log decay here)")
        if g.is_floating_point() and g.dtype not in (torch.float32, torch.float64) and not raw_gate_in_kernels:
            g = g.float()
    if use_beta_sigmoid_in_kernel and not beta_logits_in_kernels:
        beta = beta_sigmoid(beta, allow_neg_eigval, beta_dtype)
    return g, beta
