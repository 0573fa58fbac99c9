"""Context parallelism on CPU over gloo: CP == single device, values and gradients.

Each world size W in {2, 3, 4, 8} is one spawned job (W processes, FileStore, no network
port) running every case of that W; the parent builds the global inputs, computes the
single-device results with kda_aot.reference, and checks what the ranks hand back (local
results, assembled with the plan). Inputs are fresh every run: the seed is printed and
KDA_TEST_SEED=<seed> replays a run.

Error bound (fp32, the configuration the kernels use; K = V = 16, T = 384):
    CP and single device compute the same maths with different roundings: the entering state
    of a fragment is composed as M_{f-1} (... (M_1 S + B_1) ...) + B_{f-1} from fp32 summaries,
    and contiguous/zigzag cut chunks at other places than the single-device walk. Composing n
    fragments adds about n * K * 2^-24 (n <= 16 here: ~1.5e-5) relative error to a state, and
    gradients pick up a few such terms. Measured over 6 seeds (test_zz_report_measured_errors
    prints them with -s): outputs and final states <= 4.2e-6, gradients (q, k, v, g, beta,
    conv weights and biases) <= 6.4e-6, relative to the tensor's max; the same order as the
    single-device fp32 reference's own distance to fp64 (<= 3.1e-6 on these packs).
    REL_BOUND = 1e-4 keeps a >= 15x margin over what we measured and stays far below what a
    wrong state passing gives (test_sensitivity: dropping the entering states moves the
    outputs by more than 1000x the bound on these packs).
fp64 run of the same cases (REL_BOUND_FP64 = 1e-11): checks the logic without fp32 noise.
Saved vs replay: bitwise equal, always.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import cp_workers  # noqa: E402
from conftest import SEED  # noqa: E402
from reftools import rel_err  # noqa: E402
from cp_cases import (FLA_CASES, H, K, MAIN_PACKS, PACKS, conv_expected, conv_inputs, cu_of,  # noqa: E402
                      fla_expected, fla_inputs, kda_expected, kda_inputs, module_expected, module_inputs)
from kda_aot import cp, reference  # noqa: E402
from kda_aot.nn import PackedKDA  # noqa: E402
from kda_aot.schedule.kda import GATE_FLOOR  # noqa: E402
print(f"[test_cp_gloo] KDA_TEST_SEED={SEED}")

REL_BOUND = 1e-4          # fp32 CP vs fp32 single device (see the module docstring)
REL_BOUND_FP64 = 1e-11    # fp64 CP vs fp64 single device (measured ~1e-15)
# Strong gates (STRONG_GATES), fp32 CP against the fp64 single device. After a reset (g = -inf, floored
# at -1000 by the reference) a chunk's cumulative gate is ~-1000, whose fp32 ulp (6e-5) every decay
# factor after it inherits: measured <= 2.0e-4 (dk, ninf), 1e-4 elsewhere (6 seeds). dg at constant -30
# is ~e^-30 of the terms it sums, whose cumulative gates (-30 r, ulp 1e-4 at r = 64) carry into every
# factor, and the pair terms of rows() and cols() cancel in it: measured <= 3.9e-3 (6 seeds).
STRONG_REL_BOUND = 1e-3
STRONG_DG_BOUND = 2e-2
CONV_REL_BOUND = 2e-6     # conv: ulp-level (summation order of halo gradients, SiLU paths)
JOB_TIMEOUT_S = 600       # a hang fails the test instead of blocking CI
LAYOUTS = cp.LAYOUTS
# W = 8 runs one layout sweep on the packs that stress it most (start-up and CPU time).
SWEEP = {2: list(MAIN_PACKS), 3: list(MAIN_PACKS), 4: list(MAIN_PACKS) + ["specks"],
         8: ["long", "short", "tiny", "specks"]}
FP64_PACKS = {2: ["mixed"], 3: ["random"], 4: ["short"], 8: ["tiny"]}
ERROR_VARIANTS = ["cu_seqlens", "layout", "local_shape", "heads", "wrong_rank", "world_size",
                  "halo_layout", "module_local_shape", "module_heads", "k_shape", "module_beta"]
ERROR_WORLDS = (2, 3)


# ----------------------------------------------------------------------------- strong gates, FLA's activations

# Strong decays (bench.numerics.gate): constant -30, uniform in [-60, 0], and g in [-5, 0] with a
# quarter of the channels reset (g = -inf) at 5 % of the tokens.
STRONG_GATES = ("const-30", "unif-60", "ninf")
STRONG_PACKS = {2: "mixed", 3: "random"}   # every layout, both modes, each strong gate


@pytest.mark.parametrize("layout,kind", [(lay, kind) for lay in LAYOUTS for kind in FLA_CASES])
def test_kda_op_with_flas_activations(layout, kind):
    """chunk_kda_cp with FLA's gate and beta activations and grouped value heads (HV = 2 H), per rank, no
    new communication: the fp64 single-device formulas to the fp32 bound, A_log's and dt_bias's gradients
    summed over the ranks (each rank's share of the tokens)."""
    W, pack = 2, "mixed"
    res = results(W, f"op-fla-{kind}/{layout}/{pack}")
    plan, want = plans(W, layout, pack), fla_expected(pack, kind)
    check_modes_bitwise(res, f"op-fla W={W} {layout} {pack}")
    loc = [r["saved"] for r in res]
    for key in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        check_close(f"op-fla-{kind}", W, layout, pack, key, plan.unshard([x[key] for x in loc]), want[key], REL_BOUND)
    for key in ("final", "dh0"):
        check_close(f"op-fla-{kind}", W, layout, pack, key, torch.stack([x[key] for x in loc]).sum(0), want[key],
                    REL_BOUND)
    for key in ("dA_log", "ddt_bias"):
        check_close(f"op-fla-{kind}", W, layout, pack, key, sum(x[key] for x in loc), want[key], REL_BOUND)


# ----------------------------------------------------------------------------- the jobs

def cases_for(W):
    cases = []
    for layout in LAYOUTS:
        for pack in SWEEP[W]:
            cu = cu_of(PACKS[pack])
            cases.append({"kind": "op", "name": f"op/{layout}/{pack}", "layout": layout,
                          "cu": cu, "inputs": kda_inputs(pack, torch.float32),
                          "state_dtype": torch.float32, "modes": ["saved", "replay"]})
            x, sd = module_inputs(pack)
            cases.append({"kind": "module", "name": f"module/{layout}/{pack}", "layout": layout,
                          "cu": cu, "inputs": x, "state_dict": sd, "H": H, "head_dim": K,
                          "modes": ["saved", "replay"]})
            cases.append({"kind": "conv", "name": f"conv/{layout}/{pack}", "layout": layout,
                          "cu": cu, "inputs": conv_inputs(pack)})
        for pack in FP64_PACKS[W]:
            cases.append({"kind": "op", "name": f"op64/{layout}/{pack}", "layout": layout,
                          "cu": cu_of(PACKS[pack]), "inputs": kda_inputs(pack, torch.float64),
                          "state_dtype": torch.float64, "modes": ["replay"]})
    if W in STRONG_PACKS:
        pack = STRONG_PACKS[W]
        for layout in LAYOUTS:
            for gate in STRONG_GATES:
                cases.append({"kind": "op", "name": f"op-{gate}/{layout}/{pack}", "layout": layout,
                              "cu": cu_of(PACKS[pack]), "inputs": kda_inputs(pack, torch.float32, gate),
                              "state_dtype": torch.float32, "modes": ["saved", "replay"]})
    if W == 2:  # the kernels' gate floor on the reference: the CP op's initial-state factor
        for layout in LAYOUTS:
            cases.append({"kind": "op", "name": f"op-floored/{layout}/mixed", "layout": layout,
                          "cu": cu_of(PACKS["mixed"]), "inputs": kda_inputs("mixed", torch.float64, "const-30"),
                          "state_dtype": torch.float64, "modes": ["saved", "replay"],
                          "backend": cp.ReferenceBackend(torch.float64, 64, GATE_FLOOR).spec})
    if W == 2:
        for layout in LAYOUTS:
            for kind, cfg in FLA_CASES.items():
                cases.append({"kind": "op", "name": f"op-fla-{kind}/{layout}/mixed", "layout": layout,
                              "cu": cu_of(PACKS["mixed"]), "inputs": fla_inputs("mixed"), "fla": cfg,
                              "state_dtype": torch.float32, "modes": ["saved", "replay"]})
    if W == 2:
        for layout in LAYOUTS:
            cases.append({"kind": "compiled", "name": f"compiled/{layout}", "layout": layout, "compiler": "aot_eager",
                          "cu": cu_of(PACKS["mixed"]), "inputs": kda_inputs("mixed", torch.float32),
                          "module_inputs": module_inputs("mixed"), "H": H, "head_dim": K})
    if W in ERROR_WORLDS:
        for variant in ERROR_VARIANTS:
            cases.append({"kind": "error", "name": f"error/{variant}", "variant": variant,
                          "cu": cu_of(PACKS["mixed"])})
    return cases


_JOBS = {}


def job(W):
    """Run (once per session) the job of world size W; results[name][rank]."""
    if W not in _JOBS:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"kda_cp_w{W}_") as d:
            per_rank = cp_workers.run_job(W, cases_for(W), d, JOB_TIMEOUT_S)
        names = list(per_rank[0]) + [n for r in per_rank[1:] for n in r if n not in per_rank[0]]
        _JOBS[W] = {n: [r.get(n, {"error": "missing (an earlier case failed)"}) for r in per_rank]
                    for n in names}
        print(f"[test_cp_gloo] W={W}: {len(names)} cases in {time.perf_counter() - t0:.1f} s")
    return _JOBS[W]


def results(W, name):
    return check_results(job(W).get(name), f"W={W} {name}")


def plans(W, layout, pack):
    return cp.make_plan(cu_of(PACKS[pack]), layout, world_size=W, rank=0)


MEASURED = {}   # (kind, W, layout, pack, key) -> relative error; printed at the end


def check_close(kind, W, layout, pack, key, got, want, bound):
    assert torch.isfinite(got).all(), f"{kind} {key}: non-finite values (W={W} {layout} {pack}, seed {SEED})"
    err = rel_err(got, want)
    MEASURED[(kind, W, layout, pack, key)] = err
    assert err < bound, (f"{kind} {key}: relative error {err:.2e} >= {bound:.0e} "
                         f"(W={W} {layout} {pack} {PACKS[pack]}, seed {SEED})")


def check_modes_bitwise(res, what):
    for r, out in enumerate(res):
        if "saved" not in out:
            continue
        for key, a in out["saved"].items():
            b = out["replay"][key]
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), \
                f"{what}: saved and replay differ in {key} on rank {r} (seed {SEED})"


GRID = [(W, layout, pack) for W in SWEEP for layout in LAYOUTS for pack in SWEEP[W]]


def check_results(res, name):
    """Fail with the worker's traceback if a rank reported an error for this case."""
    assert res is not None, f"case {name} did not run (seed {SEED})"
    for out in res:
        assert "error" not in out, f"{name} (seed {SEED}):\n{out['error']}"
    return res


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("W,layout,pack", GRID)
def test_kda_op_matches_single_device(W, layout, pack):
    check_op(results(W, f"op/{layout}/{pack}"), W, layout, pack)


@pytest.mark.parametrize("W,layout,gate", [(W, lay, g) for W in STRONG_PACKS for lay in LAYOUTS for g in STRONG_GATES])
def test_kda_op_strong_gates(W, layout, gate):
    """Strong decays and resets (g = -inf) through the fragments' fp32 summaries: finite, and the
    single-device result within the same bound (a reset makes a summary's M exactly 0 in that channel)."""
    pack = STRONG_PACKS[W]
    check_op(results(W, f"op-{gate}/{layout}/{pack}"), W, layout, pack, gate)


def check_op(res, W, layout, pack, gate="log-uniform"):
    plan = plans(W, layout, pack)
    # strong gates against fp64: fp32 autograd through the reference's forward loses dg there
    want = kda_expected(pack, torch.float32 if gate == "log-uniform" else torch.float64, gate)
    kind = "op" if gate == "log-uniform" else f"op-{gate}"
    bound = REL_BOUND if gate == "log-uniform" else STRONG_REL_BOUND
    check_modes_bitwise(res, f"op W={W} {layout} {pack}")
    loc = [r["saved"] for r in res]
    for key in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        got = plan.unshard([x[key] for x in loc])
        check_close(kind, W, layout, pack, key, got, want[key],
                    STRONG_DG_BOUND if key == "dg" and gate.startswith("const") else bound)
    # final states and the initial-state gradient: one owner per document row, zeros elsewhere
    for key in ("final", "dh0"):
        rows = torch.stack([x[key] for x in loc])                    # [W, N, H, K, V]
        owners = (rows != 0).flatten(2).any(-1).sum(0)
        assert (owners <= 1).all(), f"{key}: a document row is set on several ranks"
        check_close(kind, W, layout, pack, key, rows.sum(0), want[key], bound)
    # gather (collective) == unshard (pure)
    for r in range(W):
        assert torch.equal(res[r]["gathered_o"], plan.unshard([x["o"] for x in loc]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kda_op_under_the_kernels_gate_floor(layout):
    """The reference floored at the kernels' -20 (fp64), every g = -30, initial states: the CP op's
    initial-state factor (kda_aot.cp.collective.entering_decay, on the rank where a document starts) makes
    o, the final states and dh0 the unfloored truth's to ~e^-20 relative (without it dh0 is e^10 off);
    dg is zero (the floor's derivative; the truth is ~e^-30)."""
    res = results(2, f"op-floored/{layout}/mixed")
    plan = plans(2, layout, "mixed")
    want = kda_expected("mixed", torch.float64, "const-30")
    check_modes_bitwise(res, f"op-floored W=2 {layout}")
    loc = [r["saved"] for r in res]
    for key in ("o", "dq", "dk", "dv", "dbeta"):
        check_close("op-floored", 2, layout, "mixed", key, plan.unshard([x[key] for x in loc]), want[key], 1e-6)
    assert all(torch.equal(x["dg"], torch.zeros_like(x["dg"])) for x in loc)
    for key in ("final", "dh0"):
        check_close("op-floored", 2, layout, "mixed", key, torch.stack([x[key] for x in loc]).sum(0), want[key], 1e-6)


@pytest.mark.parametrize("W,layout,pack",
                         [(W, lay, p) for W in FP64_PACKS for lay in LAYOUTS for p in FP64_PACKS[W]])
def test_kda_op_fp64_exact(W, layout, pack):
    """In fp64 the CP result equals the single-device one to rounding: the composition and
    the gradient chain are the same maths, not an approximation."""
    check_op64(results(W, f"op64/{layout}/{pack}"), W, layout, pack)


def check_op64(res, W, layout, pack):
    plan = plans(W, layout, pack)
    want = kda_expected(pack, torch.float64)
    loc = [r["replay"] for r in res]
    for key in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        check_close("op64", W, layout, pack, key, plan.unshard([x[key] for x in loc]), want[key],
                    REL_BOUND_FP64)
    for key in ("final", "dh0"):
        check_close("op64", W, layout, pack, key, torch.stack([x[key] for x in loc]).sum(0),
                    want[key], REL_BOUND_FP64)


@pytest.mark.parametrize("W,layout,pack", GRID)
def test_module_matches_single_device(W, layout, pack):
    check_module(results(W, f"module/{layout}/{pack}"), W, layout, pack)


def check_module(res, W, layout, pack):
    plan = plans(W, layout, pack)
    want = module_expected(pack)
    check_modes_bitwise(res, f"module W={W} {layout} {pack}")
    loc = [r["saved"] for r in res]
    for key in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        check_close("module", W, layout, pack, key, plan.unshard([x[key] for x in loc]),
                    want[key], REL_BOUND)
    for key in [k for k in want if k.endswith("_conv_weight") or k.endswith("_conv_bias")]:
        # parameters are replicated: each rank holds its tokens' share of the gradient
        got = sum(x[key] for x in loc)
        check_close("module", W, layout, pack, key, got, want[key], REL_BOUND)


@pytest.mark.parametrize("W,layout,pack", GRID)
def test_conv_halo_matches_single_device(W, layout, pack):
    check_conv(results(W, f"conv/{layout}/{pack}"), W, layout, pack)


def check_conv(res, W, layout, pack):
    plan = plans(W, layout, pack)
    want = conv_expected(pack)
    x = conv_inputs(pack)["x"]
    for r, out in enumerate(res):
        # The halo holds exact copies of the tokens before each fragment (zeros before the
        # document start), bitwise.
        mine = plan.for_rank(r)
        assert out["halo"].shape == (len(mine.local_fragments), 3, x.shape[-1])
        for f in mine.local_fragments:
            for j in range(3):
                p = f.start - 3 + j
                expect = x[0, p] if p >= mine.cu_seqlens[f.doc] else torch.zeros(x.shape[-1])
                assert torch.equal(out["halo"][f.segment, j], expect), (r, f, j)
    assert all(o.get("y_formula_equal", True) for o in res)
    # Same arithmetic per element; only torch's vectorised-vs-tail SiLU paths (which depend on
    # the segment lengths) may differ by an ulp, hence a bound and not bitwise.
    check_close("conv", W, layout, pack, "y", plan.unshard([o["y"] for o in res]), want["y"],
                CONV_REL_BOUND)
    check_close("conv", W, layout, pack, "dx", plan.unshard([o["dx"] for o in res]), want["dx"],
                CONV_REL_BOUND)
    for key in ("dw", "db"):
        check_close("conv", W, layout, pack, key, sum(o[key] for o in res), want[key],
                    CONV_REL_BOUND)


@pytest.mark.parametrize("variant", ERROR_VARIANTS)
@pytest.mark.parametrize("W", ERROR_WORLDS)
def test_disagreeing_ranks_raise_everywhere(W, variant):
    check_error(results(W, f"error/{variant}"), W, variant)


def check_error(res, W, variant):
    for r, out in enumerate(res):
        assert out["raised"] is not None, f"rank {r} did not raise ({variant})"
        kind, msg = out["raised"]
        assert kind == "ValueError", f"rank {r}: {kind}: {msg}"
        assert "raised on every rank" in msg, msg
        expect = {"cu_seqlens": "disagree on cu_seqlens", "layout": "disagree on layout",
                  "local_shape": "local tokens", "heads": "disagree on H",
                  "wrong_rank": "the plan was built for rank",
                  "world_size": "disagree on world_size", "halo_layout": "disagree on layout",
                  "module_local_shape": "for rank", "module_heads": "disagree on H",
                  # one rank's own shape problem, reported through the agreement (it must not raise alone)
                  "k_shape": "k: expected shape", "module_beta": "beta: expected shape"}
        assert expect[variant] in msg, msg
        assert out["after"] == W * (W - 1) // 2, "the group is out of step after the error"


def test_sensitivity():
    """The packs exercise the state passing: dropping the entering states (every fragment
    starting from zero) moves the outputs far beyond REL_BOUND (100x: over fresh inputs the change
    ranged 0.09-0.95 relative, 10 seeds plus one CI run at 0.0945 that a 1000x margin failed)."""
    for W, layout, pack in [(2, "contiguous", "long"), (4, "doc_zigzag", "long"),
                            (3, "zigzag", "mixed")]:
        plan = plans(W, layout, pack)
        x = kda_inputs(pack, torch.float32)
        cuts = [0] + [f.end for f in plan.fragments]
        o_cut, _ = reference.kda_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                         cu_seqlens=cuts, dtype=torch.float32)
        o, _ = reference.kda_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                     cu_seqlens=cu_of(PACKS[pack]), dtype=torch.float32)
        assert rel_err(o_cut, o) > 100 * REL_BOUND, (W, layout, pack, rel_err(o_cut, o))


def test_world_size_one_in_process(tmp_path):
    """W = 1 in this process: the plan is the single-device segmentation, so CP is bitwise the
    single-device reference (same chunks, same states; the reference backend's backward is the
    written-out one, reference.kda_chunked_bwd), and the collectives are trivial."""
    import datetime
    import torch.distributed as dist
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        for layout in LAYOUTS:
            plan = cp.make_plan(cu_of(PACKS["mixed"]), layout, group=dist.group.WORLD)
            assert len(plan.fragments) == len(PACKS["mixed"])
            x = kda_inputs("mixed", torch.float32)
            leaves = [x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
            o, s = cp.chunk_kda_cp(*leaves, plan=plan, initial_state=x["h0"],
                                   output_final_state=True)
            want = kda_expected("mixed", torch.float32)
            assert torch.equal(o, want["o"]) and torch.equal(s, want["final"])
            ((o * x["wo"]).sum() + (s * x["ws"]).sum()).backward()
            inputs = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
            saved = reference.kda_chunked_fwd_saved(*inputs.values(), cu_seqlens=cu_of(PACKS["mixed"]),
                                                    initial_state=x["h0"], dtype=torch.float32)
            explicit = reference.kda_chunked_bwd(saved, x["wo"], x["ws"], **inputs)
            for n, t, g in zip(("q", "k", "v", "g", "beta"), leaves, explicit):
                assert torch.equal(t.grad, g), n
                assert rel_err(t.grad, want["d" + n]) < REL_BOUND, n  # and autograd's within fp32 rounding
            assert torch.equal(cp.gather(o, plan), o)
            # the module: its CP path (zero halos, one fragment per document) is bitwise its
            # single-device path
            xm, sd = module_inputs("mixed")
            m = PackedKDA(H, K, conv_bias=True)
            m.load_state_dict(sd)
            args = [xm[n] for n in ("q", "k", "v", "g", "beta")]
            o_cp, _ = m(*args, plan=plan)
            o_sd, _ = m(*args, cu_seqlens=cu_of(PACKS["mixed"]))
            assert torch.equal(o_cp, o_sd)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", autouse=True)
def report_measured_errors():
    """After the module's tests: the largest measured relative error per kind and key (run with -s to see it)."""
    yield
    worst = {}
    for (kind, W, layout, pack, key), e in MEASURED.items():
        if e > worst.get((kind, key), (0,))[0]:
            worst[(kind, key)] = (e, W, layout, pack)
    for (kind, key), (e, W, layout, pack) in sorted(worst.items()):
        print(f"[test_cp_gloo] max rel err {kind:7s} {key:18s} {e:.2e}  (W={W} {layout} {pack})")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_steps_are_bitwise_eager(layout):
    """torch.compile(fullgraph=True) of a CP step on two ranks (chunk_kda_cp alone and PackedKDA with its
    halo exchange, both backward modes): one graph through the CP custom ops, bitwise the eager step."""
    for r, out in enumerate(results(2, f"compiled/{layout}")):
        assert all(out["bitwise"].values()), f"rank {r}: {out['bitwise']} (seed {SEED})"
