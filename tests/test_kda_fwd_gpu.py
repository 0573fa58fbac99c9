"""KDA forward kernels on the GPU against the fp64 reference.

Error measure: relative RMS error ||out - ref|| / ||ref|| (as flash-linear-attention's tests).
Bound 1e-2: inputs are exact bf16/fp32; our roundings are the bf16 intermediates (W, U, Q*exp
Gamma, K*exp(gamma-Gamma), Aqk, V') and the bf16 operand copy of the state in the products,
each ~2^-9 relative, a handful of them in series (~5e-3); the fp32 state itself does not drift.
Outputs are poisoned with NaN first.
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import SEED, generator, gpu
from reftools import rel_rms
from kda_aot import reference
from kda_aot.schedule.kda import chunk_kda_fwd, chunk_kda_prepare, chunk_kda_walk

pytestmark = gpu
REL = 1e-2


def rng(tag):
    return generator(tag, "cuda")


def poisoned(x):
    """A tensor like x full of NaN: a kernel that leaves an output unwritten cannot pass."""
    return torch.full_like(x, float("nan"))


def require_form(program, form):
    """Load a form's library first: a test-only record not built (the test command builds them) or stale fails
    the test, naming the record (the installed run skips it: conftest.pytest_runtest_call)."""
    from kda_aot._runtime import registry
    registry.library(program, form)


def make(lens, H, gate, gen, init):
    T = sum(lens)
    dev = "cuda"
    q = F.normalize(torch.randn(1, T, H, 128, device=dev, generator=gen), dim=-1).to(torch.bfloat16)
    k = F.normalize(torch.randn(1, T, H, 128, device=dev, generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, T, H, 128, device=dev, generator=gen).to(torch.bfloat16)
    if gate == "neg5":
        g = torch.full((1, T, H, 128), -5.0, device=dev)
    elif gate == "zero":
        g = torch.zeros(1, T, H, 128, device=dev)
    elif gate == "mild":
        g = -0.05 * torch.rand(1, T, H, 128, device=dev, generator=gen)
    else:
        g = -5 * torch.rand(1, T, H, 128, device=dev, generator=gen)
    beta = torch.rand(1, T, H, device=dev, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    h0 = torch.randn(len(lens), H, 128, 128, device=dev, generator=gen) * 0.1 if init else None
    return q, k, v, g, beta, cu, h0


PACKS = {"edges": [1, 63, 64, 65, 130, 2], "long": [1000, 1, 1537], "one": [64]}
# Packs by chain count (the walk forms bitwise equal on 1, 2, 6 and 500 chains per head)
CHAIN_PACKS = {1: [700], 2: [300, 129], 6: [1, 63, 64, 65, 130, 2],
               500: [1 + (37 * i) % 80 for i in range(500)]}


@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("gate", ["rand", "neg5", "zero", "mild"])
@pytest.mark.parametrize("init", [False, True])
def test_forward_matches_reference(pack, H, gate, init):
    q, k, v, g, beta, cu, h0 = make(PACKS[pack], H, gate, rng((pack, H, gate, init)), init)
    T, N = q.shape[1], cu.numel() - 1
    out = {"o": torch.full((1, T, H, 128), float("nan"), device="cuda", dtype=torch.bfloat16),
           "final_state": torch.full((N, H, 128, 128), float("nan"), device="cuda")}
    o, ht, _ = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True, out=out)
    ro, rht = reference.kda_recurrent(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), cu_seqlens=cu.cpu(),
                                      initial_state=None if h0 is None else h0.cpu(), output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all(), "unwritten or non-finite outputs"
    eo, eh = rel_rms(o.cpu(), ro), rel_rms(ht.cpu(), rht)
    print(f"{pack} H={H} {gate} init={init}: o {eo:.2e} state {eh:.2e}")
    assert eo < REL and eh < REL, f"o {eo:.3e} state {eh:.3e} (seed {SEED})"


@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("gate", ["rand", "neg5", "zero", "mild"])
def test_lean_chunk_form_matches_reference(pack, gate):
    """The shipped kda_fwd_chunk/lean (Gamma in log2 units; Akk's row operand rounded twice: the exp to
    bf16, then the packed product; the column operand the fp32 product rounded once, Aqk's row operand
    that product as bf16 hi + lo) against the fp64 reference, same bound as every form; and
    deterministic (two runs bitwise); gamma bitwise the fp32 running sum of the floored gate in row order."""
    from kda_aot.schedule.kda import GATE_FLOOR
    q, k, v, g, beta, cu, h0 = make(PACKS[pack], 3, gate, rng(("lean", pack, gate)), True)
    runs = []
    for _ in range(2):
        prepared = chunk_kda_prepare(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0)
        runs.append(chunk_kda_walk(prepared, initial_state=h0, output_final_state=True)[:2])
    (o, ht), (o2, ht2) = runs
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    gf = torch.clamp(g[0].cpu(), min=GATE_FLOOR)  # gamma itself stays in natural units
    for c, (t0, t1) in enumerate(prepared["chunks"].cpu().tolist()):
        acc = torch.zeros(gf.shape[1:], dtype=torch.float32)
        for t in range(t0, t1):
            acc = acc + gf[t]
        assert torch.equal(prepared["gamma"][c].cpu(), acc), f"gamma of chunk {c}"
    ro, rht = reference.kda_recurrent(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), cu_seqlens=cu.cpu(),
                                      initial_state=h0.cpu(), output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    eo, eh = rel_rms(o.cpu(), ro), rel_rms(ht.cpu(), rht)
    print(f"lean {pack} {gate}: o {eo:.2e} state {eh:.2e}")
    assert eo < REL and eh < REL, f"o {eo:.3e} state {eh:.3e} (seed {SEED})"


@pytest.mark.parametrize("H", [32, 64])
def test_many_heads(H):
    q, k, v, g, beta, cu, h0 = make([700, 65, 300], H, "rand", rng(("heads", H)), True)
    o, ht, _ = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    ro, rht = reference.kda_chunked(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), cu_seqlens=cu.cpu(),
                                    initial_state=h0.cpu(), output_final_state=True)
    assert rel_rms(o.cpu(), ro) < REL and rel_rms(ht.cpu(), rht) < REL


def test_two_runs_bitwise():
    q, k, v, g, beta, cu, h0 = make(PACKS["long"], 2, "rand", rng("det"), True)
    a = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    b = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_saved_tape_is_the_state_at_each_chunk_start():
    lens, H = PACKS["edges"], 2
    q, k, v, g, beta, cu, h0 = make(lens, H, "mild", rng("tape"), True)
    o_plain, _, _ = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0)
    o, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, save_tape=True)
    assert torch.equal(o, o_plain)  # keeping the tape changes nothing else
    tape = saved["tape"].cpu()
    chunks = saved["chunks"].cpu().tolist()
    cpu = [x.cpu() for x in (q, k, v, g, beta)]
    starts = cu.cpu().tolist()
    for c, (t0, _) in enumerate(chunks):
        doc = max(i for i in range(len(lens)) if starts[i] <= t0)
        s = starts[doc]
        if t0 == s:
            ref = h0[doc].cpu().double()
        else:
            sl = [x[:, s:t0] for x in cpu]
            _, ref = reference.kda_recurrent(*sl, cu_seqlens=[0, t0 - s], initial_state=h0[doc:doc + 1].cpu(),
                                             output_final_state=True)
            ref = ref[0]
        assert rel_rms(tape[c], ref) < REL, f"chunk {c}"


@pytest.mark.parametrize("chains", list(CHAIN_PACKS))
@pytest.mark.parametrize("H", [1, 32, 64])
@pytest.mark.parametrize("form", ["split", "quarter"])
def test_walk_forms_are_bitwise_equal(chains, H, form):
    """The split form (two CTAs of 64 value columns) and the quarter form (four of 32) compute every
    element as the full form does, though full splits its products between the warpgroups by column
    halves and split / quarter by role (W S, V' / Q S, O): the fit rule may pick any form for any
    launch. Outputs poisoned first."""
    q, k, v, g, beta, cu, h0 = make(CHAIN_PACKS[chains], H, "mild", rng(("forms", chains, H)), True)
    o1, h1, s1 = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                               save_tape=True, walk_form="full")
    o2, h2, s2 = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                               save_tape=True, walk_form=form,
                               out={"o": poisoned(o1), "final_state": poisoned(h1), "tape": poisoned(s1["tape"]),
                                    "vnew": poisoned(s1["vnew"])})
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    assert torch.equal(s1["tape"], s2["tape"]) and torch.equal(s1["vnew"], s2["vnew"])
    # the offset walk (end states only: context parallelism's summaries), every form: with the last chunks' U
    # rounding error (a chunk stage prepared for final states) the forward's final states, without it the same
    # end states in every form
    with_lo = chunk_kda_prepare(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, save_tape=True, final_state=True)
    ends = []
    for offset_form in ("full", form):
        o3, h3, s3 = chunk_kda_walk(with_lo, initial_state=h0, output_final_state=True, want_output=False,
                                    walk_form=offset_form, out={"final_state": poisoned(h1)})
        assert o3 is None and s3["tape"] is None and torch.equal(h3, h1), offset_form
        _, h4, _ = chunk_kda_walk(s1, initial_state=h0, output_final_state=True, want_output=False,
                                  walk_form=offset_form, out={"final_state": poisoned(h1)})
        assert torch.isfinite(h4).all() and not torch.equal(h4, h1), offset_form
        ends.append(h4)
    assert torch.equal(ends[0], ends[1])


@pytest.mark.parametrize("form", ["full", "split"])
def test_walk_without_output_is_bitwise_the_same(form):
    """want_output=False (the replay's and the CP summaries' walk) skips the output stage only."""
    q, k, v, g, beta, cu, h0 = make(PACKS["edges"], 3, "rand", rng(("no-output", form)), True)
    a = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True, save_tape=True,
                      walk_form=form)
    b = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True, save_tape=True,
                      walk_form=form, want_output=False)
    assert b[0] is None and torch.equal(a[1], b[1])
    for name in ("tape", "vnew", "w", "u", "qg", "kg", "aqk", "aqk_diag_lo", "akk_inv", "gamma"):
        assert torch.equal(a[2][name], b[2][name]), name


def nan_filled_allocator(nbytes=1 << 30):
    """Fill and free a large block: tensors the caching allocator hands out next start as NaN, so a
    chunk range a launch skipped shows up (the chunk stage's outputs cannot be passed in poisoned)."""
    x = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del x


# + a pack whose last pipeline group is one segment of 35 chunks: cut in four pieces (grouping.last_group_pieces)
PIPELINE_PACKS = dict(CHAIN_PACKS, pieces=[3000, 2200])


@pytest.mark.parametrize("chains", list(PIPELINE_PACKS))
@pytest.mark.parametrize("save_tape", [False, True])
@pytest.mark.parametrize("init", [False, True])
def test_pipelined_forward_is_bitwise_the_plain_one(chains, save_tape, init):
    """pipeline=True (the chunk stage a segment group at a time, each group's walk on a side stream
    beside the later groups' chunk stage; 500 chains: 4 groups of 125 segments; `pieces`: the last
    group's segment walked a piece at a time, each from the end state of the one before) writes every
    bit the plain order writes: outputs poisoned, the chunk stage's outputs allocated over NaN."""
    q, k, v, g, beta, cu, h0 = make(PIPELINE_PACKS[chains], 3, "rand", rng(("pipeline", chains, save_tape, init)), init)
    o1, h1, s1 = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                               save_tape=save_tape, pipeline=False)
    out = {"o": poisoned(o1), "final_state": poisoned(h1)}
    if save_tape:
        out.update(tape=poisoned(s1["tape"]), vnew=poisoned(s1["vnew"]))
    nan_filled_allocator()
    o2, h2, s2 = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                               save_tape=save_tape, pipeline=True, out=out)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    names = ["w", "u", "qg", "kg", "aqk", "aqk_diag_lo", "gamma"] + (["tape", "vnew", "akk_inv"] if save_tape else [])
    for name in names:
        assert torch.equal(s1[name], s2[name]), name
    assert (s2["akk_inv"] is None) == (not save_tape)


def test_pipelined_forward_with_forced_walk_forms(monkeypatch):
    """Each group's walk goes through the fit rule on its own segments: forced split and a mixed plan
    (side streams of the group's own pool) inside the pipeline are bitwise the plain order too."""
    from kda_aot.schedule import fit
    lens = [1025, 193, 1563, 487, 625, 205]  # six segments: groups of one and two segments
    q, k, v, g, beta, cu, h0 = make(lens, 4, "rand", rng("pipeline-forms"), True)
    o1, h1, _ = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                              pipeline=False, walk_form="full")
    for form in ("split", "quarter"):
        o2, h2, _ = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                  pipeline=True, walk_form=form, out={"o": poisoned(o1), "final_state": poisoned(h1)})
        assert torch.equal(o1, o2) and torch.equal(h1, h2), form
    monkeypatch.setattr(fit, "plan_walk", lambda program, lengths, *a, **kw: (
        (("split", 0, 1), ("full", 1, len(lengths))) if len(lengths) > 1 else (("full", 0, 1),)))
    o3, h3, _ = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                              pipeline=True, out={"o": poisoned(o1), "final_state": poisoned(h1)})
    assert torch.equal(o1, o3) and torch.equal(h1, h3)


@pytest.mark.parametrize("mode", ["saved", "replay"])
def test_pipelined_forward_gradients_bitwise(kda_options, mode):
    """Options.pipeline through autograd (the pipelined forward; in replay mode also the pipelined
    replay of the backward): output and every gradient bitwise as without it."""
    from kda_aot import chunk_kda
    q, k, v, g, beta, cu, h0 = make(PACKS["long"], 3, "rand", rng(("pipeline-grad", mode)), True)
    do = torch.randn(q.shape, device="cuda", generator=rng(("pipeline-grad-do", mode))).to(torch.bfloat16)
    results = []
    for flag in ("0", "1"):
        kda_options(pipeline=flag == "1")
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, ht = chunk_kda(*leaves[:5], cu_seqlens=cu, initial_state=leaves[5], output_final_state=True,
                          backward=mode)
        torch.autograd.backward([o, ht], [do, torch.ones_like(ht)])
        results.append([o.detach(), ht.detach()] + [x.grad for x in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("case", ["rand", "neg5", "zero", "softplus-gva", "sigmoid-beta2"])
def test_replay_chunk_stage_is_bitwise_the_forwards(pack, case):
    """kda_fwd_chunk/replay, reading the forward's tril(Aqk) and inv_pack, writes the W, U, Q e^Gamma,
    K e^(gamma - Gamma), gamma and (I + L)^-1 of the saved-context forward bit for bit (every output poisoned),
    and lean writes the same with inv_pack as without (with the gate and beta activated, and grouped value heads)."""
    from kda_aot.schedule import kda
    gen = rng(("replay-stage", pack, case))
    lens, HV = PACKS[pack], 4
    Hqk = 2 if case == "softplus-gva" else HV
    q, k, v, g, beta, cu, _ = make(lens, HV, "rand" if "-" in case else case, gen, False)
    q, k = q[:, :, :Hqk].contiguous(), k[:, :, :Hqk].contiguous()
    gate, beta_kind = None, kda.BETA_PLAIN
    if case == "softplus-gva":
        g = (4 * torch.randn(g.shape, device="cuda", generator=gen)).to(torch.bfloat16)
        gate = kda.GateActivation(kda.GATE_SOFTPLUS, torch.randn(HV, device="cuda", generator=gen),
                                  torch.randn(HV, 128, device="cuda", generator=gen))
    elif case == "sigmoid-beta2":
        g = 3 * torch.randn(g.shape, device="cuda", generator=gen)
        gate = kda.GateActivation(kda.GATE_SIGMOID, None, None, -4.0)
        beta, beta_kind = 3 * torch.randn(beta.shape, device="cuda", generator=gen), kda.BETA_SIGMOID_2

    def run(**kw):
        t = kda._chunk_stage_tensors(q, k, v, g, beta, cu, None, None, gate=gate, beta_kind=beta_kind, **kw)
        for name in _STAGE_OUTPUTS:  # (not what the replay reads from the forward)
            if t.get(name) is not None and name not in kw.get("kept", {}):
                t[name].copy_(poisoned(t[name]))
        kda._launch_chunk_stage(t, None)
        return t
    saved = run(save_tape=True)
    forward = run(save_tape=False, keep=True)
    replay = run(save_tape=True, kept={"aqk": forward["aqk"], "inv_pack": forward["inv_pack"]})
    assert replay["chunk_form"] == "replay"
    for name in ("w", "u", "qg", "kg", "aqk", "aqk_diag_lo", "gamma"):
        assert torch.equal(forward[name], saved[name]), f"lean with inv_pack: {name}"
    for name in ("w", "u", "qg", "kg", "gamma", "akk_inv"):
        assert torch.equal(replay[name], saved[name]), f"replay: {name}"
    for name in ("w", "u", "akk_inv"):
        assert torch.isfinite(replay[name]).all(), name


_STAGE_OUTPUTS = ("w", "u", "qg", "kg", "aqk", "aqk_diag_lo", "gamma", "akk_inv", "inv_pack")


def test_replay_chunk_stage_refuses_what_it_cannot_read():
    """The forward's tensors of the wrong shape or dtype are named by the replay form's binding before its kernel
    runs; the forward's lean form refuses akk_inv and inv_pack together (one staging tile writes either)."""
    from kda_aot.schedule import kda
    q, k, v, g, beta, cu, _ = make([70, 3], 2, "rand", rng("replay-refuse"), False)
    aqk = torch.zeros(1, 73, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"inv_pack: expected shape \[1, T, H, 64\]"):
        kda._launch_chunk_stage(kda._chunk_stage_tensors(q, k, v, g, beta, cu, None, None, True,
                                                         kept={"aqk": aqk, "inv_pack": aqk[:, :72]}), None)
    with pytest.raises(TypeError, match="aqk: expected dtype"):
        kda._launch_chunk_stage(kda._chunk_stage_tensors(q, k, v, g, beta, cu, None, None, True,
                                                         kept={"aqk": aqk.float(), "inv_pack": aqk}), None)
    with pytest.raises(ValueError, match="keep: the replay's forward"):
        kda._chunk_stage_tensors(q, k, v, g, beta, cu, None, None, True, keep=True)
    t = kda._chunk_stage_tensors(q, k, v, g, beta, cu, None, None, True)
    t["inv_pack"] = torch.empty_like(aqk)
    with pytest.raises(ValueError, match="akk_inv and inv_pack given"):
        kda._launch_chunk_stage(t, None)
