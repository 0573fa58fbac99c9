"""KDA backward kernels on the GPU against the explicit fp64 reference backward.

The state-gradient walk (kda_bwd_walk) runs on our forward's bf16 intermediates and is compared
with reference.kda_bwd_state_walk on the fp64 forward: relative RMS error < 1e-2, the same
budget as the forward (bf16 intermediates and bf16 operand copies of dS; fp32 accumulation and
an fp32 dS). Outputs are poisoned with NaN first.
"""
import pytest
import torch

from conftest import SEED, gpu
from kda_aot import reference
from kda_aot.reference import chunked as ref_chunked, kda as ref_kda
from kda_aot.schedule.kda import GATE_SIGMOID, GATE_SOFTPLUS, GateActivation, chunk_kda_fwd
from kda_aot.schedule.backward import (chunk_kda_bwd, chunk_kda_bwd_chunk, chunk_kda_bwd_walk,
                                      gate_parameter_grads)
from test_kda_fwd_gpu import CHAIN_PACKS, PACKS, REL, make, poisoned, rel_rms, require_form, rng

pytestmark = gpu
# dbeta: 5e-2. beta_i scales row i of L = strictly_lower(beta k k^T ...) and of T = (I + L)^-1 Diag(beta),
# so dbeta_i is a sum over 64 rows and 128 channels of terms of both signs (dT and dL against the bf16
# intermediates): its norm is sometimes far below its terms' and their bf16 roundings (~2^-9 each) show
# relative to it - a heavy tail over inputs. Seen on the H200 (`python3 bench/grad_seeds.py
# 200 one neg5,rand,zero,mild`, one 64-token document, H = 2): g = -5 median 2.2e-3, p99 2.2e-2, max 2.9e-2
# (the others' max 1.6e-2, 3.6e-3, 4.3e-3); FLA's chunk_kda on the same inputs has the same tail (12
# seeds: its max 1.1e-2 against our 9.7e-3). Every other gradient stays below 5e-3 on every seed.
BOUND = {"dbeta": 5e-2}


@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("gate", ["rand", "mild", "zero"])
@pytest.mark.parametrize("dfinal", [False, True])
@pytest.mark.parametrize("form", ["full", "split"])
def test_state_gradient_walk_matches_reference(pack, gate, dfinal, form):
    """The backward walk, full (wgmma products) and split (mma.sync), against the fp64 reference."""
    lens, H = PACKS[pack], 2
    q, k, v, g, beta, cu, h0 = make(lens, H, gate, rng(("bwd", pack, gate, dfinal)), True)
    T, N = q.shape[1], len(lens)
    _, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0)
    dout = torch.randn(1, T, H, 128, device="cuda", generator=rng(("do", pack))).to(torch.bfloat16)
    dht = torch.randn(N, H, 128, 128, device="cuda", generator=rng(("dht", pack))) if dfinal else None
    C = saved["chunks"].shape[0]
    out = {"dtape": torch.full((C, H, 128, 128), float("nan"), device="cuda"),
           "dinitial_state": torch.full((N, H, 128, 128), float("nan"), device="cuda")}
    dtape, dh0 = chunk_kda_bwd_walk(saved, dout, dht, out=out, walk_form=form)
    assert torch.isfinite(dtape).all() and torch.isfinite(dh0).all(), "unwritten or non-finite outputs"

    cpu = [x.cpu() for x in (q, k, v, g, beta)]
    ref_saved = reference.kda_chunked_fwd_saved(*cpu, cu_seqlens=cu.cpu(), initial_state=h0.cpu())
    dvp_local = reference.kda_bwd_dvp_local(ref_saved, dout.cpu())
    ref_tape, ref_dh0 = reference.kda_bwd_state_walk(ref_saved, dout.cpu(), dvp_local,
                                                     None if dht is None else dht.cpu())
    et, eh = rel_rms(dtape.cpu(), ref_tape), rel_rms(dh0.cpu(), ref_dh0)
    print(f"{pack} {gate} dfinal={dfinal}: dtape {et:.2e} dh0 {eh:.2e}")
    assert et < REL and eh < REL, f"dtape {et:.3e} dh0 {eh:.3e} (seed {SEED})"


def test_two_runs_bitwise():
    q, k, v, g, beta, cu, h0 = make(PACKS["long"], 2, "rand", rng("bwd-det"), True)
    _, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0)
    dout = torch.randn(1, q.shape[1], 2, 128, device="cuda", generator=rng("bwd-det-do")).to(torch.bfloat16)
    a = chunk_kda_bwd_walk(saved, dout)
    b = chunk_kda_bwd_walk(saved, dout)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_chunk_stage_products_match_reference():
    """kda_bwd_chunk's outputs against reference.chunk_bwd's intermediates, chunk by chunk."""
    lens, H = PACKS["edges"], 2
    q, k, v, g, beta, cu, h0 = make(lens, H, "mild", rng("bwd-chunk"), True)
    T = q.shape[1]
    _, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, save_tape=True)
    dout = torch.randn(1, T, H, 128, device="cuda", generator=rng("bwd-chunk-do")).to(torch.bfloat16)
    dtape, _ = chunk_kda_bwd_walk(saved, dout)
    got = chunk_kda_bwd_chunk(saved, dout, dtape)

    cpu = [x.cpu() for x in (q, k, v, g, beta)]
    rs = reference.kda_chunked_fwd_saved(*cpu, cu_seqlens=cu.cpu(), initial_state=h0.cpu())
    do64 = dout.cpu().double()
    ref_tape, _ = reference.kda_bwd_state_walk(rs, do64, reference.kda_bwd_dvp_local(rs, do64))
    want = {n: torch.zeros(1, T, H, w, dtype=torch.float64) for n, w in
            (("dv", 128), ("drk", 128), ("dqg", 128), ("dkg", 128), ("daqk", 64), ("dakk", 64))}
    want["dbeta_v"] = torch.zeros(1, T, H, dtype=torch.float64)
    want["daqk_diag"] = torch.zeros(1, T, H, dtype=torch.float64)
    dgam_s = torch.zeros(len(rs["chunks"]), H, 128, dtype=torch.float64)
    q64, k64, v64, b64 = (x.double() for x in (cpu[0], cpu[1], cpu[2], cpu[4]))
    for c, (_, c0, c1) in enumerate(rs["chunks"].tolist()):
        p = {x: ref_chunked._saved_chunk(rs, x, c0, c1)
             for x in ("Gam", "W", "U", "v_new", "Kg", "Qg", "Aqk", "Akk_inv")}
        p["gam"] = rs["gam"][c]
        hf = lambda x: ref_kda._to_head_first(x, c0, c1)  # noqa: E731
        r = reference.chunk_bwd(hf(q64), hf(k64), hf(v64), b64[0, c0:c1].transpose(0, 1), hf(do64),
                                rs["S"][c], ref_tape[c], p, rs["scale"])
        L = c1 - c0
        for name, key in (("dv", "dv"), ("drk", "dRk"), ("dqg", "dQg"), ("dkg", "dKg")):
            want[name][0, c0:c1] = r[key].transpose(0, 1)
        want["daqk"][0, c0:c1, :, :L] = r["dAqk"].transpose(0, 1)
        want["dakk"][0, c0:c1, :, :L] = r["dAkk"].transpose(0, 1)
        want["daqk_diag"][0, c0:c1] = torch.diagonal(r["dAqk"], dim1=-2, dim2=-1).transpose(0, 1)
        want["dbeta_v"][0, c0:c1] = (hf(v64) * r["dRv"]).sum(-1).transpose(0, 1)
        dgam_s[c] = torch.exp(rs["gam"][c]) * (rs["S"][c] * ref_tape[c]).sum(-1)
    want["dgam_s"] = dgam_s
    for name, ref in want.items():
        e = rel_rms(got[name].cpu(), ref)
        print(f"{name}: {e:.2e}")
        assert torch.isfinite(got[name]).all() and e < REL, f"{name}: {e:.3e} (seed {SEED})"
    # dAqk as hi + lo (its diagonal from daqk_diag) against scale tril(dO V'^T) from the kernel's own bf16 dO, V'
    # in fp64: fp32-accurate (bf16 hi alone is ~2e-3 off). The diagonal adds scale dO_i . (U'_i - U_i), U' formed
    # again from the kernel's own bf16 (I + L)^-1, beta and V as kda_bwd_chunk forms it (bf16(inv_ij beta_j) below
    # the diagonal, beta_i V_i) and U the stored bf16 U: U's rounding error, which V'_i carries where W S decays.
    full = got["daqk"].cpu().double() + got["daqk_lo"].cpu().double()
    exact = torch.zeros_like(full)
    pos = torch.zeros(T, dtype=torch.long)  # each token's row in its chunk
    vn, u = saved["vnew"].cpu().double(), saved["u"].cpu().double()
    inv, b32 = saved["akk_inv"].cpu().float(), cpu[4].float()
    for _, c0, c1 in rs["chunks"].tolist():
        L = c1 - c0
        pos[c0:c1] = torch.arange(L)
        a = saved["scale"] * torch.einsum("ihd,jhd->ihj", do64[0, c0:c1], vn[0, c0:c1])
        exact[0, c0:c1, :, :L] = a * torch.tril(torch.ones(L, L, dtype=torch.float64))[:, None]
        t = (inv[0, c0:c1, :, :L] * b32[0, c0:c1].transpose(0, 1)[None]).to(torch.bfloat16)  # [i, h, j] x beta_j
        t = t.double() * torch.tril(torch.ones(L, L, dtype=torch.float64), -1)[:, None]
        u_again = torch.einsum("ihj,jhd->ihd", t, v64[0, c0:c1]) + b64[0, c0:c1, :, None] * v64[0, c0:c1]
        du = saved["scale"] * (do64[0, c0:c1] * (u_again - u[0, c0:c1])).sum(-1)
        exact[0, torch.arange(c0, c1), :, torch.arange(L)] += du
    full[0, torch.arange(T), :, pos] = got["daqk_diag"].cpu().double()[0]
    e = rel_rms(full, exact)
    print(f"daqk + daqk_lo: {e:.2e}")
    assert e < 1e-4, f"daqk + daqk_lo: {e:.3e} (seed {SEED})"


def _gradients_against_reference(pack, gate, dfinal, gate_form=None):
    lens, H = PACKS[pack], 2
    q, k, v, g, beta, cu, h0 = make(lens, H, gate, rng(("grads", pack, gate, dfinal)), True)
    T, N = q.shape[1], len(lens)
    _, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, save_tape=True)
    dout = torch.randn(1, T, H, 128, device="cuda", generator=rng(("gdo", pack))).to(torch.bfloat16)
    dht = torch.randn(N, H, 128, 128, device="cuda", generator=rng(("gdht", pack))) if dfinal else None
    got = chunk_kda_bwd(saved, dout, dht, gate_form=gate_form)
    if gate_form is not None:  # a test-only form: deterministic too
        again = chunk_kda_bwd(saved, dout, dht, gate_form=gate_form)
        assert all(torch.equal(x, y) for x, y in zip(got, again))
    cpu = [x.cpu() for x in (q, k, v, g, beta)]
    rs = reference.kda_chunked_fwd_saved(*cpu, cu_seqlens=cu.cpu(), initial_state=h0.cpu())
    want = reference.kda_chunked_bwd(rs, dout.cpu(), None if dht is None else dht.cpu(),
                                     q=cpu[0], k=cpu[1], v=cpu[2], g=cpu[3], beta=cpu[4])
    for name, x, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        e = rel_rms(x.cpu(), ref)
        print(f"{pack} {gate} dfinal={dfinal} {gate_form or 'shipped'} {name}: {e:.2e}")
        assert torch.isfinite(x).all() and e < BOUND.get(name, REL), f"{name}: {e:.3e} (seed {SEED})"


@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("gate", ["rand", "neg5", "zero", "mild"])
@pytest.mark.parametrize("dfinal", [False, True])
def test_all_gradients_match_reference(pack, gate, dfinal):
    _gradients_against_reference(pack, gate, dfinal)


def _run_autograd(q, k, v, g, beta, cu, h0, dout, dht, mode):
    from kda_aot import chunk_kda
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = chunk_kda(*leaves[:5], cu_seqlens=cu, initial_state=leaves[5], output_final_state=True, backward=mode)
    torch.autograd.backward((o, ht), (dout, dht))
    return [x.grad for x in leaves]


def test_saved_and_replay_gradients_are_bitwise_equal_and_right(kda_options):
    lens, H = PACKS["long"], 3
    q, k, v, g, beta, cu, h0 = make(lens, H, "rand", rng("modes"), True)
    T, N = q.shape[1], len(lens)
    dout = torch.randn(1, T, H, 128, device="cuda", generator=rng("modes-do")).to(torch.bfloat16)
    dht = torch.randn(N, H, 128, 128, device="cuda", generator=rng("modes-dht"))
    saved = _run_autograd(q, k, v, g, beta, cu, h0, dout, dht, "saved")
    replay = _run_autograd(q, k, v, g, beta, cu, h0, dout, dht, "replay")
    again = _run_autograd(q, k, v, g, beta, cu, h0, dout, dht, "replay")
    for a, b, c in zip(saved, replay, again):
        assert torch.equal(a, b) and torch.equal(b, c)
    # the replay backward a head at a time and a segment at a time (what a pack that does not fit in one pass
    # runs) is bitwise the same
    for groups in ({"max_heads": 1}, {"max_tokens": 1100}, {"max_heads": 2, "max_tokens": 1100}):
        kda_options(**{"max_heads": 0, "max_tokens": 0, **groups})
        grouped = _run_autograd(q, k, v, g, beta, cu, h0, dout, dht, "replay")
        for a, b in zip(replay, grouped):
            assert torch.equal(a, b), groups
    kda_options(max_heads=0, max_tokens=0)
    cpu = [x.cpu() for x in (q, k, v, g, beta)]
    rs = reference.kda_chunked_fwd_saved(*cpu, cu_seqlens=cu.cpu(), initial_state=h0.cpu())
    want = reference.kda_chunked_bwd(rs, dout.cpu(), dht.cpu(), q=cpu[0], k=cpu[1], v=cpu[2], g=cpu[3], beta=cpu[4])
    for name, x, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), replay, want):
        assert rel_rms(x.cpu(), ref) < BOUND.get(name, REL), name


def test_replay_keeps_no_per_chunk_tensors():
    """Beside o and the final state, the replay's forward keeps tril(Aqk) and inv_pack alone (bf16 [1, T, H, 64]
    each: chunk_kda_ops.KEPT), no tape."""
    lens, H = [4096, 4096], 4
    q, k, v, g, beta, cu, h0 = make(lens, H, "rand", rng("mem"), True)
    from kda_aot import chunk_kda
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    o, ht = chunk_kda(*leaves[:5], cu_seqlens=cu, initial_state=leaves[5], output_final_state=True)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    kept_for_replay = 2 * sum(lens) * H * 64 * 2
    assert kept <= o.numel() * o.element_size() + ht.numel() * ht.element_size() + kept_for_replay + (1 << 20), kept


@pytest.mark.parametrize("activation", ["none", "softplus-bf16", "softplus-fp32", "sigmoid-bf16"])
def test_gate_forms_match_shipped(activation):
    """The test-only kda_bwd_gate/full (one CTA over all 128 channels) against the shipped split_staged (two over
    64 each), on a log decay and on raw gates activated in the kernels (softplus of a bf16 and an fp32 raw gate,
    sigmoid with lower_bound; some elements below the floor): dq, dk, dv, dg and dh0 bitwise equal (the same
    operands in the same mma chains and the same _rn elementwise sequence); dbeta, and with the activation
    dA_log and ddt_bias, within fp32 rounding (channel halves and thread parts summed in another order)."""
    form = "full"
    require_form("kda_bwd_gate", form)
    lens, H = PACKS["edges"], 3
    q, k, v, g, beta, cu, h0 = make(lens, H, "rand", rng(("gate-forms", form, activation)), True)
    gate = None
    if activation != "none":
        gen = rng(("gate-forms-activation", activation))
        kind, dtype = activation.split("-")
        g = (torch.randn(g.shape, device="cuda", generator=gen) * 4).to(getattr(torch, {"bf16": "bfloat16",
                                                                                     "fp32": "float32"}[dtype]))
        dt_bias = torch.randn(H, 128, device="cuda", generator=gen)
        gate = (GateActivation(GATE_SOFTPLUS, torch.randn(H, device="cuda", generator=gen) + 1, dt_bias)
                if kind == "softplus" else GateActivation(GATE_SIGMOID, torch.randn(H, device="cuda", generator=gen),
                                                          dt_bias, -3.0))
    _, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, save_tape=True, gate=gate)
    dout = torch.randn(q.shape, device="cuda", generator=rng(("gate-forms-do", form))).to(torch.bfloat16)
    a = chunk_kda_bwd(dict(saved), dout, gate_form="split_staged")
    b = chunk_kda_bwd(dict(saved), dout, gate_form=form)
    for name, x, y in zip(("dq", "dk", "dv", "dg"), a[:4], b[:4]):
        assert torch.equal(x, y), name
    assert torch.equal(a[5], b[5])
    assert rel_rms(b[4].cpu(), a[4].cpu().double()) < 1e-6
    if gate is not None:
        assert a[3].float().abs().max() > 0, "dg"  # not two forms that both dropped the activation
        for name, x, y in zip(("dA_log", "ddt_bias"), gate_parameter_grads(*a[6:8]), gate_parameter_grads(*b[6:8])):
            # only each chunk's part is summed in another order (<= 64 x 128 terms of both signs, partial sums the
            # size of the result: ~1e-7 relative); the chunks' parts are the same torch reduction
            assert torch.isfinite(x).all() and x.abs().max() > 0, name
            assert rel_rms(y.cpu(), x.cpu().double()) < 1e-5, name


@pytest.mark.parametrize("chains", list(CHAIN_PACKS))
@pytest.mark.parametrize("H", [1, 32, 64])
@pytest.mark.parametrize("form", ["split", "quarter"])
def test_bwd_walk_forms_are_bitwise_equal(chains, H, form):
    """kda_bwd_walk/split (two CTAs of 64 value columns) and /quarter (four of 32) compute every
    element as `full` does, though full's products run on wgmma and theirs on mma.sync: the fit rule
    may pick any form for any launch. Outputs poisoned first."""
    lens = CHAIN_PACKS[chains]
    q, k, v, g, beta, cu, h0 = make(lens, H, "mild", rng(("bwd-forms", chains, H, form)), True)
    _, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, save_tape=True)
    dout = torch.randn(q.shape, device="cuda", generator=rng(("bwd-forms-do", chains, H, form))).to(torch.bfloat16)
    dht = torch.randn(len(lens), H, 128, 128, device="cuda", generator=rng(("bwd-forms-dht", chains, H, form)))
    full = chunk_kda_bwd_walk(saved, dout, dht, walk_form="full")
    other = chunk_kda_bwd_walk(saved, dout, dht, walk_form=form,
                               out={"dtape": poisoned(full[0]), "dinitial_state": poisoned(full[1])})
    assert torch.equal(full[0], other[0]) and torch.equal(full[1], other[1])
    # the offset walk (no tape written: context parallelism's entering-state gradients), every form
    for offset_form in ("full", form):
        dtape, dh0 = chunk_kda_bwd_walk(saved, dout, dht, need_dtape=False, walk_form=offset_form,
                                        out={"dinitial_state": poisoned(full[1])})
        assert dtape is None and torch.equal(dh0, full[1]), offset_form


MIXED_PLANS = [(("split", 0, 1), ("full", 1, 3), ("split", 3, 5)), (("full", 0, 4), ("split", 4, 5))]


@pytest.mark.parametrize("plan", MIXED_PLANS, ids=["split-full-split", "full-split"])
def test_mixed_walk_plans_are_bitwise_the_uniform_walk(monkeypatch, plan):
    """A plan mixing the forms (one launch per run of segments, each on its own stream, overlapping)
    gives every output of both walks bitwise as one full-width launch: forward o, final state, tape,
    V'; backward dtape, d(initial state)."""
    from kda_aot.schedule import fit
    lens, H = [1000, 64, 300, 65, 5], 3
    q, k, v, g, beta, cu, h0 = make(lens, H, "rand", rng(("mixed", plan)), True)
    dout = torch.randn(q.shape, device="cuda", generator=rng(("mixed-do", plan))).to(torch.bfloat16)
    dht = torch.randn(len(lens), H, 128, 128, device="cuda", generator=rng(("mixed-dht", plan)))
    ref = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                        save_tape=True, walk_form="full")
    ref_b = chunk_kda_bwd_walk(ref[2], dout, dht, walk_form="full")
    calls = []
    monkeypatch.setattr(fit, "plan_walk", lambda program, *args, **kw: calls.append(program) or plan)
    # one walk launch over every segment (the plan names segments 0-5): not the pipeline's per-group walks
    mix = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                        save_tape=True, out={"o": poisoned(ref[0]), "final_state": poisoned(ref[1])},
                        pipeline=False)
    mix_b = chunk_kda_bwd_walk(mix[2], dout, dht,
                               out={"dtape": poisoned(ref_b[0]), "dinitial_state": poisoned(ref_b[1])})
    assert calls == ["kda_fwd_walk", "kda_bwd_walk"]  # the plan was the one launched
    assert torch.equal(ref[0], mix[0]) and torch.equal(ref[1], mix[1])
    assert torch.equal(ref[2]["tape"], mix[2]["tape"]) and torch.equal(ref[2]["vnew"], mix[2]["vnew"])
    assert torch.equal(ref_b[0], mix_b[0]) and torch.equal(ref_b[1], mix_b[1])


def test_non_finite_inputs_give_non_finite_outputs_not_a_hang():
    lens, H = [100, 70], 2
    q, k, v, g, beta, cu, h0 = make(lens, H, "rand", rng("nan"), True)
    q = q.clone()
    q[0, 5, 1, 3] = float("nan")
    g = g.clone()
    g[0, 120, 0, 7] = float("nan")
    o, ht, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                 save_tape=True)
    torch.cuda.synchronize()
    assert not torch.isfinite(o[0, 5:100, 1]).all()       # NaN in q reaches its own output row
    assert not torch.isfinite(ht).all()
    grads = chunk_kda_bwd(saved, torch.randn_like(q), None)
    torch.cuda.synchronize()
    assert not all(torch.isfinite(x).all() for x in grads[:5])


def test_batched_input_and_qk_l2norm_follow_fla_conventions():
    """Without cu_seqlens, [B, T, H, 128] is B documents of T tokens (bitwise the packed run);
    use_qk_l2norm_in_kernel normalises q and k first, differentiably."""
    from kda_aot import chunk_kda
    from kda_aot.ops.norm import l2norm  # the fused kernel pair, as chunk_kda uses
    B, T, H = 3, 100, 2
    q, k, v, g, beta, cu, h0 = make([T] * B, H, "rand", rng("batched"), True)
    raw = [x.clone() for x in (q, k)]
    raw[0].mul_(3.0)
    leaves = lambda xs: [x.detach().clone().requires_grad_() for x in xs]  # noqa: E731
    a = leaves([raw[0], raw[1], v, g, beta])
    o_b, s_b = chunk_kda(*(x.reshape(B, T, *x.shape[2:]) for x in a), initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)
    b = leaves([raw[0], raw[1], v, g, beta])
    o_p, s_p = chunk_kda(l2norm(b[0]), l2norm(b[1]), *b[2:], cu_seqlens=cu.cpu(), initial_state=h0,
                         output_final_state=True)
    assert o_b.shape == (B, T, H, 128)
    assert torch.equal(o_b.reshape(o_p.shape), o_p) and torch.equal(s_b, s_p)
    do = torch.randn(o_p.shape, device="cuda", generator=rng("batched-do")).to(torch.bfloat16)
    o_b.backward(do.reshape(o_b.shape))
    o_p.backward(do)
    for x, y in zip(a, b):
        assert torch.equal(x.grad, y.grad)


def test_replay_walks_side_by_side_are_bitwise_the_sequential_replay(kda_options):
    """The unpipelined replay (Options.pipeline off: replay_walks, as CP's replay) runs its forward walk on a side
    stream beside the backward walk; with Options.replay_overlap off it runs them one after the other: every
    gradient bitwise the same, and the same as the pipelined replay's."""
    from kda_aot import chunk_kda
    lens, H = PACKS["long"], 3
    q, k, v, g, beta, cu, h0 = make(lens, H, "rand", rng("replay-overlap"), True)
    dout = torch.randn(q.shape, device="cuda", generator=rng("replay-overlap-do")).to(torch.bfloat16)
    grads = []
    for pipeline, overlap in ((False, True), (False, False), (True, True)):
        kda_options(pipeline=pipeline, replay_overlap=overlap)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, _ = chunk_kda(*leaves[:5], cu_seqlens=cu, initial_state=leaves[5], backward="replay")
        o.backward(dout)
        grads.append([x.grad for x in leaves])
    for side_by_side, one_after_the_other, pipelined in zip(*grads):
        assert torch.equal(side_by_side, one_after_the_other) and torch.equal(side_by_side, pipelined)


@pytest.mark.parametrize("lens", [[3000, 2200], [1, 2000, 5, 1100]])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("skip", [False, True])
def test_pieced_replay_walks_are_bitwise_the_unpieced_ones(lens, init, skip):
    """pieced=True (context parallelism: the longest chain's chunk stage a piece at a time, first and last
    piece first; its forward walk through the pieces from the front, its backward walk from the back,
    each from its neighbour's end state; 47 chunks: 5 pieces, 32: 4) writes the bits of the unpieced
    order, the skipped backward walk (skip_bwd) left out alike; the pieced run's tensors allocated over NaN."""
    from kda_aot.schedule import grouping
    from kda_aot.schedule.backward import replay_walks_pipelined
    from test_kda_fwd_gpu import nan_filled_allocator
    lengths = tuple(-(-n // 64) for n in lens)
    chosen = grouping.pieced_group(lengths, cp=True)
    assert chosen is not None and len(chosen[1]) > 4, "the pack must cut a chain in pieces"
    longest = lengths.index(max(lengths))
    skip_bwd = (longest,) if skip else ()
    q, k, v, g, beta, cu, h0 = make(lens, 3, "rand", rng(("pieced-replay", len(lens), init)), init)
    dout = torch.randn(q.shape, device="cuda", generator=rng(("pieced-replay-do", len(lens)))).to(torch.bfloat16)
    dht = torch.randn(len(lens), 3, 128, 128, device="cuda", generator=rng(("pieced-replay-dht", len(lens))))
    sa, wa = replay_walks_pipelined(q, k, v, g, beta, h0, cu, None, dout, dht, skip_bwd)
    nan_filled_allocator()
    sb, wb = replay_walks_pipelined(q, k, v, g, beta, h0, cu, None, dout, dht, skip_bwd, pieced=True)
    for name in ("tape", "vnew"):
        assert torch.equal(sa[name], sb[name]), name
    walked = [s for s in range(len(lens)) if s not in skip_bwd]
    seg_chunks = sa["seg_chunks"].tolist()
    rows = [c for s in walked for c in range(seg_chunks[s], seg_chunks[s + 1])]
    assert torch.equal(wa[0][rows], wb[0][rows]), "dtape"
    assert torch.equal(wa[1][walked], wb[1][walked]), "d_initial_state"


@pytest.mark.parametrize("chains", list(CHAIN_PACKS))
@pytest.mark.parametrize("init", [False, True])
def test_pipelined_replay_walks_are_bitwise_replay_walks(chains, init):
    """The pipelined replay (chunk stage per segment group, the group's two walks on side streams)
    returns the saved context and walk results of chunk_kda_prepare + replay_walks, bit for bit;
    its tensors are allocated over NaN (nan_filled_allocator), so a range left unwritten shows."""
    from kda_aot.schedule.kda import chunk_kda_prepare
    from kda_aot.schedule.backward import replay_walks_pipelined, replay_walks
    from test_kda_fwd_gpu import nan_filled_allocator
    q, k, v, g, beta, cu, h0 = make(CHAIN_PACKS[chains], 3, "rand", rng(("pipeline-replay", chains, init)), init)
    dout = torch.randn(q.shape, device="cuda", generator=rng(("pipeline-replay-do", chains))).to(torch.bfloat16)
    dht = torch.randn_like(h0) if init else None
    prepared = chunk_kda_prepare(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, save_tape=True)
    sa, wa = replay_walks(prepared, h0, dout, dht)
    nan_filled_allocator()
    sb, wb = replay_walks_pipelined(q, k, v, g, beta, h0, cu, None, dout, dht)
    assert set(sa) == set(sb)
    for name, x in sa.items():
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, sb[name]), name
        else:
            assert x == sb[name], name
    for x, y in zip(wa, wb):
        assert torch.equal(x, y)
