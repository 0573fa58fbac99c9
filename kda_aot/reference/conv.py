"""The conv reference: width-4 causal depthwise conv + SiLU over packed documents, and its
backward written out (kda_aot.reference)."""
from __future__ import annotations

from typing import Optional

import torch

from .._runtime.packing import CONV_WIDTH
from .kda import CuSeqlens, _bounds


# ----------------------------------------------------------------------------- conv1d

def conv1d_silu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                cu_seqlens: CuSeqlens = None, halo: Optional[torch.Tensor] = None,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Causal depthwise conv (width 4) + SiLU over packed documents.

    x [1, T, D], weight [D, 4], bias [D] or None, halo [N, 3, D] or None.
    y[t, d] = silu(bias[d] + sum_j weight[d, j] * x[t-3+j, d]); positions before the start
    s of t's segment read 0, or halo[n, p] for position s-3+p when halo is given.
    Returns y [1, T, D] in `dtype`.
    """
    if x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f"x must be [1, T, D], got {tuple(x.shape)}")
    T, D = x.shape[1], x.shape[2]
    W = CONV_WIDTH
    if tuple(weight.shape) != (D, W):
        raise ValueError(f"weight must be {(D, W)}, got {tuple(weight.shape)}")
    cu = _bounds(cu_seqlens, T)
    N = len(cu) - 1
    if halo is not None and tuple(halo.shape) != (N, W - 1, D):
        raise ValueError(f"halo must be {(N, W - 1, D)}, got {tuple(halo.shape)}")
    x, weight = x.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    halo = None if halo is None else halo.to(dtype)

    ys = []
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        pre = (torch.zeros(W - 1, D, dtype=dtype, device=x.device) if halo is None
               else halo[n])
        xp = torch.cat([pre, x[0, a:b]], dim=0)                                 # [L+3, D]
        L = b - a
        acc = sum(weight[:, j] * xp[j:j + L] for j in range(W))                 # [L, D]
        if bias is not None:
            acc = acc + bias
        ys.append(torch.nn.functional.silu(acc))
    return torch.cat(ys, dim=0)[None]


def conv1d_silu_bwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dy: torch.Tensor, *,
                    cu_seqlens: CuSeqlens = None, halo: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float64):
    """conv1d_silu's backward written out (no autograd): (dx [1, T, D], dweight [D, 4], dbias [D] or None,
    dhalo [N, 3, D] or None), all in `dtype`. Per document, with xp = [halo or 0; x] and
    a_t = bias + sum_j w_j xp_{t+j}: da = dy silu'(a), dw_j = sum_t da_t xp_{t+j}, dxp_{t+j} += w_j da_t."""
    T, D = x.shape[1], x.shape[2]
    W = CONV_WIDTH
    cu = _bounds(cu_seqlens, T)
    x, weight, dy = x.to(dtype), weight.to(dtype), dy.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    dx = torch.zeros(T, D, dtype=dtype, device=x.device)
    dw = torch.zeros(D, W, dtype=dtype, device=x.device)
    db = None if bias is None else torch.zeros(D, dtype=dtype, device=x.device)
    dhalo = None if halo is None else torch.zeros(len(cu) - 1, W - 1, D, dtype=dtype, device=x.device)
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        pre = (torch.zeros(W - 1, D, dtype=dtype, device=x.device) if halo is None else halo[n].to(dtype))
        xp = torch.cat([pre, x[0, a:b]], dim=0)
        L = b - a
        acc = sum(weight[:, j] * xp[j:j + L] for j in range(W))
        if bias is not None:
            acc = acc + bias
        sig = torch.sigmoid(acc)
        da = dy[0, a:b] * sig * (1 + acc * (1 - sig))
        dxp = torch.zeros(L + W - 1, D, dtype=dtype, device=x.device)
        for j in range(W):
            dw[:, j] += (da * xp[j:j + L]).sum(0)
            dxp[j:j + L] += weight[:, j] * da
        if db is not None:
            db += da.sum(0)
        dx[a:b] = dxp[W - 1:]
        if dhalo is not None:
            dhalo[n] = dxp[:W - 1]
    return dx[None], dw, db, dhalo


