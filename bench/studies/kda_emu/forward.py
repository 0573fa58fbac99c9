"""The forward kernels at their rounding points: kda_fwd_chunk/lean (the chunk stage, its anchored pieces) and
kda_fwd_walk."""
from __future__ import annotations

import torch

from .rounding import C, F32, K, LOG2E, bf, ex2, rnd

def cumgate(g, kn):
    """Gamma (natural units, fp32 running sum in row order) and G = Gamma log2 e; padding rows g = 0
    (they repeat the last row). kn['gamma'] = 'fp64': both exact (G's differences then rounded once, in ex2)."""
    if kn["gate_clamp"] is not None:
        g = torch.clamp(g, min=-kn["gate_clamp"])
    if kn["gamma"] == "fp64":
        gam = torch.cumsum(g.double(), 2)
        return gam.float(), gam * LOG2E
    gam = torch.zeros_like(g)
    acc = torch.zeros_like(g[:, :, 0])
    for r in range(C):
        acc = acc + g[:, :, r]
        gam[:, :, r] = acc
    return gam, (gam * LOG2E).to(F32)


# ----------------------------------------------------------------------------- anchors

def diag_pieces(kn):
    """The anchored pieces of the diagonal 16-row blocks (rows i, columns j <= i): (rows, columns,
    anchor row). 'mid16': one anchor at the block's middle row; 'mid8': the two 8-row sub-blocks at
    their middle rows, the 8 x 8 between them at row 8 of the block (every factor <= 1 there)."""
    out = []
    for I in range(4):
        b = 16 * I
        if kn["anchor"] == "mid16":
            out.append(((b, b + 16), (b, b + 16), b + 8))
        else:
            out += [((b + 8, b + 16), (b, b + 8), b + 8), ((b, b + 8), (b, b + 8), b + 4),
                    ((b + 8, b + 16), (b + 8, b + 16), b + 12)]
    return out


def row_pieces(kn):
    """Pieces of the forward gram and of rows(): the off-diagonal part of row block I anchored at
    its first row 16 I (both factors <= 1), and the diagonal pieces."""
    return [((16 * I, 16 * I + 16), (0, 16 * I), 16 * I) for I in range(1, 4)] + diag_pieces(kn)


def col_pieces(kn):
    """Pieces of cols(): the off-diagonal part of column block J anchored at its last row 16 J + 15,
    and the diagonal pieces."""
    return [((16 * J + 16, C), (16 * J, 16 * J + 16), 16 * J + 15) for J in range(3)] + diag_pieces(kn)


def gate_factor(G, rows, a, sign):
    """exp2(+-(G_rows - G_a)) per channel, ftz."""
    d = G[:, :, rows[0]:rows[1]] - G[:, :, a:a + 1]
    return ex2(d if sign > 0 else -d)


# ----------------------------------------------------------------------------- forward

def operand(x, e, how):
    """x * e as the chunk stage feeds it to the tensor cores."""
    if how == "lean":
        return bf(x * bf(e))
    return rnd(x * e, how)


def chunk_stage(q, k, v, G, beta, kn):
    """W, U, Qg, Kg, Aqk, L, (I + L)^-1 per chunk, [n, H, C, *]."""
    n, H = q.shape[:2]
    L = torch.zeros(n, H, C, C)
    Aqk = torch.zeros(n, H, C, C)
    ii = torch.arange(C)
    for (r0, r1), (j0, j1), a in row_pieces(kn):
        fa = gate_factor(G, (r0, r1), a, +1)
        fb = gate_factor(G, (j0, j1), a, -1)
        where = "diag" if j0 >= 16 * (r0 // 16) else "off"  # the off-diagonal blocks' pieces start at column 0
        op_a, op_b = (kn[f"gram_{where}_{s_}"] or kn[f"gram_{s_}"] for s_ in ("a", "b"))
        op_q = kn["gram_q"] or op_a
        kb = operand(k[:, :, j0:j1].float(), fb, op_b)
        ka = operand(k[:, :, r0:r1].float(), fa, op_a)
        qa = operand(q[:, :, r0:r1].float(), fa, op_q)
        kbq = kb
        if kn["gram_exact"] in ("akk", "both"):
            ka, kb = k[:, :, r0:r1].float() * fa, k[:, :, j0:j1].float() * fb
        if kn["gram_exact"] in ("aqk", "both"):
            qa, kbq = q[:, :, r0:r1].float() * fa, k[:, :, j0:j1].float() * fb
        accK = ka @ kb.transpose(-1, -2)
        accQ = qa @ kbq.transpose(-1, -2)
        i, j = ii[r0:r1, None], ii[None, j0:j1]
        L[:, :, r0:r1, j0:j1] = torch.where(j < i, beta[:, :, r0:r1, None] * accK, 0.0)
        Aqk[:, :, r0:r1, j0:j1] = torch.where(j <= i, accQ, 0.0)
    if kn["aqk_ii"] == "exact":
        Aqk = Aqk + torch.diag_embed((q.float() * k.float()).sum(-1) - torch.diagonal(Aqk, dim1=-2, dim2=-1))
    eye = torch.eye(C).expand(n, H, C, C)
    inv = torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)
    inv = rnd(inv, kn["inv"])
    T = rnd(inv * beta[:, :, None, :], kn["t_op"])
    if kn["w_beta"] == "t":
        kexp = rnd(k.float() * ex2(G), kn["kexp"])
        W32 = T @ kexp
    elif kn["w_beta"] == "t_diag":  # T's diagonal (beta_i) out of the mma, beta_i k_i e^Gamma_i added in fp32
        kexp = rnd(k.float() * ex2(G), kn["kexp"])
        W32 = (T - torch.diag_embed(torch.diagonal(T, dim1=-2, dim2=-1))) @ kexp + beta[..., None] * k.float() * ex2(G)
    else:  # beta in the K operand: W's diagonal terms rounded once, as FLA's
        W32 = rnd(inv, kn["t_op"]) @ rnd(k.float() * beta[..., None] * ex2(G), kn["kexp"])
    W = rnd(W32, kn["w"])
    if kn["w_beta"] == "kv":
        U32 = rnd(inv, kn["t_op"]) @ rnd(v.float() * beta[..., None], kn["t_op"])
    else:
        U32 = T @ v.float()
    U = rnd(U32, kn["u"])
    Qg32 = q.float() * ex2(G)
    Kg32 = k.float() * ex2(G[:, :, -1:] - G)
    Qg = rnd(Qg32, kn["qg"])
    Kg = rnd(Kg32, kn["kg"])
    if kn["aqk"] == "bf16d":  # bf16 with its i = j entries kept in fp32 (a [T, H] side tensor)
        Aqk_r = bf(Aqk)
        Aqk_r = Aqk_r + torch.diag_embed(torch.diagonal(Aqk, dim1=-2, dim2=-1) - torch.diagonal(Aqk_r, dim1=-2, dim2=-1))
    else:
        Aqk_r = rnd(Aqk, kn["aqk"])
    return dict(W=W, U=U, U_lo=bf(U32 - U), Qg=Qg, Kg=Kg, Aqk=Aqk_r, L=L, inv=inv, W32=W32, Qg32=Qg32, Kg32=Kg32,
                Aqk_ii=torch.diagonal(Aqk, dim1=-2, dim2=-1))


def fwd_walk(cs, gam_last, table, cu, h0, scale, kn):
    """The forward walk with the output stage: O, the state tape (fp32, at chunk starts), V', final states."""
    n, H = cs["W"].shape[:2]
    O = torch.zeros(n, H, C, K)
    Vn = torch.zeros(n, H, C, K)
    cs["Vn32"] = torch.zeros(n, H, C, K)  # V' before its rounding (vnew_diag)
    tape = torch.zeros(n, H, K, K)
    final = torch.zeros(len(cu) - 1, H, K, K)
    S = None
    for c, (doc, t0, ln) in enumerate(table):
        if t0 == cu[doc]:
            S = torch.zeros(H, K, K) if h0 is None else h0[doc].float().clone()
        tape[c] = S
        Sb = rnd(S, kn["s_op"])
        vn32 = cs["U"][c] - cs["W"][c] @ Sb
        vn = rnd(vn32, kn["vnew"])
        Vn[c] = vn
        cs["Vn32"][c] = vn32
        if kn["o_diag"] == "fp32":
            A = cs["Aqk"][c] - torch.diag_embed(torch.diagonal(cs["Aqk"][c], dim1=-2, dim2=-1))
            O[c] = scale * (cs["Qg"][c] @ Sb + A @ vn + cs["Aqk_ii"][c][..., None] * vn32)
        elif kn["o_diag"] == "residual":
            res = cs["Aqk_ii"][c] - torch.diagonal(cs["Aqk"][c], dim1=-2, dim2=-1)
            O[c] = scale * ((cs["Qg"][c] @ Sb + cs["Aqk"][c] @ vn) + res[..., None] * vn)
            if kn["vnew_diag"] == "fp32":
                O[c] = O[c] + scale * cs["Aqk_ii"][c][..., None] * (vn32 - vn)
            elif kn["vnew_diag"] == "u_lo":
                O[c] = O[c] + scale * cs["Aqk_ii"][c][..., None] * cs["U_lo"][c]
        elif kn["o_acc"] == "one":
            O[c] = scale * (cs["Qg"][c] @ Sb + cs["Aqk"][c] @ vn)
        S = torch.exp(gam_last[c])[:, :, None] * S + cs["Kg"][c].transpose(-1, -2) @ vn
        if t0 + ln == cu[doc + 1]:
            final[doc] = S
    return O, tape, Vn, final
