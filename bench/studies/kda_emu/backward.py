"""The backward kernels at their rounding points (kda_bwd_walk, kda_bwd_chunk, kda_bwd_gate) and run_kda, the
whole op under a set of knobs."""
from __future__ import annotations

import torch

from .forward import chunk_stage, col_pieces, cumgate, fwd_walk, gate_factor, row_pieces
from .inputs import beta_chunks, chunks_of, from_chunks, to_chunks
from .rounding import C, K, bf, ex2, rnd

def bwd_walk(cs, gam_last, dO, table, cu, dht, scale, kn):
    n, H = cs["W"].shape[:2]
    dtape = torch.zeros(n, H, K, K)
    dh0 = torch.zeros(len(cu) - 1, H, K, K)
    dS = None
    op = {n_: cs[n_] if kn["bw_" + n_.lower()] == "stored" else rnd(cs[n_ + "32"], kn["bw_" + n_.lower()])
          for n_ in ("W", "Qg", "Kg")}
    for c in range(n - 1, -1, -1):
        doc, t0, ln = table[c]
        if t0 + ln == cu[doc + 1]:
            dS = torch.zeros(H, K, K) if dht is None else dht[doc].float().clone()
        dtape[c] = dS
        dSb = rnd(dS, kn["ds_op"])
        dvp = scale * (cs["Aqk"][c].transpose(-1, -2) @ dO[c]) + op["Kg"][c] @ dSb
        ndv = rnd(-dvp, kn["ndv"])
        if kn["bw_order"] == "kernel":
            dS = scale * (op["Qg"][c].transpose(-1, -2) @ dO[c]) + torch.exp(gam_last[c])[:, :, None] * dS
            dS = dS + op["W"][c].transpose(-1, -2) @ ndv
        else:
            dS = torch.exp(gam_last[c])[:, :, None] * dS + (scale * (op["Qg"][c].transpose(-1, -2) @ dO[c])
                                                            + op["W"][c].transpose(-1, -2) @ ndv)
        if t0 == cu[doc]:
            dh0[doc] = dS
    return dtape, dh0


def bwd_chunk(cs, tape, dtape, Vn, v, dO, beta, gam_last, scale, kn):
    """kda_bwd_chunk: the plain products, per chunk (batched)."""
    S = rnd(tape, kn["tape_op"])
    dS = rnd(dtape, kn["tape_op"])
    dgam_s = torch.exp(gam_last) * (tape * dtape).sum(-1)
    dSv = dS if kn["tape_dvp"] is None else rnd(dtape, kn["tape_dvp"])
    dvp32 = scale * (cs["Aqk"].transpose(-1, -2) @ dO) + cs["Kg"] @ dSv
    dvp = rnd(dvp32, kn["dvp"])
    tri = torch.tril(torch.ones(C, C))
    tri_s = torch.tril(torch.ones(C, C), -1)
    out = dict(dgam_s=dgam_s)
    Sq = S if kn["tape_dqg"] is None else rnd(tape, kn["tape_dqg"])
    dSk = dS if kn["tape_dkg"] is None else rnd(dtape, kn["tape_dkg"])
    out["dQg"] = rnd(scale * (dO @ Sq.transpose(-1, -2)), kn["dqg"])
    out["dKg"] = rnd(Vn @ dSk.transpose(-1, -2), kn["dkg"])
    dAqk32 = scale * tri * (dO @ Vn.transpose(-1, -2))
    out["dAqk"] = rnd(dAqk32, kn["daqk"])
    dAqk_ii = torch.diagonal(dAqk32, dim1=-2, dim2=-1)
    if kn["vnew_diag"] == "fp32":
        dAqk_ii = scale * (dO * cs["Vn32"]).sum(-1)
    elif kn["vnew_diag"] == "u_lo":
        dAqk_ii = dAqk_ii + scale * (dO * cs["U_lo"]).sum(-1)
    elif kn["vnew_diag"] == "u_recomputed":  # U again in fp32 from the saved bf16 (I + L)^-1, beta and V, as
        # kda_bwd_chunk would form it: bf16(inv_ij beta_j) below the diagonal times bf16 V, beta_i V_i in fp32
        T = bf(rnd(cs["inv"], kn["akk_inv"]) * beta[:, :, None, :]) * torch.tril(torch.ones(C, C), -1)
        U_again = T @ v.float() + beta[..., None] * v.float()
        dAqk_ii = dAqk_ii + scale * (dO * (U_again - cs["U"])).sum(-1)
    out["dAqk_ii"] = rnd(dAqk_ii, kn["daqk_ii"])
    dvp_w = dvp if kn["dvp_dw"] is None else rnd(dvp32, kn["dvp_dw"])
    dW = rnd(-(dvp_w @ S.transpose(-1, -2)), kn["dw"])
    inv = rnd(cs["inv"], kn["akk_inv"])
    dRk = rnd(inv.transpose(-1, -2) @ dW, kn["drk"])
    dRv32 = inv.transpose(-1, -2) @ dvp
    out["dv"] = beta[..., None] * dRv32
    out["dbeta_v"] = (v.float() * dRv32).sum(-1)
    dRv = rnd(dRv32, kn["drv"])
    out["dRk"] = dRk
    out["dAkk"] = rnd(-tri_s * (dRk @ cs["W"].transpose(-1, -2) + dRv @ cs["U"].transpose(-1, -2)), kn["dakk"])
    return out


def gated_rows(M, Y, G, kn, row_scale=None, diag=None, with_diag=True):
    """rows(M, Y)_i = sum_{j <= i} M_ij Y_j e^(Gamma_i - Gamma_j), by the kernel's pieces: the operand
    Y_j (times row_scale) e^(G_a - G_j) rounded as kn['gated_op'], the accumulator times e^(G_i - G_a)."""
    out = torch.zeros_like(Y)
    Ys = Y if row_scale is None else Y * row_scale[..., None]
    for (r0, r1), (j0, j1), a in row_pieces(kn):
        opnd = rnd(Ys[:, :, j0:j1] * gate_factor(G, (j0, j1), a, -1), kn["gated_op"])
        m = M[:, :, r0:r1, j0:j1]
        if kn["gate_diag"] == "exact" and r0 == j0:
            m = torch.tril(m, -1)
        out[:, :, r0:r1] += (m @ opnd) * gate_factor(G, (r0, r1), a, +1)
    if kn["gate_diag"] == "exact" and with_diag:
        out += (torch.diagonal(M, dim1=-2, dim2=-1) if diag is None else diag)[..., None] * Ys
    return out


def gated_cols(M, X, G, kn, row_scale=None, diag=None, with_diag=True):
    """cols(M, X)_j = sum_{i >= j} M_ij X_i e^(Gamma_i - Gamma_j), by the same pieces transposed."""
    out = torch.zeros_like(X)
    Xs = X if row_scale is None else X * row_scale[..., None]
    for (r0, r1), (j0, j1), a in col_pieces(kn):
        opnd = rnd(Xs[:, :, r0:r1] * gate_factor(G, (r0, r1), a, +1), kn["gated_op"])
        m = M[:, :, r0:r1, j0:j1]
        if kn["gate_diag"] == "exact" and r0 == j0:
            m = torch.tril(m, -1)
        out[:, :, j0:j1] += (m.transpose(-1, -2) @ opnd) * gate_factor(G, (j0, j1), a, -1)
    if kn["gate_diag"] == "exact" and with_diag:
        out += (torch.diagonal(M, dim1=-2, dim2=-1) if diag is None else diag)[..., None] * Xs
    return out


def bwd_gate(q, k, G, beta, p, lens, kn):
    """kda_bwd_gate: dq, dk, dg, dbeta (without dbeta_v) per chunk."""
    qf, kf = q.float(), k.float()
    b = beta[..., None]
    eG = ex2(G)
    eGg = ex2(G[:, :, -1:] - G)
    exact = kn["gate_diag"] == "exact"  # dAqk's i = j terms added after dGamma, which they would cancel in
    dq = p["dQg"] * eG + gated_rows(p["dAqk"], kf, G, kn, diag=p["dAqk_ii"], with_diag=False)
    dG = qf * dq
    if exact:
        dq = dq + p["dAqk_ii"][..., None] * kf
    t = gated_rows(p["dAkk"], kf, G, kn)
    dk_r = p["dRk"] * eG
    dbeta = (kf * (dk_r + t)).sum(-1)
    dk_lr, dk_R, dk_g = b * t, b * dk_r, p["dKg"] * eGg
    dk = dk_g + dk_R + dk_lr
    X = kf * eGg * p["dKg"]  # row r's Kg term; it reaches dg_t for t > r only
    dG = dG + kf * (dk_R + dk_lr) - (kf * dk_g if kn["dg_kg"] == "total" else 0.0)
    t = gated_cols(p["dAqk"], qf, G, kn, diag=p["dAqk_ii"], with_diag=False)
    dk = dk + t
    dG = dG - kf * t
    if exact:
        dk = dk + p["dAqk_ii"][..., None] * qf
    t = gated_cols(p["dAkk"], kf, G, kn, row_scale=beta)
    dk = dk + t
    dG = dG - kf * t
    dg = torch.zeros_like(dG)
    if kn["dg_kg"] == "total":
        dgam = X.sum(2) + p["dgam_s"]
        for c, ln in enumerate(lens):
            acc = dgam[c]
            for r in range(ln - 1, -1, -1):
                acc = acc + dG[c, :, r]
                dg[c, :, r] = acc
    else:
        for c, ln in enumerate(lens):
            pre = p["dgam_s"][c].clone()
            P = torch.zeros_like(dG[c])
            for r in range(ln):
                P[:, r] = pre
                pre = pre + X[c, :, r]
            acc = torch.zeros_like(pre)
            for r in range(ln - 1, -1, -1):
                acc = acc + dG[c, :, r]
                dg[c, :, r] = P[:, r] + acc
    return dq, dk, dg, dbeta


# ----------------------------------------------------------------------------- the arms

def run_kda(x, kn):
    """The kernels' arithmetic under knobs kn: o, final state and every gradient."""
    cu = x["cu"]
    T, H = x["q"].shape[1], x["q"].shape[2]
    table = chunks_of(cu)
    lens = [n for _, _, n in table]
    q, k, v, do = (to_chunks(x[n], table, K) for n in ("q", "k", "v", "do"))
    g = to_chunks(x["g"], table, K)
    beta = beta_chunks(x["beta"], table)
    scale = K ** -0.5
    gam, G = cumgate(g.float(), kn)
    gam_last = gam[:, :, -1]
    cs = chunk_stage(q, k, v, G, beta, kn)
    h0, decay = x["h0"], None
    if h0 is not None and kn["gate_clamp"] is not None and kn["entering"] == "decay":
        # kda.entering_decay: e^(g - max(g, floor)) of each document's first token, [N, H, K, 1]
        gf = x["g"][0, cu[:-1]].float()
        decay = torch.exp(torch.clamp(gf + kn["gate_clamp"], max=0.0)).unsqueeze(-1)
        h0 = h0.float() * decay
    O, tape, Vn, final = fwd_walk(cs, gam_last, table, cu, h0, scale, kn)
    dO = do.float()
    dtape, dh0 = bwd_walk(cs, gam_last, dO, table, cu, x["dht"], scale, kn)
    if decay is not None:
        dh0 = dh0 * decay
    p = bwd_chunk(cs, tape, dtape, Vn, v, dO, beta, gam_last, scale, kn)
    dq, dk, dg, dbeta = bwd_gate(q, k, G, beta, p, lens, kn)
    if kn["gate_clamp"] is not None:  # the clamp's derivative: zero below the floor
        dg = torch.where(g < -kn["gate_clamp"], torch.zeros_like(dg), dg)
    dbeta = dbeta + p["dbeta_v"]
    res = dict(o=rnd(from_chunks(O, table, T), kn["out"]), final_state=final,
               dq=rnd(from_chunks(dq, table, T), kn["out"]), dk=rnd(from_chunks(dk, table, T), kn["out"]),
               dv=rnd(from_chunks(p["dv"], table, T), kn["out"]), dg=from_chunks(dg, table, T),
               dbeta=rnd(from_chunks(dbeta[..., None], table, T)[..., 0], kn["out"]), dh0=dh0)
    return res
