"""Study (CPU): the KDA kernels' roundings emulated in torch, against the fp64 reference.

Emulates the shipped forward (kda_fwd_chunk/lean, kda_fwd_walk) and backward (kda_bwd_walk,
kda_bwd_chunk/prefetch, kda_bwd_gate/split_staged) at their rounding points: what is rounded to bf16
where, what is accumulated in fp32, which operands are bf16 hi + lo, which exps are ex2.approx.ftz
(fp32 exp2 with subnormal results flushed), with the kernels' anchors (so strong gates overflow here
where they overflow on the GPU). Tensor-core products are fp32 matmuls of the rounded operands; the
3xTF32 inverse is an fp32 solve. The same rounding points can be switched to fp32 one at a time
(`knobs`), and flash-linear-attention 0.6.0's rounding points (read from fla/ops/kda) are emulated in
the same frame (`--arm fla`), so each source of error can be compared with what FLA does there.

    python3 bench/studies/kda_emulation.py                 # attribution table, g uniform in [-5, 0]
    python3 bench/studies/kda_emulation.py --gate const-12 --arms shipped,fixed,fla
    python3 bench/studies/kda_emulation.py --list          # the knobs

Error: relative RMS ||x - ref|| / ||ref|| of o, dq, dk, dv, dg, dbeta, final state, dh0 against the
fp64 chunked reference (kda_aot.reference).
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from kda_aot import reference as R  # noqa: E402

F32, F64, BF = torch.float32, torch.float64, torch.bfloat16
C, K = 64, 128
LOG2E = 1.4426950408889634
TINY = 2.0 ** -126  # ex2.approx.ftz flushes results below the smallest normal


def bf(x):
    return x.to(BF).to(F32)


def tf32(x):
    """Round fp32 to tf32 (10 mantissa bits, to nearest: cvt.rna)."""
    b = x.contiguous().view(torch.int32)
    b = (b + 0x1000) & ~0x1FFF
    return b.view(F32)


def ex2(x):
    """ex2.approx.ftz.f32."""
    y = torch.exp2(x.to(F32))
    return torch.where(y.abs() < TINY, torch.zeros_like(y), y)


def hilo(x):
    hi = bf(x)
    return hi, bf(x - hi)


def rnd(x, how):
    """x rounded as an operand or an intermediate: 'bf16', 'fp32', 'tf32', 'hilo' (bf16 hi + lo)."""
    if how == "bf16":
        return bf(x)
    if how == "tf32":
        return tf32(x)
    if how == "hilo":
        hi, lo = hilo(x)
        return hi + lo  # exact as a sum in fp32; the tensor cores add both products into one accumulator
    return x.to(F32)


# ----------------------------------------------------------------------------- knobs

# Rounding points of the shipped kernels (value = what ships). 'fp32' switches one off.
SHIPPED = {
    # kda_fwd_chunk/lean
    "gate_clamp": None,      # g floor before the cumulative sum (None: none)
    "anchor": "mid16",       # diagonal 16-row blocks: one anchor at the middle row ('mid16'), or
                             # 8-row sub-blocks at their middles, the off-diagonal 8 x 8 at row 8 ('mid8')
    "gram_a": "lean",        # Akk/Aqk row operands (q_i, k_i gated): bf16(x * bf16(exp)) ('lean'), bf16(x * exp)
    "gram_b": "lean",        # ('bf16'), bf16 hi + lo ('hilo'), tf32, fp32; gram_b: the column operand k_j gated
    "gram_diag_a": None,     # row / column operands of the diagonal 16-row blocks' pieces
    "gram_diag_b": None,     # (None: gram_a / gram_b)
    "aqk_ii": "mma",         # Aqk's i = j entries from the mma ('mma') or as sum_d q k in fp32 ('exact')
    "aqk": "bf16",           # Aqk as the walk (and backward) reads it
    "inv": "fp32",           # (I + L)^-1 inside the chunk stage (3xTF32 ~ fp32)
    "t_op": "bf16",          # T = (I + L)^-1 Diag(beta) as the W/U product operand
    "kexp": "bf16",          # K e^Gamma as the W product operand ('hilo': bf16 hi + lo, a second mma pass)
    "w_beta": "t",           # where beta enters W: in T = bf16((I + L)^-1 Diag(beta)) ('t', the kernel), or in
                             # the K operand bf16(beta K e^Gamma) with bf16((I + L)^-1) for W only ('k'), or in
                             # both operands of W and U: bf16((I + L)^-1) @ bf16(beta K e^Gamma) / bf16(beta V)
                             # ('kv', FLA's form), or T's diagonal out of the mma and beta_i K_i e^Gamma_i added
                             # to W's accumulator in fp32 ('t_diag')
    "entering": "decay",     # the initial state / dh0 times kda.entering_decay when g is floored (the op does)
    "w": "bf16", "u": "bf16", "qg": "bf16", "kg": "bf16",
    # kda_fwd_walk
    "s_op": "bf16",          # the state as a product operand
    "vnew": "bf16",          # V' as a product operand (and the saved V')
    "o_acc": "one",          # O = Qg S + Aqk V' in one fp32 accumulator
    "o_diag": "mma",         # Aqk's i = j terms of O: inside the bf16 mma ('mma'); out of the tile and added
                             # as Aqk_ii (fp32) x V'_i (the fp32 accumulator V' is rounded from) ('fp32'); or
                             # the mma's plus (Aqk_ii - bf16(Aqk_ii)) x bf16(V'_i) after it ('residual')
    # kda_bwd_walk
    "ds_op": "bf16", "ndv": "bf16",
    "bw_w": "stored",        # the backward walk's W, Qg, Kg operands: the stored bf16 tiles ('stored'), or the
    "bw_qg": "stored",       # chunk stage's unrounded fp32 values as 'fp32' / 'hilo' operands (the walk alone)
    "bw_kg": "stored",
    "bw_order": "kernel",    # dS update: fma(scale, Qg^T dO, e^gamma dS), then W^T (-dV') into that accumulator
                             # ('kernel'), or e^gamma dS + (scale Qg^T dO - W^T dV') ('fla')
    # kda_bwd_chunk
    "tape_op": "bf16",       # S, dS tapes as operands
    "tape_dkg": None,        # dS as the operand of dKg = V' dS^T alone (None: tape_op; 'hilo': a second mma pass)
    "tape_dqg": None,        # S as the operand of dQg = scale dO S^T alone (None: tape_op)
    "akk_inv": "bf16",       # saved (I + L)^-1
    "dvp": "bf16", "dw": "bf16", "drk": "bf16", "drv": "bf16",
    "dqg": "bf16", "dkg": "bf16", "daqk": "bf16", "dakk": "bf16",
    # kda_bwd_gate
    "gated_op": "hilo",      # the gated operand (bf16 hi + lo)
    "gate_diag": "mma",      # the i = j terms of the gated products: inside the mma ('mma') or exact ('exact')
    "daqk_ii": "bf16",       # dAqk's i = j entries as the gate reads them (with gate_diag exact)
    "dg_kg": "total",        # the Kg terms of dg: the chunk's total minus the suffix ('total') or the prefix sum
                             # ('prefix': no cancellation)
    # outputs
    "out": "bf16",           # o, dq, dk, dv, dbeta as returned (bf16 tensors)
}

KNOB_DOC = {
    "gram_a": "Akk/Aqk row operands (chunk stage)", "gram_b": "Akk/Aqk column operand (chunk stage)",
    "aqk": "Aqk stored bf16",
    "t_op": "T = (I+L)^-1 diag(beta) operand", "kexp": "K e^Gamma operand", "w": "W stored", "u": "U stored",
    "qg": "Q e^Gamma stored", "kg": "K e^(gamma-Gamma) stored", "s_op": "walk: S operand",
    "vnew": "walk: V' operand/saved", "ds_op": "bwd walk: dS operand", "ndv": "bwd walk: dV' operand",
    "tape_op": "bwd chunk: S, dS operands", "akk_inv": "(I+L)^-1 saved bf16", "dvp": "bwd chunk: dV'",
    "dw": "bwd chunk: dW", "drk": "bwd chunk: dRk", "drv": "bwd chunk: dRv", "dqg": "dQg stored",
    "dkg": "dKg stored", "daqk": "dAqk stored", "dakk": "dAkk stored", "gated_op": "gate: gated operand",
}

# What the kernels do now (the numerics fixes): the gate floored at -20, the diagonal blocks in three
# anchored pieces, Aqk's diagonal exact and its bf16 rounding error added back after the walk's product, W's
# diagonal term in fp32, dAqk's diagonal terms exact and out of dGamma, dKg in fp32 with dS as hi + lo, dg's Kg
# terms as a prefix sum, dV' as bf16 hi + lo in kda_bwd_chunk.
FIXED = dict(SHIPPED, gate_clamp=20.0, anchor="mid8", aqk_ii="exact", o_diag="residual", w_beta="t_diag",
             gate_diag="exact", daqk_ii="fp32", dkg="fp32", tape_dkg="hilo", dg_kg="prefix", dvp="hilo")


# ----------------------------------------------------------------------------- inputs

def make_inputs(lens, H, gate, seed, beta_max=1.0, init=False, dfinal=True):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(BF)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(BF)
    v = torch.randn(1, T, H, K, generator=gen).to(BF)
    u01 = torch.rand(1, T, H, K, generator=gen)
    if gate.startswith("const"):
        g = torch.full((1, T, H, K), float(gate[5:]))
    elif gate.startswith("unif"):
        g = float(gate[4:]) * u01
    elif gate == "zero":
        g = torch.zeros(1, T, H, K)
    elif gate == "mild":
        g = -0.05 * u01
    elif gate == "ninf":  # uniform in [-5, 0], a few channels and tokens -inf (resets)
        g = -5.0 * u01
        g[..., ::16] = torch.where(torch.rand(1, T, H, 8, generator=gen) < 0.05, float("-inf"), g[..., ::16])
    else:
        raise ValueError(gate)
    beta = (beta_max * torch.rand(1, T, H, generator=gen)).to(BF)
    h0 = 0.1 * torch.randn(len(lens), H, K, K, generator=gen) if init else None
    do = torch.randn(1, T, H, K, generator=gen).to(BF)
    dht = torch.randn(len(lens), H, K, K, generator=gen) if dfinal else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, do=do, dht=dht, cu=[0] + list(torch.tensor(lens).cumsum(0).tolist()))


def truth(x):
    """fp64 reference: o, final state, and every gradient (dq, dk, dv, dg, dbeta, dh0)."""
    cu = x["cu"]
    d = {n: x[n].double() for n in ("q", "k", "v", "g", "beta")}
    h0 = None if x["h0"] is None else x["h0"].double()
    dht = None if x["dht"] is None else x["dht"].double()
    sv = R.kda_chunked_fwd_saved(d["q"], d["k"], d["v"], d["g"], d["beta"], cu_seqlens=cu, initial_state=h0)
    grads = R.kda_chunked_bwd(sv, x["do"].double(), dht, **d)  # exact for g = -inf too (reference.G_FLOOR)
    o, ht = sv["o"], sv["final_state"]
    return dict(o=o, final_state=ht, **dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads)))


# ----------------------------------------------------------------------------- packing into chunks

def chunks_of(cu):
    """(document, first token, length) of every chunk in packed order."""
    return [(n, c0, min(C, b - c0)) for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])) for c0 in range(a, b, C)]


def to_chunks(x, table, width):
    """[1, T, H, width] -> [n, H, C, width], rows past a chunk's length zero."""
    H = x.shape[2]
    out = torch.zeros(len(table), H, C, width, dtype=x.dtype)
    for c, (_, t0, n) in enumerate(table):
        out[c, :, :n] = x[0, t0:t0 + n].transpose(0, 1)
    return out


def from_chunks(y, table, T):
    n_, H, _, width = y.shape
    out = torch.zeros(1, T, H, width, dtype=y.dtype)
    for c, (_, t0, n) in enumerate(table):
        out[0, t0:t0 + n] = y[c, :, :n].transpose(0, 1)
    return out


def beta_chunks(beta, table):
    H = beta.shape[2]
    out = torch.zeros(len(table), H, C)
    for c, (_, t0, n) in enumerate(table):
        out[c, :, :n] = beta[0, t0:t0 + n].transpose(0, 1).float()
    return out


def cumgate(g, kn):
    """Gamma (natural units, fp32 running sum in row order) and G = Gamma log2 e; padding rows g = 0
    (they repeat the last row)."""
    if kn["gate_clamp"] is not None:
        g = torch.clamp(g, min=-kn["gate_clamp"])
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
        diag = r0 >= j0
        op_a = kn["gram_diag_a"] if diag and kn["gram_diag_a"] else kn["gram_a"]
        op_b = kn["gram_diag_b"] if diag and kn["gram_diag_b"] else kn["gram_b"]
        kb = operand(k[:, :, j0:j1].float(), fb, op_b)
        ka = operand(k[:, :, r0:r1].float(), fa, op_a)
        qa = operand(q[:, :, r0:r1].float(), fa, op_a)
        accK = ka @ kb.transpose(-1, -2)
        accQ = qa @ kb.transpose(-1, -2)
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
        U = rnd(rnd(inv, kn["t_op"]) @ rnd(v.float() * beta[..., None], kn["t_op"]), kn["u"])
    else:
        U = rnd(T @ v.float(), kn["u"])
    Qg32 = q.float() * ex2(G)
    Kg32 = k.float() * ex2(G[:, :, -1:] - G)
    Qg = rnd(Qg32, kn["qg"])
    Kg = rnd(Kg32, kn["kg"])
    if kn["aqk"] == "bf16d":  # bf16 with its i = j entries kept in fp32 (a [T, H] side tensor)
        Aqk_r = bf(Aqk)
        Aqk_r = Aqk_r + torch.diag_embed(torch.diagonal(Aqk, dim1=-2, dim2=-1) - torch.diagonal(Aqk_r, dim1=-2, dim2=-1))
    else:
        Aqk_r = rnd(Aqk, kn["aqk"])
    return dict(W=W, U=U, Qg=Qg, Kg=Kg, Aqk=Aqk_r, L=L, inv=inv, W32=W32, Qg32=Qg32, Kg32=Kg32,
                Aqk_ii=torch.diagonal(Aqk, dim1=-2, dim2=-1))


def fwd_walk(cs, gam_last, table, cu, h0, scale, kn):
    """The forward walk with the output stage: O, the state tape (fp32, at chunk starts), V', final states."""
    n, H = cs["W"].shape[:2]
    O = torch.zeros(n, H, C, K)
    Vn = torch.zeros(n, H, C, K)
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
        if kn["o_diag"] == "fp32":
            A = cs["Aqk"][c] - torch.diag_embed(torch.diagonal(cs["Aqk"][c], dim1=-2, dim2=-1))
            O[c] = scale * (cs["Qg"][c] @ Sb + A @ vn + cs["Aqk_ii"][c][..., None] * vn32)
        elif kn["o_diag"] == "residual":
            res = cs["Aqk_ii"][c] - torch.diagonal(cs["Aqk"][c], dim1=-2, dim2=-1)
            O[c] = scale * ((cs["Qg"][c] @ Sb + cs["Aqk"][c] @ vn) + res[..., None] * vn)
        elif kn["o_acc"] == "one":
            O[c] = scale * (cs["Qg"][c] @ Sb + cs["Aqk"][c] @ vn)
        S = torch.exp(gam_last[c])[:, :, None] * S + cs["Kg"][c].transpose(-1, -2) @ vn
        if t0 + ln == cu[doc + 1]:
            final[doc] = S
    return O, tape, Vn, final


# ----------------------------------------------------------------------------- backward

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
    dvp = rnd(scale * (cs["Aqk"].transpose(-1, -2) @ dO) + cs["Kg"] @ dS, kn["dvp"])
    tri = torch.tril(torch.ones(C, C))
    tri_s = torch.tril(torch.ones(C, C), -1)
    out = dict(dgam_s=dgam_s)
    Sq = S if kn["tape_dqg"] is None else rnd(tape, kn["tape_dqg"])
    dSk = dS if kn["tape_dkg"] is None else rnd(dtape, kn["tape_dkg"])
    out["dQg"] = rnd(scale * (dO @ Sq.transpose(-1, -2)), kn["dqg"])
    out["dKg"] = rnd(Vn @ dSk.transpose(-1, -2), kn["dkg"])
    dAqk32 = scale * tri * (dO @ Vn.transpose(-1, -2))
    out["dAqk"] = rnd(dAqk32, kn["daqk"])
    out["dAqk_ii"] = rnd(torch.diagonal(dAqk32, dim1=-2, dim2=-1), kn["daqk_ii"])
    dW = rnd(-(dvp @ S.transpose(-1, -2)), kn["dw"])
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


# ----------------------------------------------------------------------------- FLA 0.6.0

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


# ----------------------------------------------------------------------------- report

OUTPUTS = ("o", "dq", "dk", "dv", "dg", "dbeta", "final_state", "dh0")


def rel_rms(x, ref):
    x = x.double()
    if not torch.isfinite(x).all():
        return float("nan")
    den = ref.norm()
    return ((x - ref).norm() / den).item() if den > 0 else (x - ref).norm().item()


def errors(res, ref):
    return {n: rel_rms(res[n], ref[n]) for n in OUTPUTS if res.get(n) is not None and ref.get(n) is not None}


def fmt(e):
    return " ".join(f"{e.get(n, float('nan')):9.2e}" for n in OUTPUTS)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", default="700,333", help="document lengths")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--gate", default="unif-5", help="comma list of unif-5 | unif-20 | unif-60 | const-8 | const-12 | "
                                                     "const-30 | zero | mild | ninf")
    ap.add_argument("--beta-max", type=float, default=1.0)
    ap.add_argument("--init", action="store_true", help="with an initial state")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--range", action="store_true", help="also the min and max over seeds (for test bounds)")
    ap.add_argument("--arms", default="attribution",
                    help="attribution | comma list of shipped, fixed, fla, all-fp32, or knob overrides "
                         "[base:]knob=value+knob=value (base: shipped or fixed)")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args(argv)
    if a.list:
        for kname, doc in KNOB_DOC.items():
            print(f"{kname:10s} {str(SHIPPED[kname]):6s} {doc}")
        return
    lens = [int(s) for s in a.lens.split(",")]
    arms = []
    if a.arms == "attribution":
        arms = [("shipped", SHIPPED)]
        arms += [(f"{n}=fp32", dict(SHIPPED, **{n: "fp32"})) for n in KNOB_DOC]
        for a_, b_ in (("bf16", "bf16"), ("tf32", "tf32"), ("lean", "hilo"), ("bf16", "hilo"), ("fp32", "fp32")):
            arms.append((f"gram {a_}/{b_}", dict(SHIPPED, gram_a=a_, gram_b=b_)))
        arms += [("all fp32", dict(SHIPPED, **{n: "fp32" for n in KNOB_DOC})), ("fla", None)]
    else:
        table = {"shipped": SHIPPED, "fixed": FIXED, "fla": None,
                 "all-fp32": dict(SHIPPED, **{n: "fp32" for n in KNOB_DOC})}
        for spec in a.arms.split(","):
            base, _, over = spec.rpartition(":") if ":" in spec else ("shipped", "", spec)
            if "=" not in over:
                arms.append((spec, table[spec]))
                continue
            kn = dict(table[base])
            for item in over.split("+"):
                key, val = item.split("=")
                if key not in kn:
                    raise SystemExit(f"unknown knob {key} (see --list)")
                kn[key] = None if val == "none" else float(val) if key == "gate_clamp" else val
            arms.append((spec, kn))
    width = max(18, max(len(n) for n, _ in arms))
    for gate in a.gate.split(","):
        sums = {n: {} for n, _ in arms}
        for s in range(a.seeds):
            x = make_inputs(lens, a.heads, gate, 1000 + s, beta_max=a.beta_max, init=a.init)
            ref = truth(x)
            for name, kn in arms:
                res = run_fla(x) if kn is None else run_kda(x, kn)
                for o, e in errors(res, ref).items():
                    sums[name].setdefault(o, []).append(e)
        print(f"lens {lens} H {a.heads} gate {gate} beta in [0, {a.beta_max}) init {a.init} seeds {a.seeds}: "
              f"relative RMS error vs fp64 (mean over seeds)")
        print(f"{'arm':{width}s} " + " ".join(f"{n:>9s}" for n in OUTPUTS))
        for name, _ in arms:
            e = {o: sum(v) / len(v) for o, v in sums[name].items()}
            print(f"{name:{width}s} {fmt(e)}", flush=True)
            if a.range:
                for label, pick in (("min", min), ("max", max)):
                    print(f"{'  ' + label:{width}s} {fmt({o: pick(v) for o, v in sums[name].items()})}", flush=True)


if __name__ == "__main__":
    main()
