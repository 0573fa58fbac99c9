"""Inputs, the fp64 truth (kda_aot.reference) and packing a token-major tensor into chunks."""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from kda_aot import reference as R  # noqa: E402

from .rounding import BF, C, K  # noqa: E402

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
