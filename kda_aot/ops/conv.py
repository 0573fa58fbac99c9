"""Causal conv1d (width 4) + SiLU on packed documents: kernel calls and the autograd op.

y[t, d] = silu(bias[d] + sum_j weight[d, j] x[t - 3 + j, d]); the window restarts at every
document start, where positions before it read the document's halo (context parallelism passes
the 3 tokens before a fragment) or zero. Same weight layout as flash-linear-attention's
`causal_conv1d` ([D, 4]).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from .._runtime import registry
from .._runtime.tensor import (boundaries_tensor, check_cu_seqlens, checked_flag, describe, out_or, require_cuda,
                               stream_of)
from .._runtime.packing import CONV_WIDTH, HEAD_DIM, PLANNED_FROM_HOST, pack_tables


def _check(x, weight, bias, halo, cu_seqlens):
    """Argument checks that need only types, shapes and devices (the values of cu_seqlens and everything
    else are checked by the op: pack_tables, then the bindings, before any kernel runs)."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("halo", halo), ("cu_seqlens", cu_seqlens)):
        if (t is not None or name in ("x", "weight", "cu_seqlens")) and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f"x: expected shape [1, T, D] (packed documents), got {list(x.shape)}")
    # the binding's own checks of x, weight and bias, here too: with no token (T = 0) no binding runs
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x: expected dtype bfloat16, got {str(x.dtype).replace('torch.', '')}")
    D = x.shape[2]
    if D < 1 or D % 8:
        raise ValueError(f"x: D must be a positive multiple of 8 (16-byte rows), got {D}")
    for name, t in (("weight", weight), ("bias", bias)):  # any float: the kernels take them widened to fp32
        if t is not None and not t.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating-point dtype (float32, bfloat16, ...), got {t.dtype}")
    if tuple(weight.shape) != (D, CONV_WIDTH):
        raise ValueError(f"weight: expected shape [D, 4] = [{D}, {CONV_WIDTH}] (width-4 causal conv), got "
                         f"{list(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"bias: expected shape [D] = [{D}], got {list(bias.shape)}")
    if halo is not None and halo.dtype != torch.bfloat16:
        raise TypeError(f"halo: expected dtype bfloat16, got {str(halo.dtype).replace('torch.', '')}")
    for name, t in (("weight", weight), ("bias", bias), ("halo", halo)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: on {t.device} but x is on {x.device}")


def _f32(t):
    # Kernels take fp32 taps; a bf16/fp16 conv weight (a few KB) is widened per call.
    return None if t is None else t.detach().to(torch.float32).contiguous()


def checked_boundaries(x, weight, bias, halo, cu_seqlens) -> torch.Tensor:
    """The kernel calls' int32 device boundaries of a pack with no zero-length document (the halo has a
    row per segment; causal_conv1d_silu maps documents to segments)."""
    _check(x, weight, bias, halo, cu_seqlens)
    tables = pack_tables(cu_seqlens, x.shape[1], x.device)
    if tables.kept_index is not None:
        raise ValueError("cu_seqlens: the conv kernel calls take no zero-length document (causal_conv1d_silu does)")
    return tables.cu


def conv1d_silu_forward(x, weight, bias, cu_seqlens, halo=None, *, out=None, form="default"):
    """Kernel call: y (bf16, [1, T, D]). `out` may be given (tests poison it)."""
    y = torch.empty_like(x) if out is None else out
    lib = registry.library("conv1d_silu_fwd", form, x.device)
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
    dweight = out_or(out, "dweight", lambda: torch.empty(D, CONV_WIDTH, device=x.device, dtype=torch.float32))
    dbias = (out_or(out, "dbias", lambda: torch.empty(D, device=x.device, dtype=torch.float32))
             if bias is not None else None)
    dhalo = None
    if need_dhalo and halo is not None:
        dhalo = out_or(out, "dhalo", lambda: torch.empty(N, 3, D, device=x.device, dtype=torch.float32))
    lib = registry.library("conv1d_silu_bwd", form, x.device)
    workspace = torch.empty(lib.workspace_floats(T, D), device=x.device, dtype=torch.float32)
    lib.launch(describe(x, "x"), describe(weight, "weight"), describe(bias, "bias"), describe(halo, "halo"),
               describe(cu_seqlens, "cu_seqlens"), describe(dy, "dy"), describe(dx, "dx"),
               describe(dweight, "dweight"), describe(dbias, "dbias"), describe(dhalo, "dhalo"),
               describe(workspace, "workspace"), stream_of(x))
    return dx, dweight, dbias, dhalo


def check_halo_rows(halo, n_docs: int, D: int) -> None:
    """A halo of a row per document (before the op maps documents to the kernels' segments)."""
    if halo is not None and tuple(halo.shape) != (n_docs, CONV_WIDTH - 1, D):
        raise ValueError(f"halo: expected shape [N, 3, D] = [{n_docs}, {CONV_WIDTH - 1}, {D}] (the 3 tokens before "
                         f"each document), got {list(halo.shape)}")


def _segments(x, halo, cu_seqlens):
    """(the pack's tables, halo rows of its segments): the kernels see the non-empty documents only."""
    tables = pack_tables(cu_seqlens, x.shape[1], x.device)
    check_halo_rows(halo, tables.n_docs, x.shape[2])
    return tables, tables.segment_rows(None if halo is None else halo.contiguous())


@torch.library.custom_op("kda_aot::causal_conv1d_silu_fwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def conv1d_silu_fwd_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], halo: Optional[torch.Tensor],
                       cu_seqlens: torch.Tensor, form: str) -> torch.Tensor:
    tables, halo = _segments(x, halo, cu_seqlens)
    if tables.n_segments == 0:  # T = 0: every document is empty, nothing to launch (the binding's checks do not run)
        require_cuda(x, "x", "causal_conv1d_silu")  # a CPU call is refused at T = 0 too (at T > 0: the binding)
        return x.new_empty(x.shape)
    return conv1d_silu_forward(x.contiguous(), _f32(weight), _f32(bias), tables.cu, halo, form=form)


@conv1d_silu_fwd_op.register_fake
def _(x, weight, bias, halo, cu_seqlens, form):
    return x.new_empty(x.shape)


@torch.library.custom_op("kda_aot::causal_conv1d_silu_bwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def conv1d_silu_bwd_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], halo: Optional[torch.Tensor],
                       cu_seqlens: torch.Tensor, dy: torch.Tensor, form: str, need_dhalo: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias or [0], dhalo or [0]) in the dtypes of x, weight, bias and halo."""
    tables, seg_halo = _segments(x, halo, cu_seqlens)
    if tables.n_segments == 0:  # T = 0: no token, zero gradients
        require_cuda(x, "x", "causal_conv1d_silu")
        return (x.new_empty(x.shape), weight.new_zeros(weight.shape),
                x.new_empty((0,)) if bias is None else bias.new_zeros(bias.shape),
                halo.new_zeros(halo.shape) if need_dhalo and halo is not None else x.new_empty((0,)))
    dx, dw, db, dh = conv1d_silu_backward(x.contiguous(), _f32(weight), _f32(bias), tables.cu,
                                          dy.to(x.dtype).contiguous(), seg_halo,
                                          need_dhalo=need_dhalo and halo is not None, form=form)
    return (dx, dw.to(weight.dtype), x.new_empty((0,)) if db is None else db.to(bias.dtype),
            x.new_empty((0,)) if dh is None else tables.document_rows(dh).to(halo.dtype))


@conv1d_silu_bwd_op.register_fake
def _(x, weight, bias, halo, cu_seqlens, dy, form, need_dhalo):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape),
            x.new_empty((0,)) if bias is None else bias.new_empty(bias.shape),
            halo.new_empty(halo.shape) if need_dhalo and halo is not None else x.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    x, weight, bias, halo, cu_seqlens, form = inputs
    ctx.save_for_backward(x, weight, bias, halo, cu_seqlens)
    ctx.form = form


def _backward(ctx, dy):
    x, weight, bias, halo, cu_seqlens = ctx.saved_tensors
    need_dhalo = halo is not None and ctx.needs_input_grad[3]
    dx, dw, db, dh = conv1d_silu_bwd_op(x, weight, bias, halo, cu_seqlens, dy, ctx.form, need_dhalo)
    return dx, dw, db if bias is not None else None, dh if need_dhalo else None, None, None


conv1d_silu_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def conv_form(x: torch.Tensor, l2norm: bool) -> str:
    """The conv record for x: "l2norm" (the per-head L2 norm fused; D a multiple of 128) or "default"."""
    l2norm = checked_flag("l2norm", l2norm)
    if l2norm and (not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] % HEAD_DIM):
        raise ValueError(f"causal_conv1d_silu(l2norm=True): D must be a multiple of {HEAD_DIM} (heads of "
                         f"{HEAD_DIM} channels), got {x.shape[-1]}")
    return "l2norm" if l2norm else "default"


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       cu_seqlens: torch.Tensor, halo: torch.Tensor | None = None, l2norm: bool = False) -> torch.Tensor:
    """silu(causal_conv1d(x)) over packed documents, differentiable in x, weight, bias and halo.

    x: [1, T, D] bf16 (D a multiple of 8), weight: [D, 4] and bias: [D] or None, any float dtype (widened to
    fp32 for the kernels; their gradients come back in their own dtypes),
    cu_seqlens: int32/int64 [N + 1] document boundaries, on the CPU (no host sync: what a CUDA
    graph capture needs) or x's device, or a list of ints, halo: [N, 3, D] bf16 or None (the 3
    tokens before each segment; zeros where a segment starts its document). Returns y [1, T, D] bf16.
    l2norm: y normalised per head of 128 channels in the same pass, y / sqrt(sum_head y^2 + 1e-6)
    (kda_aot.reference.L2NORM_EPS; the sum in fp32 before y is rounded) - PackedKDA's q and k.
    """
    cu_seqlens = boundaries_tensor(cu_seqlens)
    _check(x, weight, bias, halo, cu_seqlens)
    form = conv_form(x, l2norm)
    # Off the GPU, the refusal names the CPU counterpart after the checks the op makes first (the boundaries'
    # values, the halo's rows); traced, the op's binding refuses.
    if not x.is_cuda and not torch.compiler.is_compiling() and not is_fake(x):
        if cu_seqlens.device.type == "cpu":
            check_halo_rows(halo, len(check_cu_seqlens(cu_seqlens, x.shape[1])) - 1, x.shape[2])
        require_cuda(x, "x", "causal_conv1d_silu")
    return conv1d_silu_fwd_op(x, weight, bias, halo, cu_seqlens, form)
