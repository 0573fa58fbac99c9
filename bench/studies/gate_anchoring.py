"""Study (CPU): the gated backward half (kda_bwd_gate) under two anchorings, emulating the kernel's
roundings (bf16 dA's and inputs, gated operands as bf16 hi + lo, fp32 accumulation), against fp64:

  current  (the shipped kernel): per 16-row block pair, the gated operand rebuilt per row block I
           (rows: anchor 16 I; cols: anchor 16 J + 15), diagonal blocks at their middle row;
  horner   (docs/backward.md, "The horner sketch"): operands built once per row (rows: Y_j anchored
           at the start of the block after j's; cols: X_i at its own block's start), the per-channel
           block decay delta_K = e^(Gam[16(K+1)] - Gam[16K]) carried on the accumulator between
           k-blocks (Horner), one row scaling at the end; diagonal blocks as in `current`.

Prints the relative RMS error of dq, dk and dg of both against the fp64 reference, per gate.
    python3 bench/studies/gate_anchoring.py
"""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from kda_aot import reference as R  # noqa: E402

F32, B = torch.float32, 16


def bf(x):
    return x.to(torch.bfloat16).to(F32)


def hilo(x):
    """x (fp32) as the kernel feeds it to the tensor cores: bf16 hi plus bf16 lo (its rounding error)."""
    hi = bf(x)
    return hi, bf(x - hi)


def mm(m, y):
    """bf16 M times a hi + lo operand, fp32 accumulation (two mma per step, as the kernel)."""
    hi, lo = hilo(y)
    return m @ hi + m @ lo


def rows(M, Y, G, scheme):
    """rows(M, Y)_id = sum_{j <= i} M_ij Y_jd e^(G_id - G_jd); M bf16 (entries above the diagonal 0)."""
    H, C, K = Y.shape
    out = torch.zeros(H, C, K, dtype=F32)
    for I in range(C // B):
        i0, i1 = B * I, B * I + B
        Gi = G[:, i0:i1]
        m = G[:, i0 + 8:i0 + 9]  # diagonal block: middle anchor
        acc_d = mm(M[:, i0:i1, i0:i1], Y[:, i0:i1] * torch.exp(m - G[:, i0:i1])) * torch.exp(Gi - m)
        acc = torch.zeros(H, B, K, dtype=F32)
        if I > 0 and scheme == "current":
            a = G[:, i0:i0 + 1]
            acc = mm(M[:, i0:i1, :i0], Y[:, :i0] * torch.exp(a - G[:, :i0])) * torch.exp(Gi - a)
        elif I > 0:
            for J in range(I):
                j0, j1 = B * J, B * J + B
                if J > 0:
                    acc = acc * torch.exp(G[:, j1:j1 + 1] - G[:, j0:j0 + 1])  # delta_J
                acc = acc + mm(M[:, i0:i1, j0:j1], Y[:, j0:j1] * torch.exp(G[:, j1:j1 + 1] - G[:, j0:j1]))
            acc = acc * torch.exp(Gi - G[:, i0:i0 + 1])
        out[:, i0:i1] = acc + acc_d
    return out


def cols(M, X, G, scheme):
    """cols(M, X)_jd = sum_{i >= j} M_ij X_id e^(G_id - G_jd)."""
    H, C, K = X.shape
    out = torch.zeros(H, C, K, dtype=F32)
    Mt = M.transpose(1, 2)
    n = C // B
    for J in range(n):
        j0, j1 = B * J, B * J + B
        Gj = G[:, j0:j1]
        m = G[:, j0 + 8:j0 + 9]
        acc_d = mm(Mt[:, j0:j1, j0:j1], X[:, j0:j1] * torch.exp(G[:, j0:j1] - m)) * torch.exp(m - Gj)
        acc = torch.zeros(H, B, K, dtype=F32)
        if J < n - 1 and scheme == "current":
            b = G[:, j1 - 1:j1]
            acc = mm(Mt[:, j0:j1, j1:], X[:, j1:] * torch.exp(G[:, j1:] - b)) * torch.exp(b - Gj)
        elif J < n - 1:
            for I in range(n - 1, J, -1):
                a0, a1 = B * I, B * I + B
                if I < n - 1:
                    acc = acc * torch.exp(G[:, a1:a1 + 1] - G[:, a0:a0 + 1])  # delta_I
                acc = acc + mm(Mt[:, j0:j1, a0:a1], X[:, a0:a1] * torch.exp(G[:, a0:a1] - G[:, a0:a0 + 1]))
            acc = acc * torch.exp(G[:, j1:j1 + 1] - Gj)
        out[:, j0:j1] = acc + acc_d
    return out


def gate(q, k, beta, G, gam, r, scheme):
    """dq, dk, dg of one full chunk from the plain products r (fp64 reference, rounded as the kernel
    reads them: dA's, dQg, dRk, dKg in bf16)."""
    q, k, G = q.to(F32), k.to(F32), G.to(F32)
    b = beta.to(F32)[:, :, None]
    dAqk, dAkk = bf(r["dAqk"]), bf(r["dAkk"])
    dQg, dRk, dKg = bf(r["dQg"]), bf(r["dRk"]), bf(r["dKg"])
    eG, eGg = torch.exp(G), torch.exp(G[:, -1:] - G)
    t = rows(dAkk, k, G, scheme)
    dk_Lr, dk_R, dk_g = b * t, b * dRk * eG, dKg * eGg
    dk_q = cols(dAqk, q, G, scheme)
    dk_Lc = cols(dAkk, b * k, G, scheme)
    dq = dQg * eG + rows(dAqk, k, G, scheme)
    dk = dk_g + dk_R + dk_q + dk_Lr + dk_Lc
    dGam = q * dq + k * (dk_R + dk_Lr - dk_Lc - dk_q - dk_g)
    dGam[:, -1] += (k * eGg * dKg).sum(1) + r["dgam_s"].to(F32)
    dg = torch.flip(torch.cumsum(torch.flip(dGam, [1]), 1), [1])
    return dq, dk, dg


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def main():
    torch.manual_seed(0)
    H, C, K = 4, 64, 128
    for gate_kind in ("rand", "mild", "-5", "0"):
        q = torch.nn.functional.normalize(torch.randn(H, C, K, dtype=torch.float64), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(H, C, K, dtype=torch.float64), dim=-1)
        v, dO = torch.randn(H, C, K, dtype=torch.float64), torch.randn(H, C, K, dtype=torch.float64)
        g = {"rand": -5 * torch.rand(H, C, K), "mild": -0.05 * torch.rand(H, C, K),
             "-5": torch.full((H, C, K), -5.0), "0": torch.zeros(H, C, K)}[gate_kind].double()
        q, k, v, dO = (bf(x).double() for x in (q, k, v, dO))
        beta = bf(torch.rand(H, C, dtype=torch.float64)).double()
        S, dS = torch.randn(H, K, K, dtype=torch.float64), torch.randn(H, K, K, dtype=torch.float64)
        p = R.chunk_prepare(k, v, g, beta, q=q)
        L = R._chunk_akk(k, p["Gam"], beta)
        eye = torch.eye(C, dtype=torch.float64).expand(H, C, C)
        p["Akk_inv"] = torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)
        p["v_new"] = p["U"] - p["W"] @ S
        p["Qg"] = q * torch.exp(p["Gam"])
        r = R.chunk_bwd(q, k, v, beta, dO, S, dS, p, K ** -0.5)
        r["dgam_s"] = torch.exp(p["gam"]) * (S * dS).sum(-1)
        line = [f"g {gate_kind:>4}:"]
        for scheme in ("current", "horner"):
            dq, dk, dg = gate(q, k, beta, p["Gam"], p["gam"], r, scheme)
            line.append(f"{scheme} dq {rel(dq, r['dq']):.2e} dk {rel(dk, r['dk']):.2e} dg {rel(dg, r['dg']):.2e}")
        print("  ".join(line))


if __name__ == "__main__":
    main()
