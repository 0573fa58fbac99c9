"""The chunked KDA forward keeping every per-chunk tensor, and its explicit backward (no autograd),
in the stages the kernels split it into (kda_aot.reference)."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .kda import (CuSeqlens, _check_kda_inputs, _chunk_akk, _decay_matrix, _prepared, _to_head_first, chunk_prepare,
                  chunk_step, per_value_head, sum_value_head_groups)

# ============================================================================ KDA explicit backward
#
# Everything below is the chunked KDA backward written out by hand (no autograd inside), in the
# shape a GPU implementation takes. Notation per chunk and head (rows i, j = 1..C of the chunk,
# d = key channel, E_ijd = exp(Gam_id - Gam_jd), only ever for j <= i so E <= 1):
#
#   forward (what kda_chunked_fwd_saved keeps)
#     Gam = cumsum_rows(g)          gam = Gam_C
#     G_ij = sum_d k_id k_jd E_ijd (j < i)      Akk = L = Diag(beta) G       Akk_inv = (I + L)^-1
#     Rk = Diag(beta) (K * e^Gam)   Rv = Diag(beta) V      W = Akk_inv Rk     U = Akk_inv Rv
#     Aqk_ij = sum_d q_id k_jd E_ijd (j <= i)
#     Qg = Q * e^Gam                Kg = K * e^(gam - Gam)
#     v_new = U - W S               (S: state at the chunk START, the state tape)
#     O = scale (Qg S + Aqk v_new)  S_end = Diag(e^gam) S + Kg^T v_new
#
#   backward, dS_end = dL/dS_end (the gradient tape), dO = dL/dO
#   (a) reverse walk, per (document, head), last chunk first; dS_end of a document's last chunk
#       is dfinal_state (or 0); the dS of its first chunk's start is d_initial_state:
#     dVp = dVp_loc + Kg dS_end,    dVp_loc = scale Aqk^T dO   (chunk-parallel, precomputed)
#     dS  = Diag(e^gam) dS_end + scale Qg^T dO - W^T dVp        -> dS_end of the previous chunk
#         = A_c^T dS_end + D_c   with A_c = Diag(e^gam) - Kg^T W (the forward's affine map) and
#           D_c = scale Qg^T dO - W^T dVp_loc  (fragment backward summaries: dS_in = M^T dS_out + D)
#   (b) chunk-parallel, from (saved, S, dS_end, dO):
#     dVp  = scale Aqk^T dO + Kg dS_end                   (= dU; recomputed, or written by the walk)
#     dAqk = scale tril(dO v_new^T)     dQg = scale dO S^T     dKg = v_new dS_end^T
#     dW   = -dVp S^T                   dRk = Akk_inv^T dW     dRv = Akk_inv^T dVp
#     dAkk = -tril_strict(dRk W^T + dRv U^T)                  (gradient of L)
#     gated products:  rows(M, Y)_i = sum_{j<=i} M_ij (Y_j * E_ij)
#                      cols(M, X)_j = sum_{i>=j} M_ij (X_i * E_ij)      (see the anchoring below)
#     dk_g = dKg * e^(gam-Gam)    dk_R = Diag(beta) dRk * e^Gam    dk_q = cols(dAqk, Q)
#     dk_Lr = Diag(beta) rows(dAkk, K)     dk_Lc = cols(Diag(beta) dAkk, K)
#     dq    = dQg * e^Gam + rows(dAqk, K)
#     dk    = dk_g + dk_R + dk_q + dk_Lr + dk_Lc
#     dv    = Diag(beta) dRv
#     dbeta = rowsum(K * (dRk * e^Gam + rows(dAkk, K))) + rowsum(V * dRv)
#     dGam  = Q * dq' + K * (dk_R + dk_Lr - dk_Lc - dk_q')   (' : without dAqk's diagonal, whose
#             two copies cancel)
#     dg_t  = e^gam rowsum(S * dS_end) + sum_{r < t} Kg_r * dKg_r + sum_{r >= t} dGam_r
#             (Kg dKg through e^(gam - Gam_r) reaches rows after r: a prefix, not total minus suffix)
#
# docs/math.md's walk is complete once its "local term from dO" is read as scale Aqk^T dO
# (Aqk lower triangular including the diagonal).
#
# Anchoring (fp32 safety; the kernels copy this). No exp factor above 1 is ever formed, and
# nothing is exp(Gam_i) * exp(-Gam_j) across a chunk. The chunk's rows are cut into sub-chunks
# of _SUB = 16 rows. For rows(M, Y) and a sub-chunk I = [i0, i1):
#     off-diagonal part (j < i0), anchor a = i0 (first row of I):
#         rows_I += e^(Gam_I - Gam_a) * ( M[I, :i0] @ (Y[:i0] * e^(Gam_a - Gam[:i0])) )
#     both factors <= 1 because j < a <= i and g <= 0;
#     diagonal sub-block (i0 <= j <= i < i1): element-wise E_ijd (a [16, 16, K] block; in a
#     kernel a loop over j), masked before the exp.
# For cols(M, X) and a sub-chunk J = [j0, j1):
#     off-diagonal part (i >= j1), anchor b = j1 - 1 (last row of J):
#         cols_J += e^(Gam_b - Gam_J) * ( M[j1:, J]^T @ (X[j1:] * e^(Gam[j1:] - Gam_b)) )
#     diagonal sub-block element-wise as above.
# Merging all earlier sub-chunks into one product per anchor is exact; where a factor
# underflows to 0 (fp32, strong decay) the true product is smaller still, so nothing is lost
# beyond fp32 rounding of numbers below ~1e-38.
# The forward grams (Aqk, G) have the same structure (gram(X, Y)_IJ = (X_I e^(Gam_I-Gam_a))
# (Y_J e^(Gam_a-Gam_J))^T with a = first row of I, diagonal blocks element-wise): see
# _gated_gram. Everything else uses e^Gam, e^(gam-Gam), e^gam, all <= 1.

_SUB = 16


def _sub_chunks(C: int, sub: int = _SUB) -> List[Tuple[int, int]]:
    return [(s, min(s + sub, C)) for s in range(0, C, sub)]


def _gated_rows(M: torch.Tensor, Y: torch.Tensor, Gam: torch.Tensor, sub: int = _SUB
                ) -> torch.Tensor:
    """rows(M, Y)_id = sum_{j <= i} M_ij Y_jd exp(Gam_id - Gam_jd).  M [H, C, C] (entries above
    the diagonal are ignored), Y, Gam [H, C, K] -> [H, C, K]. Anchored per 16-row sub-chunk."""
    outs = []
    for i0, i1 in _sub_chunks(M.shape[1], sub):
        Gi = Gam[:, i0:i1]
        acc = torch.einsum("hij,hjd,hijd->hid", M[:, i0:i1, i0:i1], Y[:, i0:i1],
                           _decay_matrix(Gi, strict=False))
        if i0 > 0:
            Ga = Gam[:, i0:i0 + 1]                                   # anchor: first row of I
            Yj = Y[:, :i0] * torch.exp(Ga - Gam[:, :i0])             # factors <= 1 (j < a)
            acc = acc + torch.exp(Gi - Ga) * (M[:, i0:i1, :i0] @ Yj)  # factors <= 1 (i >= a)
        outs.append(acc)
    return torch.cat(outs, dim=1)


def _gated_cols(M: torch.Tensor, X: torch.Tensor, Gam: torch.Tensor, sub: int = _SUB
                ) -> torch.Tensor:
    """cols(M, X)_jd = sum_{i >= j} M_ij X_id exp(Gam_id - Gam_jd).  M [H, C, C] (entries above
    the diagonal are ignored), X, Gam [H, C, K] -> [H, C, K]. Anchored per 16-row sub-chunk."""
    C = M.shape[1]
    outs = []
    for j0, j1 in _sub_chunks(C, sub):
        Gj = Gam[:, j0:j1]
        acc = torch.einsum("hij,hid,hijd->hjd", M[:, j0:j1, j0:j1], X[:, j0:j1],
                           _decay_matrix(Gj, strict=False))
        if j1 < C:
            Gb = Gam[:, j1 - 1:j1]                                   # anchor: last row of J
            Xi = X[:, j1:] * torch.exp(Gam[:, j1:] - Gb)             # factors <= 1 (i > b)
            acc = acc + torch.exp(Gb - Gj) * (M[:, j1:, j0:j1].transpose(1, 2) @ Xi)
        outs.append(acc)
    return torch.cat(outs, dim=1)


def _gated_gram(X: torch.Tensor, Y: torch.Tensor, Gam: torch.Tensor, strict: bool,
                sub: int = _SUB) -> torch.Tensor:
    """gram_ij = sum_d X_id Y_jd exp(Gam_id - Gam_jd) for j < i (strict) or j <= i, else 0.
    [H, C, C]. The anchored form of Aqk (X = Q, Y = K) and G (X = Y = K, strict); equals the
    element-wise chunk_prepare result to rounding. Not used by the functions above (they take
    Aqk and Akk from chunk_prepare); kept as the kernel's recipe and checked by the tests."""
    H, C, K = X.shape
    out = torch.zeros(H, C, C, dtype=X.dtype, device=X.device)
    for i0, i1 in _sub_chunks(C, sub):
        Gi = Gam[:, i0:i1]
        out[:, i0:i1, i0:i1] = torch.einsum("hid,hjd,hijd->hij", X[:, i0:i1], Y[:, i0:i1],
                                            _decay_matrix(Gi, strict))
        if i0 > 0:
            Ga = Gam[:, i0:i0 + 1]
            out[:, i0:i1, :i0] = ((X[:, i0:i1] * torch.exp(Gi - Ga))
                                  @ (Y[:, :i0] * torch.exp(Ga - Gam[:, :i0])).transpose(1, 2))
    return out


def _chunk_table(cu: List[int], chunk_size: int) -> List[Tuple[int, int, int]]:
    """(document, start, end) of every chunk, in packed order."""
    return [(n, c0, min(c0 + chunk_size, b))
            for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])) for c0 in range(a, b, chunk_size)]


def kda_chunked_fwd_saved(q, k, v, g, beta, *, cu_seqlens: CuSeqlens = None,
                          scale: Optional[float] = None,
                          initial_state: Optional[torch.Tensor] = None, chunk_size: int = 64,
                          dtype: torch.dtype = torch.float64) -> dict:
    """kda_chunked's forward, keeping everything a saved-context kernel forward would save.
    Plain tensors in `dtype` (no autograd graph). With n chunks over all documents (packed
    order; chunks restart at each document, the last one may be short):

        o            [1, T, H, V]   output (bitwise kda_chunked's)
        final_state  [N, H, K, V]   (always returned)
        chunks       [n, 3] int64   (document, start, end) token positions of each chunk
        S            [n, H, K, V]   the state tape: state at each chunk's START
        gam          [n, H, K]      gam = Gam at the chunk's last row
        Gam          [1, T, H, K]   in-chunk cumsum of g
        W, Kg, Qg    [1, T, H, K]   W = T (K e^Gam), Kg = K e^(gam-Gam), Qg = Q e^Gam
        U, v_new     [1, T, H, V]   U = T V, v_new = V' = U - W S
        Aqk          [1, T, H, chunk_size]  row = token, column = position in its chunk
        Akk          [1, T, H, chunk_size]  L (strictly lower, beta included)
        Akk_inv      [1, T, H, chunk_size]  (I + L)^-1 (unit lower); T = Akk_inv Diag(beta)
        scale, chunk_size, cu_seqlens (list), dtype, has_initial_state
    Columns of Aqk/Akk/Akk_inv past the chunk's length are 0. q, k may have fewer heads (grouped value
    heads: H above is v's; Qg, Kg, W are per value head).
    """
    cu, (q, k, v, g, beta, h0), scale = _prepared(q, k, v, g, beta, cu_seqlens, scale, initial_state, dtype,
                                                  detach=True)
    T, H, K, V = q.shape[1], v.shape[2], q.shape[3], v.shape[3]
    with torch.no_grad():
        table = _chunk_table(cu, chunk_size)
        n = len(table)
        zk = dict(dtype=dtype, device=q.device)
        sv = {
            "o": torch.zeros(1, T, H, V, **zk),
            # an empty document's final state is the state it was given (no chunk writes it)
            "final_state": torch.zeros(len(cu) - 1, H, K, V, **zk) if h0 is None else h0.clone(),
            "chunks": torch.tensor(table, dtype=torch.int64).reshape(n, 3),
            "S": torch.zeros(n, H, K, V, **zk),
            "gam": torch.zeros(n, H, K, **zk),
        }
        for name, width in (("Gam", K), ("W", K), ("Kg", K), ("Qg", K), ("U", V), ("v_new", V),
                            ("Aqk", chunk_size), ("Akk", chunk_size), ("Akk_inv", chunk_size)):
            sv[name] = torch.zeros(1, T, H, width, **zk)

        S = None
        for c, (doc, c0, c1) in enumerate(table):
            if c0 == cu[doc]:
                S = torch.zeros(H, K, V, **zk) if h0 is None else h0[doc]
            C = c1 - c0
            Qc, Kc, Vc, Gc = (_to_head_first(x, c0, c1) for x in (q, k, v, g))
            Bc = beta[0, c0:c1].transpose(0, 1)
            p = chunk_prepare(Kc, Vc, Gc, Bc, q=Qc)
            L = _chunk_akk(Kc, p["Gam"], Bc)
            eye = torch.eye(C, **zk).expand(H, C, C)
            Ainv = torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)
            sv["S"][c] = S
            Vp, Qg, Oc, S = chunk_step(p, Qc, S, scale)                         # kda_chunked's step
            if c1 == cu[doc + 1]:
                sv["final_state"][doc] = S
            sv["gam"][c] = p["gam"]
            for name, x in (("o", Oc), ("Gam", p["Gam"]), ("W", p["W"]), ("Kg", p["Kg"]),
                            ("Qg", Qg), ("U", p["U"]), ("v_new", Vp)):
                sv[name][0, c0:c1] = x.transpose(0, 1)
            for name, x in (("Aqk", p["Aqk"]), ("Akk", L), ("Akk_inv", Ainv)):
                sv[name][0, c0:c1, :, :C] = x.transpose(0, 1)
    sv.update(scale=scale, chunk_size=chunk_size, cu_seqlens=cu, dtype=dtype,
              has_initial_state=initial_state is not None)
    return sv


def _saved_chunk(saved: dict, name: str, c0: int, c1: int) -> torch.Tensor:
    """A saved token-layout tensor's chunk, head-first: [H, C, *] ([H, C, C] for the A's)."""
    x = _to_head_first(saved[name], c0, c1)
    return x[..., :c1 - c0] if name in ("Aqk", "Akk", "Akk_inv") else x


def kda_bwd_dvp_local(saved: dict, do: torch.Tensor) -> torch.Tensor:
    """Chunk-parallel: dVp_loc = scale Aqk^T dO per chunk.  [1, T, H, V]."""
    do = do.to(saved["dtype"])
    out = torch.zeros_like(saved["v_new"])
    for _, c0, c1 in saved["chunks"].tolist():
        Aqk = _saved_chunk(saved, "Aqk", c0, c1)
        out[0, c0:c1] = (saved["scale"] * Aqk.transpose(1, 2) @ _to_head_first(do, c0, c1)
                         ).transpose(0, 1)
    return out


def kda_bwd_state_walk(saved: dict, do: torch.Tensor, dvp_local: torch.Tensor,
                       dfinal_state: Optional[torch.Tensor] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sequential stage (a): per (document, head), the chunks last to first,
        dVp = dVp_loc + Kg dS_end                       [C, V] = [C, K] @ [K, V]
        dS  = Diag(e^gam) dS_end + scale Qg^T dO - W^T dVp   ([K, C] @ [C, V] products)
    Returns (dS tape [n, H, K, V] = gradient of the state at each chunk's END,
             d_initial_state [N, H, K, V] = dS at each document's first chunk start)."""
    dt = saved["dtype"]
    do = do.to(dt)
    N, H, K, V = saved["final_state"].shape
    scale = saved["scale"]
    dS_tape = torch.zeros_like(saved["S"])
    # an empty document passes its final state's gradient through to its initial state (no chunk writes it)
    dh0 = (torch.zeros(N, H, K, V, dtype=dt, device=do.device) if dfinal_state is None
           else dfinal_state.to(dt).clone())
    cu = saved["cu_seqlens"]
    table = saved["chunks"].tolist()
    dS = None
    for c in range(len(table) - 1, -1, -1):
        doc, c0, c1 = table[c]
        if c1 == cu[doc + 1]:                                   # a document's last chunk
            dS = (torch.zeros(H, K, V, dtype=dt, device=do.device) if dfinal_state is None
                  else dfinal_state[doc].to(dt))
        dS_tape[c] = dS
        Kg, Qg, W = (_saved_chunk(saved, x, c0, c1) for x in ("Kg", "Qg", "W"))
        dVp = _to_head_first(dvp_local, c0, c1) + Kg @ dS
        dS = (torch.exp(saved["gam"][c])[:, :, None] * dS
              + scale * Qg.transpose(1, 2) @ _to_head_first(do, c0, c1)
              - W.transpose(1, 2) @ dVp)
        if c0 == cu[doc]:
            dh0[doc] = dS
    return dS_tape, dh0


def chunk_bwd(q, k, v, beta, dO, S, dS_end, p: dict, scale: float, sub: int = _SUB) -> dict:
    """Chunk-parallel stage (b) for ONE chunk, head-first: q, k [H, C, K], v, dO [H, C, V],
    beta [H, C], S (state at the chunk start) and dS_end (gradient of the state at its end)
    [H, K, V]; p holds the chunk's saved Gam, gam [H, K], W, U, v_new, Kg, Qg, Aqk, Akk_inv.
    Returns dict dq, dk, dv, dg, dbeta (the chunk's rows) and the named intermediates."""
    Gam, gam = p["Gam"], p["gam"]
    eG = torch.exp(Gam)                                      # <= 1
    eGg = torch.exp(gam[:, None, :] - Gam)                   # <= 1
    St, dSt = S.transpose(1, 2), dS_end.transpose(1, 2)
    C = q.shape[1]

    dVp = scale * p["Aqk"].transpose(1, 2) @ dO + p["Kg"] @ dS_end          # [C, V]  (= dU)
    dAqk = torch.tril(scale * dO @ p["v_new"].transpose(1, 2))               # [C, C]
    dQg = scale * dO @ St                                                    # [C, K]
    dKg = p["v_new"] @ dSt                                                   # [C, K]
    dW = -dVp @ St                                                           # [C, K]
    AinvT = p["Akk_inv"].transpose(1, 2)
    dRk = AinvT @ dW                                                         # [C, K]
    dRv = AinvT @ dVp                                                        # [C, V]
    dAkk = -torch.tril(dRk @ p["W"].transpose(1, 2) + dRv @ p["U"].transpose(1, 2),
                       diagonal=-1)                                          # [C, C]

    b = beta[:, :, None]
    dk_Lr_raw = _gated_rows(dAkk, k, Gam, sub)                               # rows(dAkk, K)
    dk_Lr = b * dk_Lr_raw
    dk_Lc = _gated_cols(b * dAkk, k, Gam, sub)                               # cols(Diag(b) dAkk, K)
    # dAqk's diagonal (E_ii = 1) reaches dq as dAqk_ii k_i and dk as dAqk_ii q_i, and dGam_i twice with
    # opposite signs: it is kept out of dGam, where its two rounded copies would not cancel (their residue
    # is O(1) while dg is ~e^g at strong decay), and added to dq and dk alone (as kda_bwd_gate does).
    daqk_ii = torch.diagonal(dAqk, dim1=1, dim2=2)[:, :, None]               # [H, C, 1]
    dAqk_off = torch.tril(dAqk, diagonal=-1)
    dk_q = _gated_cols(dAqk_off, q, Gam, sub)
    dk_R = b * dRk * eG
    dk_g = dKg * eGg
    dq_off = dQg * eG + _gated_rows(dAqk_off, k, Gam, sub)
    dq = dq_off + daqk_ii * k
    dk = dk_g + dk_R + dk_q + dk_Lr + dk_Lc + daqk_ii * q
    dv = b * dRv
    dbeta = (k * (dRk * eG + dk_Lr_raw)).sum(-1) + (v * dRv).sum(-1)
    # dg_t = dgam_s + sum_{r < t} Kg_r dKg_r + sum_{r >= t} dGam_r. Row r's Kg term (through
    # e^(gam - Gam_r)) reaches dg_t for t > r only; summed as that prefix, not as the chunk's total
    # minus the suffix, whose O(1) copies of the last rows' terms cancel to fp32 residue while dg is
    # ~e^g (g = -30: relative error 1e6). The kernels (kda_bwd_gate) sum it the same way.
    dGam = q * dq_off + k * (dk_R + dk_Lr - dk_Lc - dk_q)
    dgam_s = torch.exp(gam) * (S * dS_end).sum(-1)                           # [H, K]
    kg_terms = p["Kg"] * dKg                                                 # [H, C, K]
    prefix = torch.cat([dgam_s[:, None], torch.cumsum(kg_terms[:, :C - 1], 1) + dgam_s[:, None]], dim=1)
    dg = prefix + torch.flip(torch.cumsum(torch.flip(dGam, [1]), 1), [1])    # + reverse cumsum
    return dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dVp=dVp, dAqk=dAqk, dAkk=dAkk,
                dQg=dQg, dKg=dKg, dW=dW, dRk=dRk, dRv=dRv, dGam=dGam, dgam_s=dgam_s)


def kda_chunked_bwd(saved: dict, do: torch.Tensor, dfinal_state: Optional[torch.Tensor] = None,
                    *, q, k, v, g, beta, scale: Optional[float] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                               torch.Tensor, torch.Tensor]:
    """Explicit backward of kda_chunked from kda_chunked_fwd_saved's result: do [1, T, H, V],
    dfinal_state [N, H, K, V] or None (= 0), and the forward's inputs (g is not needed beyond
    its saved cumsum; passed for symmetry and shape checks). Returns, in saved["dtype"],
        dq, dk [1, T, H, K] (q's heads)   dv [1, T, H, V]   dg [1, T, H, K]   dbeta [1, T, H]
        d_initial_state [N, H, K, V]   (the gradient w.r.t. the state entering each document,
                                        returned even when the forward had no initial state)
    Stages: dVp_loc (chunk-parallel), the state walk (a) -> dS tape, then chunk_bwd (b)."""
    dt = saved["dtype"]
    if scale is not None and scale != saved["scale"]:
        raise ValueError(f"scale {scale} differs from the forward's {saved['scale']}")
    scale = saved["scale"]
    cu = saved["cu_seqlens"]
    _check_kda_inputs(q, k, v, g, beta, None, cu)
    if tuple(do.shape) != tuple(v.shape):
        raise ValueError(f"do must be {tuple(v.shape)}, got {tuple(do.shape)}")
    if dfinal_state is not None and tuple(dfinal_state.shape) != tuple(saved["final_state"].shape):
        raise ValueError(f"dfinal_state must be {tuple(saved['final_state'].shape)}, "
                         f"got {tuple(dfinal_state.shape)}")
    heads = q.shape[2]  # q's and k's (grouped value heads: their gradients summed over each group below)
    with torch.no_grad():
        q, k = per_value_head(q, v.shape[2]), per_value_head(k, v.shape[2])
        q, k, v, beta, do = (x.detach().to(dt) for x in (q, k, v, beta, do))
        dfs = None if dfinal_state is None else dfinal_state.detach().to(dt)

        dvp_local = kda_bwd_dvp_local(saved, do)
        dS_tape, dh0 = kda_bwd_state_walk(saved, do, dvp_local, dfs)

        dq, dk, dg = (torch.zeros_like(q) for _ in range(3))
        dv = torch.zeros_like(v)
        dbeta = torch.zeros_like(beta)
        for c, (doc, c0, c1) in enumerate(saved["chunks"].tolist()):
            p = {x: _saved_chunk(saved, x, c0, c1)
                 for x in ("Gam", "W", "U", "v_new", "Kg", "Qg", "Aqk", "Akk_inv")}
            p["gam"] = saved["gam"][c]
            r = chunk_bwd(*(_to_head_first(x, c0, c1) for x in (q, k, v)),
                          beta[0, c0:c1].transpose(0, 1), _to_head_first(do, c0, c1),
                          saved["S"][c], dS_tape[c], p, scale)
            for name, out in (("dq", dq), ("dk", dk), ("dv", dv), ("dg", dg)):
                out[0, c0:c1] = r[name].transpose(0, 1)
            dbeta[0, c0:c1] = r["dbeta"].transpose(0, 1)
    return sum_value_head_groups(dq, heads), sum_value_head_groups(dk, heads), dv, dg, dbeta, dh0
