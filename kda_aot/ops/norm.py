"""Per-head L2 norm of q and k (PackedKDA's qk_l2norm) on the GPU: kernel calls and the autograd op.

y = x / sqrt(sum x^2 + eps) over each 128-wide head row, in fp32 from bf16, rounded to bf16 —
flash-linear-attention's l2norm (eps 1e-6; the formula: kda_aot.reference.activations.l2norm). The forward
keeps 1 / sqrt(sum x^2 + eps) per row (4 bytes a row) for the backward: dx = rstd (dy - y sum(dy y)).
"""
from __future__ import annotations

import torch

from .._runtime import registry
from .._runtime.packing import HEAD_DIM
from .._runtime.tensor import describe, is_real, out_or, require_cuda, stream_of
from ..reference.activations import L2NORM_EPS


def l2norm_forward(x: torch.Tensor, eps: float = L2NORM_EPS, *, out=None):
    """Kernel call: (y bf16 like x, rstd fp32 x.shape[:-1]). `out` may hold y / rstd (tests poison them)."""
    require_cuda(x, "x", "l2norm")
    out = dict(out or {})
    y = out_or(out, "y", lambda: torch.empty_like(x))
    rstd = out_or(out, "rstd", lambda: torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32))
    registry.library("l2norm_fwd", device=x.device).launch(describe(x, "x"), describe(y, "y"), describe(rstd, "rstd"),
                                                          float(eps), stream_of(x))
    return y, rstd


def l2norm_backward(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, *, out=None) -> torch.Tensor:
    """Kernel call: dx bf16 like x. `out` may hold dx."""
    require_cuda(x, "x", "l2norm")
    dx = out if out is not None else torch.empty_like(x)
    registry.library("l2norm_bwd", device=x.device).launch(describe(x, "x"), describe(rstd, "rstd"), describe(dy, "dy"),
                                                          describe(dx, "dx"), stream_of(x))
    return dx


@torch.library.custom_op("kda_aot::l2norm_fwd", mutates_args=())
def l2norm_fwd_op(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) of a contiguous bf16 x [..., 128] (the kernels)."""
    return l2norm_forward(x.contiguous(), eps)


@l2norm_fwd_op.register_fake
def _(x, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("kda_aot::l2norm_bwd", mutates_args=())
def l2norm_bwd_op(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return l2norm_backward(x.contiguous(), rstd.contiguous(), dy.to(torch.bfloat16).contiguous())


@l2norm_bwd_op.register_fake
def _(x, rstd, dy):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    x, _ = inputs
    ctx.save_for_backward(x, output[1])
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dy, _):
    x, rstd = ctx.saved_tensors
    return l2norm_bwd_op(x, rstd, dy), None


l2norm_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """Differentiable per-head L2 norm: x [..., 128] bf16 on a CUDA device (the kernel refuses others), any
    strides."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != HEAD_DIM:
        raise ValueError(f"x: expected shape [..., {HEAD_DIM}] (one head per row), got {list(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x: expected dtype torch.bfloat16, got {x.dtype}")
    if not is_real(eps):
        raise TypeError(f"eps: expected a number, got {type(eps).__name__}")
    if not float(eps) > 0:
        raise ValueError(f"eps: expected a positive number, got {eps}")
    return l2norm_fwd_op(x.contiguous(), float(eps))[0]
