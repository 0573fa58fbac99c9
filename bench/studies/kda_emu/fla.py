"""flash-linear-attention 0.6.0's chunk_kda at its rounding points, in the same frame as the kernels' emulation."""
from __future__ import annotations

import math

import torch

from .inputs import beta_chunks, chunks_of, from_chunks, to_chunks
from .rounding import C, K, bf, tf32

def run_fla(x):
    """flash-linear-attention 0.6.0 chunk_kda (default gate path, recompute backward) at its rounding
    points (fla/ops/kda: chunk_intra*, wy_fast, common/chunk_delta_h, gla/chunk, chunk_bwd):
      intra diagonal 16 x 16 blocks of Aqk, Akk per element in fp32 (exp2 of the pairwise difference);
      off-diagonal blocks: fp32 operands anchored at the row block's first row, tf32 dot;
      Aqk stored bf16 with the scale folded in; (I + L)^-1: diagonal blocks by substitution (fp32),
      the off-diagonal merges in tf32, stored bf16; W = Ainv (beta K e^G) and U = Ainv (beta V) from
      bf16 operands, stored bf16; the walk as ours (h = bf16(S) per chunk, V' bf16); O from bf16 Qg, h;
      backward: dAqk, dAkk fp32; dh tape bf16; dq, dk, dg fp32 until returned; gated products tf32
      off the diagonal, fp32 per element on it."""
    cu = x["cu"]
    T, H = x["q"].shape[1], x["q"].shape[2]
    table = chunks_of(cu)
    lens = [n for _, _, n in table]
    q, k, v, do = (to_chunks(x[n], table, K).float() for n in ("q", "k", "v", "do"))
    beta = beta_chunks(x["beta"], table)
    scale = K ** -0.5
    g2 = to_chunks(x["g"], table, K).float() * (1 / math.log(2))
    G = torch.cumsum(g2, 2)
    n = len(table)
    ii = torch.arange(C)
    Akk = torch.zeros(n, H, C, C)
    Aqk = torch.zeros(n, H, C, C)
    for I in range(4):
        b = 16 * I
        Gi = G[:, :, b:b + 16]
        E = torch.exp2(Gi[:, :, :, None, :] - Gi[:, :, None, :, :])  # [i, j] pairwise
        m = (ii[:16, None] >= ii[None, :16])[..., None]
        E = torch.where(m, E, 0.0)
        kb = k[:, :, b:b + 16] * beta[:, :, b:b + 16, None]
        Aqk[:, :, b:b + 16, b:b + 16] = torch.einsum("nhid,nhjd,nhijd->nhij", q[:, :, b:b + 16], k[:, :, b:b + 16], E)
        Akk[:, :, b:b + 16, b:b + 16] = torch.tril(torch.einsum("nhid,nhjd,nhijd->nhij", kb, k[:, :, b:b + 16], E), -1)
        if I > 0:
            gn = G[:, :, b:b + 1]
            fa = torch.exp2(Gi - gn)
            fb = torch.exp2(gn - G[:, :, :b])
            kt = tf32(k[:, :, :b] * fb)
            Aqk[:, :, b:b + 16, :b] = tf32(q[:, :, b:b + 16] * fa) @ kt.transpose(-1, -2)
            Akk[:, :, b:b + 16, :b] = beta[:, :, b:b + 16, None] * (tf32(k[:, :, b:b + 16] * fa) @ kt.transpose(-1, -2))
    Aqk_s = bf(Aqk * scale)

    def dot32(a, b_):
        return tf32(a) @ tf32(b_)
    inv = torch.zeros(n, H, C, C)
    eye16 = torch.eye(16).expand(n, H, 16, 16)
    for I in range(4):
        b = 16 * I
        inv[:, :, b:b + 16, b:b + 16] = torch.linalg.solve_triangular(eye16 + Akk[:, :, b:b + 16, b:b + 16], eye16,
                                                                      upper=False, unitriangular=True)
    blk = lambda M, I, J: M[:, :, 16 * I:16 * I + 16, 16 * J:16 * J + 16]  # noqa: E731
    Ai = {(I, I): blk(inv, I, I).clone() for I in range(4)}
    for d in range(1, 4):
        for J in range(4 - d):
            I = J + d
            acc = sum(dot32(blk(Akk, I, Kb), Ai[(Kb, J)]) for Kb in range(J, I))
            Ai[(I, J)] = -dot32(Ai[(I, I)], acc)
    for (I, J), val in Ai.items():
        inv[:, :, 16 * I:16 * I + 16, 16 * J:16 * J + 16] = val
    A = bf(inv)
    eG = torch.exp2(G)
    W = bf(A @ bf(k * beta[..., None] * eG))
    U = bf(A @ bf(v * beta[..., None]))
    Kg = bf(k * torch.exp2(G[:, :, -1:] - G))
    Qg = bf(q * eG)
    # walk, output
    O = torch.zeros(n, H, C, K)
    hb = torch.zeros(n, H, K, K)
    Vn = torch.zeros(n, H, C, K)
    final = torch.zeros(len(cu) - 1, H, K, K)
    S = None
    gl = torch.exp2(G[:, :, -1])
    for c, (doc, t0, ln) in enumerate(table):
        if t0 == cu[doc]:
            S = torch.zeros(H, K, K) if x["h0"] is None else x["h0"][doc].float().clone()
        hb[c] = bf(S)
        vn = bf(U[c] - W[c] @ hb[c])
        Vn[c] = vn
        S = gl[c][:, :, None] * S + Kg[c].transpose(-1, -2) @ vn
        if t0 + ln == cu[doc + 1]:
            final[doc] = S
    O = bf(scale * (Qg @ hb) + Aqk_s @ Vn)
    # backward: dAv, dhu walk, wy_dqkg, intra
    dO = do
    tri = torch.tril(torch.ones(C, C))
    dAqk = scale * tri * (dO @ Vn.transpose(-1, -2))                   # fp32
    dv_loc = bf(Aqk_s.transpose(-1, -2) @ dO)
    dhb = torch.zeros(n, H, K, K)
    dv2 = torch.zeros(n, H, C, K)
    dh0 = torch.zeros(len(cu) - 1, H, K, K)
    dS = None
    for c in range(n - 1, -1, -1):
        doc, t0, ln = table[c]
        if t0 + ln == cu[doc + 1]:
            dS = torch.zeros(H, K, K) if x["dht"] is None else x["dht"][doc].float().clone()
        dhb[c] = bf(dS)
        dvc = bf(Kg[c] @ dhb[c] + dv_loc[c])
        dv2[c] = dvc
        dS = gl[c][:, :, None] * dS + scale * (Qg[c].transpose(-1, -2) @ dO[c]) - W[c].transpose(-1, -2) @ dvc
        if t0 == cu[doc]:
            dh0[doc] = dS
    At = A.transpose(-1, -2)
    dgk = (hb * dhb).sum(-1)                                           # [n, H, K]
    dq = (dO @ hb.transpose(-1, -2)) * eG * scale
    dk = (Vn @ dhb.transpose(-1, -2)) * torch.exp2(G[:, :, -1:] - G)
    dw = bf(-(dv2 @ hb.transpose(-1, -2)))
    kgb = bf(k * eG)
    dAk = dv2 @ v.transpose(-1, -2) + dw @ kgb.transpose(-1, -2)
    dvb = At @ dv2
    dv = bf(dvb * beta[..., None])
    db = (dvb * v).sum(-1)
    dkgb = At @ dw
    db = db + (dkgb * k * eG).sum(-1)
    dgk = dgk * gl + (k * dk).sum(2)
    tri_s = torch.tril(torch.ones(C, C), -1)
    dgv = q * dq - k * dk + k * eG * dkgb * beta[..., None]        # + dgk at the chunk's last token, below
    dk = dk + dkgb * eG * beta[..., None]
    dAk = tri_s * dAk * beta[:, :, None, :]
    dAk = At @ bf(bf(dAk) @ At)
    dAkk = -tri_s * dAk
    # intra: off-diagonal tf32 (fp32 dA, fp32 gated operand), diagonal per element fp32
    dq2 = torch.zeros(n, H, C, K)
    dk2 = torch.zeros(n, H, C, K)
    dkt = torch.zeros(n, H, C, K)
    for I in range(4):
        b = 16 * I
        Gi = G[:, :, b:b + 16]
        if I > 0:
            gn = G[:, :, b:b + 1]
            kg_ = k[:, :, :b] * torch.exp2(gn - G[:, :, :b])
            dq2[:, :, b:b + 16] += dot32(dAqk[:, :, b:b + 16, :b], kg_) * torch.exp2(Gi - gn)
            dk2[:, :, b:b + 16] += dot32(dAkk[:, :, b:b + 16, :b], kg_) * torch.exp2(Gi - gn)
        if I < 3:
            gn = G[:, :, b + 15:b + 16]
            e = torch.exp2(G[:, :, b + 16:] - gn)
            dkt[:, :, b:b + 16] += (dot32(dAqk[:, :, b + 16:, b:b + 16].transpose(-1, -2), q[:, :, b + 16:] * e)
                                    + dot32(dAkk[:, :, b + 16:, b:b + 16].transpose(-1, -2),
                                            k[:, :, b + 16:] * beta[:, :, b + 16:, None] * e)) * torch.exp2(gn - Gi)
        E = torch.exp2(Gi[:, :, :, None, :] - Gi[:, :, None, :, :])
        m = (ii[:16, None] >= ii[None, :16])[..., None]
        E = torch.where(m, E, 0.0)
        qb, kb_ = q[:, :, b:b + 16], k[:, :, b:b + 16]
        bb = beta[:, :, b:b + 16]
        dq2[:, :, b:b + 16] += torch.einsum("nhij,nhjd,nhijd->nhid", dAqk[:, :, b:b + 16, b:b + 16], kb_, E)
        dk2[:, :, b:b + 16] += torch.einsum("nhij,nhjd,nhijd->nhid", dAkk[:, :, b:b + 16, b:b + 16], kb_, E)
        dkt[:, :, b:b + 16] += torch.einsum("nhij,nhid,nhijd->nhjd", dAqk[:, :, b:b + 16, b:b + 16], qb, E)
        dkt[:, :, b:b + 16] += torch.einsum("nhij,nhid,nhijd->nhjd", dAkk[:, :, b:b + 16, b:b + 16],
                                            kb_ * bb[..., None], E)
    db = db + (dk2 * k).sum(-1)
    dk2 = dk2 * beta[..., None]
    dg2 = q * dq2 + (dk2 - dkt) * k + dgv
    dq = dq + dq2
    dk = dk + dk2 + dkt
    # chunk_local_cumsum, reversed, over each chunk's tokens
    dg = torch.zeros_like(dg2)
    for c, ln in enumerate(lens):
        row = dg2[c, :, :ln].clone()
        row[:, ln - 1] += dgk[c]
        dg[c, :, :ln] = torch.flip(torch.cumsum(torch.flip(row, [1]), 1), [1])
    return dict(o=from_chunks(O, table, T), final_state=final, dq=bf(from_chunks(dq, table, T)),
                dk=bf(from_chunks(dk, table, T)), dv=from_chunks(dv, table, T), dg=from_chunks(dg, table, T),
                dbeta=bf(from_chunks(db[..., None], table, T)[..., 0]), dh0=dh0)
