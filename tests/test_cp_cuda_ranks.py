"""Context parallelism over two ranks with the CUDA backend (the kernels), head dim 128: over NCCL
with a GPU per rank when two GPUs are present, else both ranks on one GPU with gloo between them
(cp_workers "cuda-shared": the kernels run as under NCCL, only the transport of the one all_gather
differs).

Every layout, both backward modes, packs with a document spanning both ranks (cut inside a
chunk), documents shorter than a chunk and one longer than a rank's share. CP outputs and
gradients are compared with the fp64 reference on the same (bf16-valued) inputs: relative RMS
error < 1e-2, the kernels' bf16 budget (test_kda_fwd_gpu); the fp32 summaries add rounding far
below it (test_cp_gloo: < 1e-4). Saved and replay are bitwise equal on every rank. Strong
gates (constant -12 and -30, uniform in [-60, 0], resets g = -inf) under every layout, with beta
in [0, 2) and initial states: finite, and within the single-GPU bounds of tests/test_kda_numerics_gpu.py.
Skipped without a GPU.
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import cp_workers  # noqa: E402
from conftest import gpu  # noqa: E402
from reftools import rel_rms  # noqa: E402
import test_cp_gloo as G  # noqa: E402
from cp_cases import gen_for  # noqa: E402
from bench.numerics import gate as numerics_gate  # noqa: E402
from kda_aot import cp, reference  # noqa: E402
from kda_aot.nn import PackedKDA  # noqa: E402

pytestmark = gpu
W, H, K = 2, 2, 128
TRANSPORT = "cuda" if torch.cuda.device_count() >= 2 else "cuda-shared"  # cp_workers.run_job's device
REL = 1e-2
# Strong gates (bench.numerics.gate; beta in [0, 2), initial states): the single-GPU bounds of
# tests/test_kda_numerics_gpu.py (dbeta 5e-2: heavy-tailed where its terms cancel). Below the kernels'
# gate floor (GATE_FLOOR, -20) dg is zero (the floor's derivative) and the truth ~e^g: not bounded, checked zero.
STRONG_GATES = ("const-12", "const-30", "unif-60", "ninf")
STRONG_PACKS = ("mixed", "spans")
STRONG_BOUND = {"dbeta": 5e-2}
# At constant strong gates a document's final state is its last tokens' Kg^T U, U's rounding added back on the
# rank where it ends (docs/numerics.md, "The final state"): ~1e-7 there, 1.7e-3 without it.
FINAL_LO_GATES = ("const-12", "const-30")
PACKS = {"spans": [1500, 80], "mixed": [1, 63, 64, 65, 700, 130, 5], "single": [2100],
         "long": [9000, 300, 4200]}  # T % 4 == 0 (zigzag); "long": fragments of > 32 chunks (summary pieces)
PER_FRAGMENT = {"cp_batched_summaries": False}  # Options; the default is batched
EXCHANGE_BESIDE = {"cp_exchange_beside": True, "cp_piece_senders": True}  # both off by default
_JOB = {}


@functools.lru_cache(maxsize=None)
def inputs(pack, gate="log-uniform"):
    """The pack's inputs: g log-uniform in [-5, -0.007] and beta in [0, 1), or one of STRONG_GATES with beta
    in [0, 2) (FLA's allow_neg_eigval range)."""
    gen = gen_for("cuda-cp", pack) if gate == "log-uniform" else gen_for("cuda-cp", pack, gate)
    n, N = sum(PACKS[pack]), len(PACKS[pack])
    return {"q": F.normalize(torch.randn(1, n, H, K, generator=gen), dim=-1).to(torch.bfloat16),
            "k": F.normalize(torch.randn(1, n, H, K, generator=gen), dim=-1).to(torch.bfloat16),
            "v": torch.randn(1, n, H, K, generator=gen).to(torch.bfloat16),
            "g": (-torch.exp(torch.empty(1, n, H, K).uniform_(-5, 1.6, generator=gen)) if gate == "log-uniform"
                  else numerics_gate(gate, (1, n, H, K), gen, 0.05)),
            "beta": ((1.0 if gate == "log-uniform" else 2.0) * torch.rand(1, n, H, generator=gen)).to(torch.bfloat16),
            "h0": 0.1 * torch.randn(N, H, K, K, generator=gen),
            "wo": torch.randn(1, n, H, K, generator=gen).to(torch.bfloat16),
            "ws": torch.randn(N, H, K, K, generator=gen)}


@functools.lru_cache(maxsize=None)
def expected(pack, gate="log-uniform"):
    x = inputs(pack, gate)
    leaves = {n: x[n].double().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "h0")}
    o, s = reference.kda_chunked(*(leaves[n] for n in ("q", "k", "v", "g", "beta")),
                                 cu_seqlens=G.cu_of(PACKS[pack]), initial_state=leaves["h0"],
                                 output_final_state=True, dtype=torch.float64)
    ((o * x["wo"].double()).sum() + (s * x["ws"].double()).sum()).backward()
    return {"o": o.detach(), "final": s.detach(), **{"d" + n: t.grad for n, t in leaves.items()}}


@functools.lru_cache(maxsize=None)
def module_case(pack):
    """PackedKDA inputs (bf16 activations), weights, and the fp64 single-device reference module."""
    gen = gen_for("cuda-cp-module", pack)
    n, D = sum(PACKS[pack]), H * K
    torch.manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
    ref = PackedKDA(H, K, conv_bias=True).double()
    sd = {name: t.detach().float().clone() for name, t in ref.state_dict().items()}
    x = {"q": torch.randn(1, n, D, generator=gen).to(torch.bfloat16),
         "k": torch.randn(1, n, D, generator=gen).to(torch.bfloat16),
         "v": torch.randn(1, n, D, generator=gen).to(torch.bfloat16),
         "g": -torch.exp(torch.empty(1, n, H, K).uniform_(-5, 1.6, generator=gen)),
         "beta": torch.rand(1, n, H, generator=gen).to(torch.bfloat16),
         "wo": torch.randn(1, n, H, K, generator=gen).to(torch.bfloat16)}
    leaves = {name: x[name].double().requires_grad_(True) for name in ("q", "k", "v", "g", "beta")}
    o, _ = ref(*leaves.values(), cu_seqlens=G.cu_of(PACKS[pack]))
    (o * x["wo"].double()).sum().backward()
    want = {"o": o.detach(), **{"d" + name: t.grad for name, t in leaves.items()},
            **{"d" + name: p.grad for name, p in ref.named_parameters()}}
    return x, sd, want


def results(name):
    if not _JOB:
        cases = [{"kind": "op", "backend": "cuda", "name": f"{lay}/{pack}", "layout": lay,
                  "cu": G.cu_of(PACKS[pack]), "inputs": inputs(pack), "state_dtype": torch.float32,
                  "modes": ["saved", "replay"]} for lay in cp.LAYOUTS for pack in PACKS]
        # one summary per fragment (cp_batched_summaries off; the default batches them in pieces composed in fp32)
        cases += [{"kind": "op", "backend": "cuda", "name": f"per-fragment/{lay}/{pack}", "layout": lay,
                   "cu": G.cu_of(PACKS[pack]), "inputs": inputs(pack), "state_dtype": torch.float32,
                   "modes": ["saved", "replay"], "options": PER_FRAGMENT} for lay in cp.LAYOUTS for pack in ("mixed", "long")]
        # the plain order (Options.cp_pipeline off; the default pipelines the chunk stage with the walks)
        cases += [{"kind": "op", "backend": "cuda", "name": f"plain-order/{lay}/{pack}", "layout": lay,
                   "cu": G.cu_of(PACKS[pack]), "inputs": inputs(pack), "state_dtype": torch.float32,
                   "modes": ["saved", "replay"], "options": {"cp_pipeline": False}}
                  for lay in cp.LAYOUTS for pack in ("mixed", "long")]
        # the forward's exchange on a stream of its own and the sent chains in pieces (off by default)
        cases += [{"kind": "op", "backend": "cuda", "name": f"exchange-beside/{lay}/{pack}", "layout": lay,
                   "cu": G.cu_of(PACKS[pack]), "inputs": inputs(pack), "state_dtype": torch.float32,
                   "modes": ["saved", "replay"], "options": EXCHANGE_BESIDE} for lay in cp.LAYOUTS for pack in PACKS]
        for lay in cp.LAYOUTS:
            x, sd, _ = module_case("spans")
            cases.append({"kind": "module", "backend": "cuda", "name": f"module/{lay}/spans", "layout": lay,
                          "cu": G.cu_of(PACKS["spans"]), "inputs": x, "state_dict": sd, "H": H, "head_dim": K,
                          "modes": ["saved", "replay"]})
        cases += [{"kind": "op", "backend": "cuda", "name": f"strong-{gate}/{lay}/{pack}", "layout": lay,
                   "cu": G.cu_of(PACKS[pack]), "inputs": inputs(pack, gate), "state_dtype": torch.float32,
                   "modes": ["saved", "replay"]} for gate in STRONG_GATES for lay in cp.LAYOUTS for pack in STRONG_PACKS]
        with tempfile.TemporaryDirectory(prefix="kda_cp_cuda_ranks_") as d:
            per_rank = cp_workers.run_job(W, cases, d, 600, device=TRANSPORT)
        _JOB.update({n: [r.get(n, {"error": "missing"}) for r in per_rank] for n in per_rank[0]})
    return G.check_results(_JOB.get(name), f"{TRANSPORT} {name}")


@pytest.mark.parametrize("layout,pack", [(lay, p) for lay in cp.LAYOUTS for p in PACKS])
def test_exchange_beside_is_bitwise_the_default(layout, pack):
    """Options.cp_exchange_beside and cp_piece_senders (the forward's summaries, exchange and
    deferred walks on a stream of their own; the sent chains and a rank's only one in pieces): only the
    order changes, so every output and gradient is bitwise the default's, on every rank, in both modes."""
    default, beside = results(f"{layout}/{pack}"), results(f"exchange-beside/{layout}/{pack}")
    for r, (a, b) in enumerate(zip(default, beside)):
        for mode in ("saved", "replay"):
            for key, x in a[mode].items():
                y = b[mode][key]
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), \
                    f"rank {r} {mode} {key} ({layout} {pack}) differs with the exchange beside"


@pytest.mark.parametrize("layout,pack,summaries", [(lay, p, "batched") for lay in cp.LAYOUTS for p in PACKS]
                         + [(lay, p, kind) for kind in ("per-fragment", "plain-order") for lay in cp.LAYOUTS
                            for p in ("mixed", "long")])
def test_cuda_backend_matches_reference(layout, pack, summaries):
    """Both summary paths: batched (the default: all the rank's fragments in two launches, each
    fragment cut into pieces composed in fp32) and one per fragment (Options.cp_batched_summaries off);
    both orders: the chunk stage pipelined with the walks (the default) and the plain order
    (Options.cp_pipeline off): saved and replay gradients bitwise equal in each."""
    res = results(f"{layout}/{pack}" if summaries == "batched" else f"{summaries}/{layout}/{pack}")
    G.check_modes_bitwise(res, f"cuda {summaries} {layout} {pack}")
    plan = cp.make_plan(G.cu_of(PACKS[pack]), layout, world_size=W, rank=0)
    want = expected(pack)
    loc = [r["saved"] for r in res]
    got = {key: plan.unshard([x[key] for x in loc]) for key in ("o", "dq", "dk", "dv", "dg", "dbeta")}
    got.update({key: torch.stack([x[key] for x in loc]).sum(0) for key in ("final", "dh0")})
    for key, x in got.items():
        e = rel_rms(x, want[key])
        print(f"{layout} {pack} {key}: {e:.2e}")
        assert torch.isfinite(x).all() and e < REL, f"{key}: {e:.3e} ({layout} {pack}, seed {G.SEED})"


@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_cuda_module_matches_fp64_single_device(layout):
    """PackedKDA(backend="cuda") under CP2 (conv halo, L2 norm, CP KDA on the kernels): o and every
    gradient (q, k, v, g, beta, conv weights and biases) vs the fp64 single-device module; same
    bf16 budget (the conv output is rounded to bf16 once more, 2^-9)."""
    res = results(f"module/{layout}/spans")
    G.check_modes_bitwise(res, f"cuda module {layout}")
    plan = cp.make_plan(G.cu_of(PACKS["spans"]), layout, world_size=W, rank=0)
    _, _, want = module_case("spans")
    loc = [r["saved"] for r in res]
    for key in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        e = rel_rms(plan.unshard([x[key] for x in loc]), want[key])
        print(f"module {layout} {key}: {e:.2e}")
        assert e < REL, f"{key}: {e:.3e} ({layout}, seed {G.SEED})"
    for key in want:
        if key.endswith("_conv_weight") or key.endswith("_conv_bias"):
            got = sum(r["saved"][key] for r in res)   # each rank's share of the parameter gradient
            e = rel_rms(got, want[key])
            assert e < REL, f"{key}: {e:.3e} ({layout}, seed {G.SEED})"


@pytest.mark.parametrize("gate,layout,pack", [(g, lay, p) for g in STRONG_GATES for lay in cp.LAYOUTS for p in STRONG_PACKS])
def test_strong_gates_match_reference(gate, layout, pack):
    """Strong decays and resets through the kernels' CP path (fragment summaries, the
    exchange, the entering states, both backward modes): every output finite, saved = replay bitwise,
    each within the single-GPU bound of the fp64 reference; dg zero where g is below the floor."""
    res = results(f"strong-{gate}/{layout}/{pack}")
    G.check_modes_bitwise(res, f"cuda strong {gate} {layout} {pack}")
    plan = cp.make_plan(G.cu_of(PACKS[pack]), layout, world_size=W, rank=0)
    want = expected(pack, gate)
    loc = [r["saved"] for r in res]
    got = {key: plan.unshard([x[key] for x in loc]) for key in ("o", "dq", "dk", "dv", "dg", "dbeta")}
    got.update({key: torch.stack([x[key] for x in loc]).sum(0) for key in ("final", "dh0")})
    below = inputs(pack, gate)["g"] < G.GATE_FLOOR
    for key, x in got.items():
        assert torch.isfinite(x).all(), f"{key} not finite ({gate} {layout} {pack}, seed {G.SEED})"
        if key == "dg" and below.all():
            continue
        e = rel_rms(x, want[key])
        print(f"{gate} {layout} {pack} {key}: {e:.2e}")
        bound = 1e-4 if key == "final" and gate in FINAL_LO_GATES else STRONG_BOUND.get(key, REL)
        assert e < bound, f"{key}: {e:.3e} ({gate} {layout} {pack}, seed {G.SEED})"
    assert torch.equal(got["dg"][below], torch.zeros_like(got["dg"][below]))
