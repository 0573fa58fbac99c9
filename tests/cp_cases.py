"""The cases of tests/test_cp_gloo.py (and of the CP tests that reuse them: test_cp_cuda_ranks, test_cp_nccl): the
packs, the global inputs of each kind of case (fresh every run: KDA_TEST_SEED=<seed> replays one) and what one device
computes on them (kda_aot.reference, fp64 or fp32)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from bench.numerics import gate as numerics_gate
from kda_aot import reference
from kda_aot.nn import PackedKDA
from reftools import fla_beta, fla_gate, fla_heads

from conftest import generator

H, K = 2, 16
T = 384                   # divisible by 2W for every W tested (contiguous/zigzag need it)

# Packs (document lengths). Every W sees documents shorter than a rank's share (T / W), a
# document spanning every rank ("long"), empty doc_zigzag pieces (documents of fewer than 2W
# chunks) and, at W = 8, ranks holding no token at all and zigzag parts of 3 tokens, shorter
# than the conv halo ("tiny", T = 48); at W = 4 and 8, zigzag parts of 2 and 1 tokens inside a
# document ("specks", T = 16): a token then lies in the halos of two or three later fragments, whose
# gradients its owner sums.
PACKS = {
    "mixed": [37, 5, 170, 1, 64, 107],
    "long": [T],
    "short": [3, 70, 1, 130, 2, 64, 50, 64],
    "tiny": [20, 28],
}


def _random_pack():
    g = generator("cp-random-pack")
    cuts = sorted(torch.randperm(T - 1, generator=g)[:6].add(1).tolist())
    return [b - a for a, b in zip([0] + cuts, cuts + [T])]


PACKS["random"] = _random_pack()
MAIN_PACKS = tuple(PACKS)  # every world size's sweep
PACKS["specks"] = [5, 11]  # T = 16: W = 4 and 8 only (contiguous and zigzag need T % 2W == 0)


def cu_of(lens):
    return [0] + torch.tensor(lens).cumsum(0).tolist()


def gen_for(*key):
    return generator(key)


FLA_CASES = {"softplus": {"lower_bound": None, "allow_neg_eigval": False},
             "lower-bound": {"lower_bound": -5.0, "safe_gate": True, "allow_neg_eigval": True}}


@functools.lru_cache(maxsize=None)
def kda_inputs(pack, dtype, gate="log-uniform"):
    """Global inputs. g is log-uniform in [-5, -0.007]: its slow channels keep a state alive
    over hundreds of tokens, so the state passed between fragments matters (test_sensitivity);
    or one of STRONG_GATES."""
    gen = gen_for("kda", pack) if gate == "log-uniform" else gen_for("kda", pack, gate)
    n = sum(PACKS[pack])
    f64 = torch.float64
    x = {"q": F.normalize(torch.randn(1, n, H, K, generator=gen, dtype=f64), dim=-1),
         "k": F.normalize(torch.randn(1, n, H, K, generator=gen, dtype=f64), dim=-1),
         "v": torch.randn(1, n, H, K, generator=gen, dtype=f64),
         "g": (-torch.exp(torch.empty(1, n, H, K, dtype=f64).uniform_(-5, 1.6, generator=gen))
               if gate == "log-uniform" else numerics_gate(gate, (1, n, H, K), gen, 0.05, f64)),
         "beta": 0.01 + 0.98 * torch.rand(1, n, H, generator=gen, dtype=f64),
         "h0": torch.randn(len(PACKS[pack]), H, K, K, generator=gen, dtype=f64),
         "wo": torch.randn(1, n, H, K, generator=gen, dtype=f64),
         "ws": torch.randn(len(PACKS[pack]), H, K, K, generator=gen, dtype=f64)}
    return {k: v.to(dtype) for k, v in x.items()}


@functools.lru_cache(maxsize=None)
def fla_inputs(pack):
    """FLA's raw inputs with grouped value heads (HV = 2 H): the raw gate, beta logits, A_log, dt_bias."""
    gen = gen_for("fla", pack)
    n, HV, f64 = sum(PACKS[pack]), 2 * H, torch.float64
    x = {"q": F.normalize(torch.randn(1, n, H, K, generator=gen, dtype=f64), dim=-1),
         "k": F.normalize(torch.randn(1, n, H, K, generator=gen, dtype=f64), dim=-1),
         "v": torch.randn(1, n, HV, K, generator=gen, dtype=f64), "g": torch.randn(1, n, HV, K, generator=gen, dtype=f64),
         "beta": torch.randn(1, n, HV, generator=gen, dtype=f64),
         "h0": torch.randn(len(PACKS[pack]), HV, K, K, generator=gen, dtype=f64),
         "A_log": torch.rand(HV, generator=gen, dtype=f64), "dt_bias": torch.randn(HV * K, generator=gen, dtype=f64),
         "wo": torch.randn(1, n, HV, K, generator=gen, dtype=f64),
         "ws": torch.randn(len(PACKS[pack]), HV, K, K, generator=gen, dtype=f64)}
    return {k_: v_.float() for k_, v_ in x.items()}


@functools.lru_cache(maxsize=None)
def fla_expected(pack, kind):
    """FLA's formulas in fp64 on one device: q, k per value head, the gate, 2 sigmoid or sigmoid beta."""
    x, cfg = fla_inputs(pack), FLA_CASES[kind]
    leaves = {n: x[n].double().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias")}
    HV = x["v"].shape[2]
    g = fla_gate(leaves["g"], leaves["A_log"], leaves["dt_bias"], cfg["lower_bound"])
    beta = fla_beta(leaves["beta"], cfg["allow_neg_eigval"])
    o, s = reference.kda_chunked(fla_heads(leaves["q"], HV), fla_heads(leaves["k"], HV), leaves["v"], g, beta,
                                 cu_seqlens=cu_of(PACKS[pack]), initial_state=leaves["h0"], output_final_state=True,
                                 dtype=torch.float64)
    ((o * x["wo"].double()).sum() + (s * x["ws"].double()).sum()).backward()
    return {"o": o.detach(), "final": s.detach(), **{"d" + n: t.grad for n, t in leaves.items()}}


@functools.lru_cache(maxsize=None)
def kda_expected(pack, dtype, gate="log-uniform"):
    x = kda_inputs(pack, dtype, gate)
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "h0")}
    o, s = reference.kda_chunked(*(leaves[n] for n in ("q", "k", "v", "g", "beta")),
                                 cu_seqlens=cu_of(PACKS[pack]), initial_state=leaves["h0"],
                                 output_final_state=True, dtype=dtype)
    ((o * x["wo"]).sum() + (s * x["ws"]).sum()).backward()
    return {"o": o.detach(), "final": s.detach(), **{"d" + n: t.grad for n, t in leaves.items()}}


@functools.lru_cache(maxsize=None)
def module_inputs(pack):
    gen = gen_for("module", pack)
    n, D = sum(PACKS[pack]), H * K
    torch.manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
    m = PackedKDA(H, K, conv_bias=True)
    x = {"q": torch.randn(1, n, D, generator=gen), "k": torch.randn(1, n, D, generator=gen),
         "v": torch.randn(1, n, D, generator=gen),
         "g": -torch.exp(torch.empty(1, n, H, K).uniform_(-5, 1.6, generator=gen)),
         "beta": torch.rand(1, n, H, generator=gen), "wo": torch.randn(1, n, H, K, generator=gen)}
    return x, {k: v.detach().clone() for k, v in m.state_dict().items()}


@functools.lru_cache(maxsize=None)
def module_expected(pack):
    x, sd = module_inputs(pack)
    m = PackedKDA(H, K, conv_bias=True)
    m.load_state_dict(sd)
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    o, _ = m(*leaves.values(), cu_seqlens=cu_of(PACKS[pack]))
    (o * x["wo"]).sum().backward()
    return {"o": o.detach(), **{"d" + n: t.grad for n, t in leaves.items()},
            **{"d" + n: p.grad for n, p in m.named_parameters()}}


@functools.lru_cache(maxsize=None)
def conv_inputs(pack):
    gen = gen_for("conv", pack)
    n, D = sum(PACKS[pack]), 24
    return {"x": torch.randn(1, n, D, generator=gen), "w": torch.randn(D, 4, generator=gen),
            "b": torch.randn(D, generator=gen), "wy": torch.randn(1, n, D, generator=gen)}


@functools.lru_cache(maxsize=None)
def conv_expected(pack):
    x = conv_inputs(pack)
    xx, w, b = (x[n].clone().requires_grad_(True) for n in ("x", "w", "b"))
    y = reference.conv1d_silu(xx, w, b, cu_seqlens=cu_of(PACKS[pack]), dtype=torch.float32)
    (y * x["wy"]).sum().backward()
    return {"y": y.detach(), "dx": xx.grad, "dw": w.grad, "db": b.grad}
