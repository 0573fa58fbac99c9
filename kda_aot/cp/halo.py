"""The conv halo under context parallelism: the 3 tokens before each local fragment.

The width-4 causal conv of a fragment that does not start its document reads the 3 tokens
before it, which live on other ranks (possibly several: a predecessor fragment may be shorter
than 3 tokens). Any token a halo needs is among the last 3 tokens of the fragment that holds
it (it lies within 3 tokens before a later fragment's start, hence within 3 tokens of its own
fragment's end), so every rank publishes the last min(3, length) tokens of each of its
fragments that is followed by another fragment of its document ("tails"), one all_gather, and
every rank assembles its halos from the table. The backward sends each halo row's gradient
back the same way (one all_gather of the halo gradients) and each owner adds what lands on its
tail tokens to their gradient.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from ..reference import CONV_WIDTH
from .exchange import check_agreement, exchange
from .plan import CPPlan, Fragment

__all__ = ["conv_halo", "conv1d_silu_cp"]

HALO = CONV_WIDTH - 1


def _sources(plan: CPPlan, f: Fragment) -> List[Tuple[int, Fragment, int]]:
    """For local fragment f: (halo row j, source fragment, token offset in the source) for
    each of the HALO positions before f that lie inside its document. Walks back over as many
    fragments (and ranks) as needed; positions before the document start are left out (0)."""
    out = []
    if not f.needs_state:
        return out
    doc_start = plan.cu_seqlens[f.doc]
    for j in range(HALO):
        p = f.start - HALO + j
        if p < doc_start:
            continue
        e = plan.previous(f)
        while e.start > p:
            e = plan.previous(e)
        out.append((j, e, p - e.start))
    return out


def _tail_slot(e: Fragment, offset: int) -> int:
    """Where token `offset` of fragment e sits in e's published tail (right-aligned)."""
    return HALO - (e.length - offset)


class _ConvHalo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan: CPPlan, group):
        D = x.shape[-1]
        local = plan.local_fragments
        size_of = lambda f: 0 if f.is_last else HALO * D
        items = {}
        for f in local:
            if not f.is_last:
                tail = x.new_full((HALO, D), float("nan"))     # slots before f: never read
                n = min(HALO, f.length)
                tail[HALO - n:] = x[0, f.local_start + f.length - n:f.local_start + f.length]
                items[f.index] = tail
        published = exchange(plan, group, size_of, items, x.dtype, like=x)
        halo = x.new_zeros(len(local), HALO, D)
        for f in local:
            for j, e, off in _sources(plan, f):
                halo[f.segment, j] = published[e.index].view(HALO, D)[_tail_slot(e, off)]
        ctx.cfg = (plan, group, tuple(x.shape))
        return halo

    @staticmethod
    def backward(ctx, dhalo):
        plan, group, xshape = ctx.cfg
        D = xshape[-1]
        local = plan.local_fragments
        size_of = lambda f: HALO * D if f.needs_state else 0
        items = {f.index: dhalo[f.segment] for f in local if f.needs_state}
        published = exchange(plan, group, size_of, items, dhalo.dtype, like=dhalo)
        dx = dhalo.new_zeros(xshape)
        mine = {f.index: f for f in local}
        # Visit the halo rows of every rank in table order: a fixed summation order, so the
        # result does not depend on which rank computes it.
        for g in plan.fragments:
            for j, e, off in _sources(plan, g):
                if e.index in mine:
                    dx[0, e.local_start + off] += published[g.index].view(HALO, D)[j]
        return dx, None, None


def conv_halo(x_local: torch.Tensor, plan: CPPlan, group=None) -> torch.Tensor:
    """Collective, differentiable: the conv halo of this rank's local fragments.

    x_local: [1, T_local, D] (tokens in plan.token_map order). Returns halo [n_local, 3, D]
    (x's dtype), row i for local segment i: the 3 tokens before the fragment, zero before its
    document's start (a fragment that starts its document gets zeros). Then
        reference.conv1d_silu(x_local, w, b, cu_seqlens=plan.local_cu_seqlens, halo=halo)
    equals the single-device conv on this rank's tokens, and the halo's gradient flows back
    to the ranks that own those tokens in the backward, which is collective as well: the halo
    must reach the loss on EVERY rank, including a rank that holds no token (whose halo is
    [0, 3, D] and which has no segment to convolve: see conv1d_silu_cp, which handles it).
    """
    problem = None
    if not isinstance(x_local, torch.Tensor):
        raise TypeError(f"x_local: expected a torch.Tensor, got {type(x_local).__name__}")
    if x_local.dim() != 3 or x_local.shape[0] != 1 or x_local.shape[1] != plan.num_local_tokens:
        problem = (f"x_local must be [1, {plan.num_local_tokens}, D] for rank {plan.rank}, "
                   f"got {list(x_local.shape)}")
    facts = {"D": x_local.shape[-1] if x_local.dim() else None, "dtype": x_local.dtype}
    group, _, _ = check_agreement("conv_halo", plan, group, facts, problem, x_local)
    return _ConvHalo.apply(x_local, plan, group)


def conv1d_silu_cp(x_local: torch.Tensor, weight: torch.Tensor, bias=None, *, plan: CPPlan,
                   group=None, conv=None, dtype=None) -> torch.Tensor:
    """Collective, differentiable: the causal conv1d + SiLU of this rank's tokens under CP.

    conv_halo + conv(x_local, weight, bias, local cu_seqlens, halo), where conv defaults to
    reference.conv1d_silu in `dtype` (default: x's dtype) and may be any function with that
    signature (the CUDA op). A rank that holds no token returns an empty [1, 0, D] result that
    still depends on the halo and the parameters, so that its (collective) halo backward runs
    like everyone else's and its parameter gradients are zeros rather than None.
    """
    from ..reference import conv1d_silu
    halo = conv_halo(x_local, plan, group)
    if not plan.local_fragments:
        keep = halo.sum() + weight.sum() + (0 if bias is None else bias.sum())
        return x_local * 0 + keep.to(x_local.dtype) * 0
    if conv is None:
        return conv1d_silu(x_local, weight, bias, cu_seqlens=plan.local_cu_seqlens, halo=halo,
                           dtype=x_local.dtype if dtype is None else dtype)
    return conv(x_local, weight, bias, plan.local_cu_seqlens, halo)
