# Study (CPU, fp64 reference): how far would dg move if dgam_s = e^gam rowsum(S * dS) were formed from a
# bf16 state tape (and/or a bf16 dS tape) instead of fp32?  python3 bench/studies/tape_bf16.py
import torch, sys
sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from kda_aot import reference as R
torch.manual_seed(0)
def make(lens, H, gate):
    T = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, 128, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, 128, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, H, 128, dtype=torch.float64)
    if gate == "rand": g = -5 * torch.rand(1, T, H, 128, dtype=torch.float64)
    elif gate == "-5": g = torch.full((1, T, H, 128), -5.0, dtype=torch.float64)
    elif gate == "0": g = torch.zeros(1, T, H, 128, dtype=torch.float64)
    else: g = -0.05 * torch.rand(1, T, H, 128, dtype=torch.float64)
    beta = torch.rand(1, T, H, dtype=torch.float64)
    cu = [0]
    for n in lens: cu.append(cu[-1] + n)
    return q, k, v, g, beta, cu
bf = lambda x: x.to(torch.bfloat16).to(torch.float64)
for gate in ("rand", "mild", "-5", "0"):
    lens, H = [300, 200], 2
    q, k, v, g, beta, cu = make(lens, H, gate)
    sv = R.kda_chunked_fwd_saved(q, k, v, g, beta, cu_seqlens=cu)
    do = torch.randn_like(v)
    dfs = torch.randn(len(lens), H, 128, 128, dtype=torch.float64)
    dvp = R.kda_bwd_dvp_local(sv, do)
    dS, _ = R.kda_bwd_state_walk(sv, do, dvp, dfs)
    dq, dk, dv, dg, dbeta, dh0 = R.kda_chunked_bwd(sv, do, dfs, q=q, k=k, v=v, g=g, beta=beta)
    out = []
    for name, fS, fD in (("S bf16", bf, lambda x: x), ("S, dS bf16", bf, bf), ("S fp32", lambda x: x.float().double(), lambda x: x.float().double())):
        err = torch.zeros_like(dg)
        for c, (doc, c0, c1) in enumerate(sv["chunks"].tolist()):
            S, D = sv["S"][c], dS[c]
            delta = torch.exp(sv["gam"][c]) * ((fS(S) * fD(D)).sum(-1) - (S * D).sum(-1))  # [H, K]
            err[0, c0:c1] = delta[None, :, :]
        out.append(f"{name}: {(err.norm() / dg.norm()).item():.2e}")
    print(gate, " | ".join(out))
