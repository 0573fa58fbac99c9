"""The CUDA backend of context parallelism, primitive by primitive, against the fp64 reference
backend on the same local tensors (no process group needed): the fragment summary (M from the
transfer walk, B from the forward walk), the local forward with entering states, and the local
backward with exit-state gradients. Bound: relative RMS 1e-2 (the kernels' bf16 budget, see
test_kda_fwd_gpu); M's own products run in split bf16, so M's error comes from the bf16 W and Kg.
"""
from types import SimpleNamespace

import pytest
import torch

from conftest import SEED, gpu
from kda_aot.cp.backends import CudaBackend, ReferenceBackend
from test_kda_fwd_gpu import REL, make, rel_rms, rng

pytestmark = gpu


@pytest.mark.parametrize("gate", ["mild", "rand"])
def test_summary_matches_reference(gate):
    q, k, v, g, beta, cu, _ = make([700], 2, gate, rng(("cp-summary", gate)), False)
    lo, hi = 37, 650  # a fragment that starts and ends inside chunks of the document
    M, B = CudaBackend().summary(k, v, g, beta, lo, hi)
    rM, rB = ReferenceBackend(torch.float64).summary(*(x.cpu() for x in (k, v, g, beta)), lo, hi)
    eM, eB = rel_rms(M.cpu(), rM), rel_rms(B.cpu(), rB)
    print(f"{gate}: M {eM:.2e} B {eB:.2e}")
    assert eM < REL and eB < REL, f"M {eM:.3e} B {eB:.3e} (seed {SEED})"


def test_forward_and_backward_match_reference():
    lens, H = [65, 1, 300], 2
    q, k, v, g, beta, cu, states = make(lens, H, "mild", rng("cp-fb"), True)
    cu_local = cu.cpu().tolist()
    scale = 128 ** -0.5
    cuda, ref = CudaBackend(), ReferenceBackend(torch.float64)
    o, fin, ctx = cuda.forward(q, k, v, g, beta, cu_local, states, scale, keep=True)
    ro, rfin, rctx = ref.forward(*(x.cpu() for x in (q, k, v, g, beta)), cu_local, states.cpu(), scale, keep=True)
    assert rel_rms(o.cpu(), ro) < REL and rel_rms(fin.cpu(), rfin) < REL
    do = torch.randn_like(q)
    dfin = torch.randn_like(states)
    got = cuda.backward(ctx, do, dfin)
    want = ref.backward(rctx, do.cpu(), dfin.cpu())
    for name, x, w in zip(("dq", "dk", "dv", "dg", "dbeta", "dstates"), got, want):
        e = rel_rms(x.cpu(), w)
        print(f"{name}: {e:.2e}")
        assert e < REL, f"{name}: {e:.3e} (seed {SEED})"
    again = cuda.backward(ctx, do, dfin)  # the saved context is reusable (the op calls it twice)
    for x, y in zip(got, again):
        assert torch.equal(x, y)


def test_final_states_that_are_outputs_carry_u_rounding_error():
    """prepare(final_segments=) marks the local segments whose final state is an output (their document ends on
    this rank): at a strong gate their final states take the last chunk's U rounding error (below 1e-4 of the
    fp64 reference, 1.66e-3 without: docs/numerics.md), the others' end states (what a sender hands on) keep
    the plain walk's bits, and the pipelined forward gives the same bits as prepare then forward."""
    lens, H = [300, 129, 65], 2
    q, k, v, _, beta, cu, states = make(lens, H, "mild", rng("cp-final-lo"), True)
    g = torch.full(q.shape, -8.0, device="cuda")
    cu_local, scale, cuda = cu.cpu().tolist(), 128 ** -0.5, CudaBackend()
    ends = [0, 2]
    _, fin, _ = cuda.forward(q, k, v, g, beta, cu_local, states, scale, keep=False,
                             prepared=cuda.prepare(q, k, v, g, beta, cu_local, scale, keep=False, final_segments=ends))
    _, bare, _ = cuda.forward(q, k, v, g, beta, cu_local, states, scale, keep=False)
    _, rfin, _ = ReferenceBackend(torch.float64).forward(*(x.cpu() for x in (q, k, v, g, beta)), cu_local,
                                                         states.cpu().double(), scale, keep=False)
    for s in ends:
        e, e_bare = rel_rms(fin[s].cpu(), rfin[s]), rel_rms(bare[s].cpu(), rfin[s])
        print(f"segment {s}: final state {e:.2e} (without the tile {e_bare:.2e})")
        assert e < 1e-4 < e_bare
    assert torch.equal(fin[1], bare[1])
    nothing_deferred = SimpleNamespace(run=lambda prepared, finals: torch.zeros(0, H, 128, 128, device="cuda"))
    _, got, _ = cuda.forward_pipelined(q, k, v, g, beta, cu_local, scale, False, states, [], nothing_deferred, [1],
                                       final_segments=ends)
    assert torch.equal(got, fin)


def test_summary_from_the_local_chunk_stage_is_bitwise_the_fragments():
    """The op prepares the local chunk stage once and summarises segments from it: the same bits
    as summarising each fragment on its own (chunks restart at segment starts)."""
    lens, H = [130, 700, 65], 2
    q, k, v, g, beta, cu, _ = make(lens, H, "rand", rng("cp-prepared"), False)
    cu_local = cu.cpu().tolist()
    be = CudaBackend()
    prepared = be.prepare(q, k, v, g, beta, cu_local, 128 ** -0.5, keep=False)
    for seg in range(len(lens)):
        lo, hi = cu_local[seg], cu_local[seg + 1]
        M1, B1 = be.summary(k, v, g, beta, lo, hi)
        M2, B2 = be.summary_of(prepared, seg, need_b=True)
        M3, B3 = be.summary_of(prepared, seg, need_b=False)
        assert torch.equal(M1, M2) and torch.equal(B1, B2) and torch.equal(M1, M3) and B3 is None


def test_batched_summaries_match_reference_and_keep_their_bits():
    """summaries_of (all requested segments in two launches, each cut into chunk-aligned pieces
    walked from zero and composed in fp32): M and B against the fp64 reference; a request for a
    subset with the same plan_segments gives each segment's M bitwise (the backward's M are the
    forward's); B is None where not asked for."""
    from kda_aot.schedule import fit
    lens, H = [130, 5000, 65, 3000, 1], 2
    q, k, v, g, beta, cu, _ = make(lens, H, "rand", rng("cp-batched"), False)
    cu_local = cu.cpu().tolist()
    be, ref = CudaBackend(), ReferenceBackend(torch.float64)
    prepared = be.prepare(q, k, v, g, beta, cu_local, 128 ** -0.5, keep=False)
    segments = [0, 1, 3, 4]
    chunks = tuple(int(prepared["chain_lengths"][s]) for s in segments)
    assert max(fit.summary_pieces(chunks, H, torch.cuda.get_device_properties(0).multi_processor_count)) > 1
    got = be.summaries_of(prepared, [(s, True) for s in segments], segments)
    for seg, (M, B) in zip(segments, got):
        lo, hi = cu_local[seg], cu_local[seg + 1]
        rM, rB = ref.summary(*(x.cpu() for x in (k, v, g, beta)), lo, hi)
        eM, eB = rel_rms(M.cpu(), rM), rel_rms(B.cpu(), rB)
        print(f"segment {seg}: M {eM:.2e} B {eB:.2e}")
        assert eM < REL and eB < REL, f"segment {seg}: M {eM:.3e} B {eB:.3e} (seed {SEED})"
    sub = be.summaries_of(prepared, [(1, False), (4, False)], segments)
    assert torch.equal(sub[0][0], got[1][0]) and torch.equal(sub[1][0], got[3][0])
    assert sub[0][1] is None and sub[1][1] is None


@pytest.mark.parametrize("overlap", ["1", "0"])
def test_replay_hook_is_bitwise_forward_then_state_grads(kda_options, overlap):
    """CudaBackend.replay (the forward walk beside the walk for D) against forward(keep=True) then
    state_grads on the same prepared chunk stage: D, and the backward from either context, bitwise."""
    kda_options(replay_overlap=overlap == "1")
    lens, H = [65, 1, 300, 700], 2
    q, k, v, g, beta, cu, states = make(lens, H, "rand", rng(("cp-replay", overlap)), True)
    cu_local, scale, cuda = cu.cpu().tolist(), 128 ** -0.5, CudaBackend()
    do, dfin = torch.randn_like(q), torch.randn_like(states)
    _, _, ctx_a = cuda.forward(q, k, v, g, beta, cu_local, states, scale, keep=True,
                               prepared=cuda.prepare(q, k, v, g, beta, cu_local, scale, keep=True))
    d_a = cuda.state_grads(ctx_a, do, dfin)
    ctx_b, d_b = cuda.replay(cuda.prepare(q, k, v, g, beta, cu_local, scale, keep=True), states, do, dfin)
    assert torch.equal(d_a, d_b)
    for x, y in zip(cuda.backward(ctx_a, do, dfin), cuda.backward(ctx_b, do, dfin)):
        assert torch.equal(x, y)
    ctx_c, none = cuda.replay(cuda.prepare(q, k, v, g, beta, cu_local, scale, keep=True), states, do, None)
    assert none is None and torch.equal(ctx_c["tape"], ctx_a["tape"])


@pytest.mark.parametrize("lens,deferred,senders", [([65, 1, 300, 700, 2300], [0], [4]),
                                                   ([65, 1, 300, 700, 2300], [0, 3], [1, 2]),
                                                   ([65, 1, 300, 700, 2300], [], []),
                                                   ([6000, 900], [], [1]),  # the pieced group's piece 0 first
                                                   ([900, 6000, 900], [0], [2]),  # a middle group pieced
                                                   ([6000, 900, 300, 8000], [1, 3], [0]),  # a sent chain pieced
                                                   ([6000], [], [0])],  # a rank's only chain, sent, pieced
                         ids=["sender-last", "two-senders", "none", "lead-piece", "pieced-middle", "pieced-sender",
                              "lone-sender"])
@pytest.mark.parametrize("beside", ["1", "0"], ids=["beside", "main-stream"])
def test_pipelined_forward_is_bitwise_prepare_then_forward(kda_options, lens, deferred, senders, beside):
    """CudaBackend.forward_pipelined (Options.cp_pipeline, the default: the walks of the segments whose
    entering state is known beside the chunk stage, the senders' first, the deferred ones from what
    the exchange's run(prepared, final_state) returns once it is queued) against prepare() then forward() with
    the same states: every output bitwise; entering called once, the senders' final states ready, and
    summaries of the deferred segments made in it bitwise those of the plain prepare(). beside: the
    exchange stream (Options.cp_exchange_beside; a missing wait for a chunk stage would show) and the
    sent chains in pieces too (Options.cp_piece_senders)."""
    kda_options(cp_exchange_beside=beside == "1")
    kda_options(cp_piece_senders=beside == "1")  # with it, the sent chains in pieces
    H = 2
    q, k, v, g, beta, cu, known = make(lens, H, "rand", rng(("cp-fwd-pipelined", len(deferred), len(lens))), True)
    later = torch.randn_like(known)
    cu_local, scale, cuda = cu.cpu().tolist(), 128 ** -0.5, CudaBackend()
    states = known.clone()
    states[deferred] = later[deferred]
    ends = [s for s in range(len(lens)) if s not in senders and s not in deferred]  # (every deferred one is
    plain = cuda.prepare(q, k, v, g, beta, cu_local, scale, keep=True, final_segments=ends)  # summarised here)
    want = cuda.summaries_of(plain, [(s, True) for s in deferred], deferred) if deferred else []
    o_a, fin_a, ctx_a = cuda.forward(q, k, v, g, beta, cu_local, states, scale, keep=True, prepared=plain)
    calls, got = [], []

    def entering(prepared, finals):
        calls.append(finals[senders].clone())  # queued on the stream the exchange would use
        got.extend(cuda.summaries_of(prepared, [(s, True) for s in deferred], deferred) if deferred else [])
        return later[deferred]
    o_b, fin_b, ctx_b = cuda.forward_pipelined(q, k, v, g, beta, cu_local, scale, True, known, deferred,
                                               SimpleNamespace(run=entering), senders, final_segments=ends)
    assert len(calls) == 1 and torch.equal(calls[0], fin_a[senders])
    for (m_a, b_a), (m_b, b_b) in zip(want, got, strict=True):
        assert torch.equal(m_a, m_b) and torch.equal(b_a, b_b)
    assert torch.equal(o_a, o_b) and torch.equal(fin_a, fin_b)
    for name in ("tape", "vnew", "w", "u", "qg", "kg", "aqk", "aqk_diag_lo", "akk_inv", "gamma"):
        assert torch.equal(ctx_a[name], ctx_b[name]), name


@pytest.mark.parametrize("beside", [False, True], ids=["walk-first", "beside-bwd-chunk"])
@pytest.mark.parametrize("skip", [False, True], ids=["walked", "skip-bwd"])
def test_full_replay_walk_then_rewalk_is_bitwise_the_plain_backward(monkeypatch, beside, skip):
    """The CP replay backward (replay_pipelined: the chunk stage a segment group at a time beside the
    forward walk and the backward walk, the latter with its tape from the exit-state gradients known
    locally; then backward(walk=, rewalk=): the segments whose gradient arrives from other ranks
    walked again - first, or on a side stream beside kda_bwd_chunk over the others, as
    fit.rewalk_beside decides; both forced here) against prepare(), replay() then backward() with the
    true gradients: the saved context, D and every gradient bitwise."""
    from kda_aot.schedule import fit
    monkeypatch.setattr(fit, "rewalk_beside", lambda lengths, rewalk, heads, sms: heads * len(rewalk) if beside else None)
    lens, H = [65, 1, 300, 700, 2300], 2
    q, k, v, g, beta, cu, states = make(lens, H, "rand", rng("cp-rewalk"), True)
    cu_local, scale, cuda = cu.cpu().tolist(), 128 ** -0.5, CudaBackend()
    do, true = torch.randn_like(q), torch.randn_like(states)
    remote = [0, 3]
    known = true.clone()
    known[remote] = 0
    ctx_a, d_a = cuda.replay(cuda.prepare(q, k, v, g, beta, cu_local, scale, keep=True), states, do, known)
    grads_a = cuda.backward(ctx_a, do, true)
    ctx_b, walk = cuda.replay_pipelined(q, k, v, g, beta, cu_local, scale, states, do, known, remote if skip else ())
    walked = [i for i in range(len(lens)) if not (skip and i in remote)]  # skip: the remote rows unwritten
    assert torch.equal(walk[1][walked], d_a[walked])
    for name in ("tape", "vnew", "w", "u", "qg", "kg", "aqk", "aqk_diag_lo", "akk_inv", "gamma"):
        assert torch.equal(ctx_a[name], ctx_b[name]), name
    for x, y in zip(grads_a, cuda.backward(ctx_b, do, true, walk=walk, rewalk=remote)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("pipelined", [True, False], ids=["replay_pipelined", "prepare-replay"])
def test_replay_from_what_the_forward_kept_is_bitwise(pipelined):
    """CudaBackend's "replay" mode (replay_keeps): forward and forward_pipelined with keep_replay return the
    forward's tril(Aqk) and inv_pack (the same bits either way), and the replay's chunk stage from them
    (replay_pipelined(kept=), or prepare(kept=) then replay) gives the saved context, D and every gradient of
    the replay that forms them again, bitwise."""
    lens, H = [65, 1, 300, 700, 2300], 2
    q, k, v, g, beta, cu, states = make(lens, H, "rand", rng(("cp-kept", pipelined)), True)
    cu_local, scale, cuda = cu.cpu().tolist(), 128 ** -0.5, CudaBackend()
    do, true = torch.randn_like(q), torch.randn_like(states)
    known = true.clone()
    known[[0, 3]] = 0
    _, _, kept = cuda.forward(q, k, v, g, beta, cu_local, states, scale, keep=False, keep_replay=True)
    assert sorted(kept) == ["aqk", "inv_pack"]
    _, _, kept_p = cuda.forward_pipelined(q, k, v, g, beta, cu_local, scale, False, states, [],
                                          SimpleNamespace(run=lambda prepared, finals: states[[]]), [],
                                          keep_replay=True)
    assert all(torch.equal(kept[name], kept_p[name]) for name in kept)
    if pipelined:
        ctx_a, walk_a = cuda.replay_pipelined(q, k, v, g, beta, cu_local, scale, states, do, known)
        ctx_b, walk_b = cuda.replay_pipelined(q, k, v, g, beta, cu_local, scale, states, do, known, kept=kept)
        assert torch.equal(walk_a[1], walk_b[1])
        grads = [cuda.backward(c, do, true, walk=w, rewalk=[0, 3]) for c, w in ((ctx_a, walk_a), (ctx_b, walk_b))]
    else:
        ctx_a, d_a = cuda.replay(cuda.prepare(q, k, v, g, beta, cu_local, scale, keep=True), states, do, known)
        ctx_b, d_b = cuda.replay(cuda.prepare(q, k, v, g, beta, cu_local, scale, keep=True, kept=kept), states, do,
                                 known)
        assert torch.equal(d_a, d_b)
        grads = [cuda.backward(c, do, true) for c in (ctx_a, ctx_b)]
    assert ctx_b["chunk_form"] == "replay" and ctx_b["aqk"] is kept["aqk"]
    for name in ("tape", "vnew", "w", "u", "qg", "kg", "aqk", "akk_inv", "gamma"):
        assert torch.equal(ctx_a[name], ctx_b[name]), name
    for x, y in zip(*grads, strict=True):
        assert torch.equal(x, y)
