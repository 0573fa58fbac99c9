"""The KDA reference: the token-by-token recurrence, the chunked form, one chunk's intra-chunk
quantities, fragment summaries, and the helpers the explicit backward shares (kda_aot.reference)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from .._runtime.tensor import boundaries_tensor, check_cu_seqlens, check_kda_shapes, checked_scale

G_FLOOR = -1000.0  # chunk_prepare's floor of g: exp of anything through it underflows to 0, like exp(-inf)

CuSeqlens = Union[torch.Tensor, Sequence[int], None]


# ----------------------------------------------------------------------------- helpers

def _bounds(cu_seqlens: CuSeqlens, T: int) -> List[int]:
    """cu_seqlens as a validated python list (None = one document covering T)."""
    if cu_seqlens is None:
        return [0, T]
    return check_cu_seqlens(boundaries_tensor(cu_seqlens), T)


def _check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens: CuSeqlens) -> List[int]:
    """q, k [1, T, H, K]; v [1, T, HV, V], g [1, T, HV, K], beta [1, T, HV] and the states with HV heads, a
    multiple of H (grouped value heads), then the document bounds against T; returns the bounds."""
    HV = check_kda_shapes(q, k, v, g, beta, packed=True)
    cu = _bounds(cu_seqlens, q.shape[1])
    n_docs, K, V = len(cu) - 1, q.shape[3], v.shape[3]
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state: expected a torch.Tensor, got {type(initial_state).__name__}")
        if tuple(initial_state.shape) != (n_docs, HV, K, V):
            raise ValueError(f"initial_state: expected shape {[n_docs, HV, K, V]} ([N, HV, K, V]), "
                             f"got {list(initial_state.shape)}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state: on {initial_state.device} but q is on {q.device}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if not torch.compiler.is_compiling() and not bool((g <= 0).all()):  # (a compiled graph would break on it)
        raise ValueError("g: the log decay must be <= 0 everywhere (-inf resets a channel); got a positive or NaN "
                         "value")
    return cu


def _decay_matrix(Gam: torch.Tensor, strict: bool) -> torch.Tensor:
    """exp(Gam_i - Gam_j) for j < i (strict) or j <= i, zero elsewhere.  [H, C, C, K]

    Formed from the difference so every kept factor is <= 1 (g <= 0): no fp32 overflow.
    Masked entries are set to 0 *before* exp (not after), so neither the value nor its
    gradient ever sees exp(large positive) = inf (inf * 0 would give NaN).
    """
    C = Gam.shape[1]
    diff = Gam[:, :, None, :] - Gam[:, None, :, :]                 # [H, i, j, K]
    mask = torch.ones(C, C, dtype=torch.bool, device=Gam.device)
    mask = torch.tril(mask, diagonal=-1 if strict else 0)[None, :, :, None]
    return torch.where(mask, torch.exp(torch.where(mask, diff, torch.zeros_like(diff))),
                       torch.zeros_like(diff))


def _chunk_akk(k: torch.Tensor, Gam: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """L = Akk [H, C, C]: L_ij = beta_i sum_d k_id k_jd exp(Gam_id - Gam_jd) for j < i, else 0."""
    return beta[:, :, None] * torch.einsum("hid,hjd,hijd->hij", k, k, _decay_matrix(Gam, True))


def chunk_prepare(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  q: Optional[torch.Tensor] = None) -> dict:
    """Intra-chunk quantities of ONE chunk, head-first: k, g [H, C, K], v [H, C, V],
    beta [H, C], q [H, C, K] or None. No dtype change (caller upcasts).

    Returns a dict with
        Gam   [H, C, K]  in-chunk cumsum of g         gam  [H, K]  = Gam[:, -1]
        W     [H, C, K]  T (K * exp Gam)              U    [H, C, V]  T V
        Kg    [H, C, K]  K * exp(gam - Gam)           (the state-update keys)
        Aqk   [H, C, C]  tril incl. diagonal of sum_d q_id k_jd exp(Gam_id - Gam_jd)
                         (only when q is given)
    with T = (I + L)^-1 Diag(beta), L_ij = beta_i sum_d k_id k_jd exp(Gam_id - Gam_jd), j < i.
    """
    H, C, K = k.shape
    # Summed floored at -1000: any factor through such a token is exp(<= -1000) = 0 in fp64 and fp32, as
    # with -inf (a reset), so the chunked form is the recurrence for every g <= 0 without -inf - -inf.
    Gam = torch.cumsum(torch.clamp(g, min=G_FLOOR), dim=1)
    gam = Gam[:, -1, :]

    L = _chunk_akk(k, Gam, beta)
    eye = torch.eye(C, dtype=k.dtype, device=k.device).expand(H, C, C)
    # (I + L) X = Diag(beta) [K*exp Gam | V]  gives [W | U] in one unit-lower solve.
    rhs = beta[:, :, None] * torch.cat([k * torch.exp(Gam), v], dim=-1)
    WU = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
    out = {
        "Gam": Gam,
        "gam": gam,
        "W": WU[..., :K],
        "U": WU[..., K:],
        "Kg": k * torch.exp(gam[:, None, :] - Gam),
    }
    if q is not None:
        out["Aqk"] = torch.einsum("hid,hjd,hijd->hij", q, k, _decay_matrix(Gam, False))
    return out


def per_value_head(x: torch.Tensor, value_heads: int) -> torch.Tensor:
    """q or k [.., T, H, K] as each value head reads it: value head j reads head j // (HV / H) (a gather:
    the math is per value head; autograd sums each group's gradients)."""
    H = x.shape[-2]
    if value_heads == H:
        return x
    return x.index_select(-2, torch.arange(value_heads, device=x.device) // (value_heads // H))


def sum_value_head_groups(dx: torch.Tensor, heads: int) -> torch.Tensor:
    """per_value_head's adjoint: dq or dk [1, T, HV, K] per value head summed over each group -> [1, T, H, K]
    (dx itself without grouping). Also kda_bwd_gate's bf16 dq, dk: torch's sum accumulates in fp32 and rounds
    once, with no atomics, and a group this short is summed by one thread in a fixed order whatever the other
    dims (so the replay's head groups give the saved mode's bits: tested on the GPU)."""
    HV = dx.shape[2]
    if HV == heads:
        return dx
    return dx.reshape(*dx.shape[:2], heads, HV // heads, dx.shape[3]).sum(3)


def _to_head_first(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """[1, T, H, *] token slice [a, b) -> [H, b-a, *]."""
    return x[0, a:b].transpose(0, 1)


# ----------------------------------------------------------------------------- KDA

def _tokens(outs: list, join, H: int, V: int, dtype, device) -> torch.Tensor:
    """The per-token (or per-chunk) outputs joined along tokens into [1, T, H, V]; [1, 0, H, V] for a pack of
    empty documents (T = 0), which joins nothing."""
    if not outs:
        return torch.zeros(1, 0, H, V, dtype=dtype, device=device)
    return join(outs, dim=0)[None]


CHUNKED_DTYPES = (torch.float64, torch.float32)  # the chunked forms' triangular solve has no half-precision kernel


def _prepared(q, k, v, g, beta, cu_seqlens, scale, initial_state, dtype, detach=False, chunked=True) -> tuple:
    """What every entry point of the reference starts with: the checked document bounds, (q, k per value head, v,
    g, beta, the initial state or None) in `dtype` (detached with `detach`), and the scale (K^-0.5 by default;
    else a finite real number, as the ops take it). chunked: the caller is a chunked form (CHUNKED_DTYPES)."""
    if chunked and dtype not in CHUNKED_DTYPES:
        raise TypeError(f"dtype: the chunked reference computes in torch.float64 or torch.float32, got {dtype} "
                        f"(kda_recurrent takes any float dtype)")
    cu = _check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    HV, K = v.shape[2], q.shape[3]
    q, k = per_value_head(q, HV), per_value_head(k, HV)
    cast = (lambda x: x.detach().to(dtype)) if detach else (lambda x: x.to(dtype))
    tensors = tuple(cast(x) for x in (q, k, v, g, beta)) + (None if initial_state is None else cast(initial_state),)
    return cu, tensors, checked_scale(scale, K)


def kda_recurrent(q, k, v, g, beta, *, cu_seqlens: CuSeqlens = None, scale: Optional[float] = None,
                  initial_state: Optional[torch.Tensor] = None,
                  output_final_state: bool = False,
                  dtype: torch.dtype = torch.float64
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token-by-token KDA recurrence. Returns (o [1, T, HV, V], final_state [N, HV, K, V] or None),
    both in `dtype` (q, k [1, T, H, K]; HV a multiple of H). Vectorised over heads, loops over documents and
    tokens."""
    cu, (q, k, v, g, beta, h0), scale = _prepared(q, k, v, g, beta, cu_seqlens, scale, initial_state, dtype,
                                                  chunked=False)
    H, K, V = v.shape[2], q.shape[3], v.shape[3]

    outs, finals = [], []
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        S = (torch.zeros(H, K, V, dtype=dtype, device=q.device) if h0 is None else h0[n])
        for t in range(a, b):
            qt, kt, vt, gt, bt = q[0, t], k[0, t], v[0, t], g[0, t], beta[0, t]
            S = torch.exp(gt)[:, :, None] * S                                  # Diag(exp g) S
            # (I - b k k^T) S + b k v^T  =  S + b k (v - S^T k)^T
            err = vt - torch.einsum("hk,hkv->hv", kt, S)
            S = S + bt[:, None, None] * kt[:, :, None] * err[:, None, :]
            outs.append(scale * torch.einsum("hk,hkv->hv", qt, S))
        finals.append(S)
    o = _tokens(outs, torch.stack, H, V, dtype, q.device)                       # [1, T, H, V]
    return o, (torch.stack(finals, dim=0) if output_final_state else None)


def chunk_step(p: dict, Qc: torch.Tensor, S: torch.Tensor, scale: float) -> tuple:
    """One chunk of the walk from chunk_prepare's p (head-first, [H, C, *]) and the state S [H, K, V] at its start:
    (V' = U - W S, Qg = Q e^Gam, O = scale (Qg S + Aqk V'), the next state e^gam S + Kg^T V'), docs/math.md."""
    Vp = p["U"] - p["W"] @ S
    Qg = Qc * torch.exp(p["Gam"])
    return Vp, Qg, scale * (Qg @ S + p["Aqk"] @ Vp), torch.exp(p["gam"])[:, :, None] * S + p["Kg"].transpose(1, 2) @ Vp


def kda_chunked(q, k, v, g, beta, *, cu_seqlens: CuSeqlens = None, scale: Optional[float] = None,
                initial_state: Optional[torch.Tensor] = None,
                output_final_state: bool = False, chunk_size: int = 64,
                dtype: torch.dtype = torch.float64
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunked KDA exactly as docs/math.md. Chunks restart at every document start; a
    document's last chunk may be short. Same arguments and results as kda_recurrent (dtype fp64 or fp32)."""
    cu, (q, k, v, g, beta, h0), scale = _prepared(q, k, v, g, beta, cu_seqlens, scale, initial_state, dtype)
    H, K, V = v.shape[2], q.shape[3], v.shape[3]

    outs, finals = [], []
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        S = (torch.zeros(H, K, V, dtype=dtype, device=q.device) if h0 is None else h0[n])
        for c0 in range(a, b, chunk_size):
            c1 = min(c0 + chunk_size, b)
            Qc = _to_head_first(q, c0, c1)
            Kc = _to_head_first(k, c0, c1)
            Vc = _to_head_first(v, c0, c1)
            Gc = _to_head_first(g, c0, c1)
            Bc = beta[0, c0:c1].transpose(0, 1)
            _, _, Oc, S = chunk_step(chunk_prepare(Kc, Vc, Gc, Bc, q=Qc), Qc, S, scale)
            outs.append(Oc.transpose(0, 1))                                     # [C, H, V]
        finals.append(S)
    o = _tokens(outs, torch.cat, H, V, dtype, q.device)
    return o, (torch.stack(finals, dim=0) if output_final_state else None)


def fragment_summary(k, v, g, beta, chunk_size: int = 64, dtype: torch.dtype = torch.float64
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Affine summary of ONE fragment (a run of tokens of one document; chunks restart at
    the fragment start). k [L, Hk, K] (Hk dividing H: grouped value heads), g [L, H, K], v [L, H, V], beta [L, H].

    Returns M [H, K, K] = A_n ... A_1 and B [H, K, V] = end state walked from zero, so that
    S_out = M S_in + B. Per chunk A_c = Diag(exp gam) - (K*exp(gam-Gam))^T W and
    B_c = (K*exp(gam-Gam))^T U (docs/math.md).
    """
    Lf, H, K = g.shape
    V = v.shape[-1]
    k = per_value_head(k, H)
    k, v, g, beta = (x.to(dtype) for x in (k, v, g, beta))
    M = torch.eye(K, dtype=dtype, device=k.device).repeat(H, 1, 1)   # empty fragment: M = I, B = 0
    B = torch.zeros(H, K, V, dtype=dtype, device=k.device)
    for c0 in range(0, Lf, chunk_size):
        c1 = min(c0 + chunk_size, Lf)
        p = chunk_prepare(k[c0:c1].transpose(0, 1), v[c0:c1].transpose(0, 1),
                          g[c0:c1].transpose(0, 1), beta[c0:c1].transpose(0, 1))
        KgT = p["Kg"].transpose(1, 2)
        A = torch.diag_embed(torch.exp(p["gam"])) - KgT @ p["W"]
        M = A @ M
        B = A @ B + KgT @ p["U"]
    return M, B


