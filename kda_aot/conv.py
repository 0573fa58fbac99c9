"""Causal conv1d (width 4) + SiLU on packed documents: kernel calls and the autograd op.

y[t, d] = silu(bias[d] + sum_j weight[d, j] x[t - 3 + j, d]); the window restarts at every
document start, where positions before it read the document's halo (context parallelism passes
the 3 tokens before a fragment) or zero. Same weight layout as flash-linear-attention's
`causal_conv1d` ([D, 4]).
"""
from __future__ import annotations

import torch

from . import registry
from ._tensor import describe, out_or, stream_of
from .packing import pack_tables

WIDTH = 4


def _checked_boundaries(x, weight, bias, halo, cu_seqlens):
    """Argument checks; returns the int32 device copy of cu_seqlens (kda_aot.packing)."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("halo", halo)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x: expected shape [1, T, D], got {list(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias), ("halo", halo)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: on {t.device} but x is on {x.device}")
    # validated on the host (CPU boundaries: no sync), device copy cached by value
    return pack_tables(cu_seqlens, x.shape[1], x.device).cu


def _f32(t):
    # Kernels take fp32 taps; a bf16/fp16 conv weight (a few KB) is widened per call.
    return None if t is None else t.detach().to(torch.float32).contiguous()


def conv1d_silu_forward(x, weight, bias, cu_seqlens, halo=None, *, out=None, form="default"):
    """Kernel call: y (bf16, [1, T, D]). `out` may be given (tests poison it)."""
    y = torch.empty_like(x) if out is None else out
    lib = registry.library("conv1d_silu_fwd", form)
    lib.launch(describe(x, "x"), describe(weight, "weight"), describe(bias, "bias"), describe(halo, "halo"),
               describe(cu_seqlens, "cu_seqlens"), describe(y, "y"), stream_of(x))
    return y


def conv1d_silu_backward(x, weight, bias, cu_seqlens, dy, halo=None, *, need_dhalo=False, out=None,
                         form="default"):
    """Kernel call: (dx bf16, dweight fp32 [D, 4], dbias fp32 [D] or None, dhalo fp32 [N, 3, D] or None).

    `out` may be a dict with any of dx, dweight, dbias, dhalo preallocated (tests poison them).
    """
    T, D = x.shape[1], x.shape[2]
    N = cu_seqlens.numel() - 1
    out = dict(out or {})
    dx = out_or(out, "dx", lambda: torch.empty_like(x))
    dweight = out_or(out, "dweight", lambda: torch.empty(D, WIDTH, device=x.device, dtype=torch.float32))
    dbias = (out_or(out, "dbias", lambda: torch.empty(D, device=x.device, dtype=torch.float32))
             if bias is not None else None)
    dhalo = None
    if need_dhalo and halo is not None:
        dhalo = out_or(out, "dhalo", lambda: torch.empty(N, 3, D, device=x.device, dtype=torch.float32))
    lib = registry.library("conv1d_silu_bwd", form)
    workspace = torch.empty(lib.workspace_floats(T, D), device=x.device, dtype=torch.float32)
    lib.launch(describe(x, "x"), describe(weight, "weight"), describe(bias, "bias"), describe(halo, "halo"),
               describe(cu_seqlens, "cu_seqlens"), describe(dy, "dy"), describe(dx, "dx"),
               describe(dweight, "dweight"), describe(dbias, "dbias"), describe(dhalo, "dhalo"),
               describe(workspace, "workspace"), stream_of(x))
    return dx, dweight, dbias, dhalo


class _Conv1dSilu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, halo, cu_seqlens, form):
        w32, b32 = _f32(weight), _f32(bias)
        y = conv1d_silu_forward(x, w32, b32, cu_seqlens, halo, form=form)
        ctx.save_for_backward(x, w32, b32, halo, cu_seqlens)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.form = form
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w32, b32, halo, cu_seqlens = ctx.saved_tensors
        need_dhalo = halo is not None and ctx.needs_input_grad[3]
        dx, dw, db, dh = conv1d_silu_backward(x, w32, b32, cu_seqlens, dy.contiguous(), halo, need_dhalo=need_dhalo,
                                              form=ctx.form)
        wdtype, bdtype = ctx.dtypes
        return (dx, dw.to(wdtype), None if db is None else db.to(bdtype),
                None if dh is None else dh.to(halo.dtype), None, None)


NORM_HEAD = 128  # the l2norm forms normalise 128-channel heads (one warp of 4-channel threads each)


def conv_form(x: torch.Tensor, l2norm: bool) -> str:
    """The conv record for x: "l2norm" (the per-head L2 norm fused; D a multiple of 128) or "default"."""
    if l2norm and (not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] % NORM_HEAD):
        raise ValueError(f"causal_conv1d_silu(l2norm=True): D must be a multiple of {NORM_HEAD} (heads of "
                         f"{NORM_HEAD} channels), got {x.shape[-1]}")
    return "l2norm" if l2norm else "default"


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       cu_seqlens: torch.Tensor, halo: torch.Tensor | None = None, l2norm: bool = False) -> torch.Tensor:
    """silu(causal_conv1d(x)) over packed documents, differentiable in x, weight, bias and halo.

    x: [1, T, D] bf16 (D a multiple of 8), weight: [D, 4], bias: [D] or None,
    cu_seqlens: int32/int64 [N + 1] document boundaries, on the CPU (no host sync: what a CUDA
    graph capture needs) or x's device, halo: [N, 3, D] bf16 or None (the 3
    tokens before each segment; zeros where a segment starts its document). Returns y [1, T, D] bf16.
    l2norm: y normalised per head of 128 channels in the same pass, y / sqrt(sum_head y^2 + 1e-6)
    (kda_aot.norm.L2NORM_EPS; the sum in fp32 before y is rounded) - PackedKDA's q and k.
    """
    form = conv_form(x, l2norm)
    cu = _checked_boundaries(x, weight, bias, halo, cu_seqlens)
    return _Conv1dSilu.apply(x, weight, bias, halo, cu, form)
