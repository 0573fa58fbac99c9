"""Tests of the explicit chunked KDA backward in kda_aot/reference/chunked.py (CPU).

kda_chunked_fwd_saved + kda_chunked_bwd against autograd through kda_chunked / kda_recurrent
(fp64, relative error max|d| / max|ref| < 1e-10), the saved tensors against chunk_prepare /
kda_chunked, and the fp32 version with g = -5 (finite, no exp factor above 1, close to fp64).

Inputs are fresh random every run; the run seed is printed and each test derives its own seed
from it; reproduce a run with KDA_TEST_SEED=<seed>.
"""

import pytest
import torch

from kda_aot import reference as ref
from kda_aot.reference import chunked as ref_chunked

from conftest import SEED
from reftools import cu_of, make_inputs, rand_lens, rel_err

F64 = torch.float64
REL_FP64 = 1e-10     # explicit vs autograd, fp64 (observed <~1e-14)
REL_FP32 = 1e-4      # fp32 explicit vs fp64 (observed <~1e-5)
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")


@pytest.fixture(autouse=True)
def one_thread():
    """Many tiny ops: one intra-op thread is faster, and avoids OpenMP spin-waits that make
    these tests ~10x slower on a small machine shared with other jobs. Restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)




def autograd_grads(fn, q, k, v, g, beta, h0, do, dfs, lens, **kw):
    """Gradients of <o, do> + <final_state, dfs> by autograd through ref.<fn>. The initial state
    is a leaf even when h0 is None (zeros), so its gradient is always available."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    h0 = torch.zeros(len(lens), H, K, V, dtype=F64) if h0 is None else h0
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, s = getattr(ref, fn)(*leaves[:5], cu_seqlens=cu_of(lens), initial_state=leaves[5],
                            output_final_state=True, **kw)
    outs, gos = [o], [do]
    if dfs is not None:
        outs.append(s)
        gos.append(dfs)
    return torch.autograd.grad(outs, leaves, gos)


def explicit_grads(q, k, v, g, beta, h0, do, dfs, lens, dtype=F64, **kw):
    saved = ref.kda_chunked_fwd_saved(q, k, v, g, beta, cu_seqlens=cu_of(lens), initial_state=h0,
                                      dtype=dtype, **kw)
    return saved, ref.kda_chunked_bwd(saved, do, dfs, q=q, k=k, v=v, g=g, beta=beta)


def check_grads(mine, theirs, msg, tol=REL_FP64):
    for name, a, b in zip(GRAD_NAMES, mine, theirs):
        assert a.shape == b.shape, f"{name}: {tuple(a.shape)} vs {tuple(b.shape)}"
        e = rel_err(a.to(F64), b)
        assert e < tol, f"{name}: rel err {e:.3e} ({msg})"


# ----------------------------------------------------------------------------- gradients, fp64

@pytest.mark.parametrize("init,dfinal",
                         [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("g_mode", ["neg5", "zero", "rand", "mild"])
@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("chunk_size", [64, 8])
def test_bwd_matches_autograd_chunked(gen, chunk_size, H, g_mode, init, dfinal):
    lens = rand_lens(gen)
    K = V = 16
    q, k, v, g, beta, h0 = make_inputs(gen, lens, H, K, V, g_mode, init)
    do = torch.randn(1, sum(lens), H, V, generator=gen, dtype=F64)
    dfs = torch.randn(len(lens), H, K, V, generator=gen, dtype=F64) if dfinal else None
    saved, mine = explicit_grads(q, k, v, g, beta, h0, do, dfs, lens, chunk_size=chunk_size)
    theirs = autograd_grads("kda_chunked", q, k, v, g, beta, h0, do, dfs, lens,
                            chunk_size=chunk_size)
    check_grads(mine, theirs, f"seed {SEED} lens {lens}")
    assert all(x.dtype == F64 for x in mine)


@pytest.mark.parametrize("chunk_size", [64, 8])
def test_bwd_with_resets_matches_autograd_recurrent(gen, chunk_size):
    """g = -inf (a channel reset) at random tokens, some at a chunk's first or last: the chunked reference's
    explicit backward (exact there, reference.G_FLOOR) is autograd through the recurrence, every gradient."""
    lens = rand_lens(gen, n_random=1, hi=100)
    H, K, V = 2, 16, 8
    q, k, v, g, beta, h0 = make_inputs(gen, lens, H, K, V, "rand", init=True)
    reset = torch.rand(g.shape, generator=gen, dtype=F64) < 0.05
    reset[:, ::chunk_size] |= torch.rand(reset[:, ::chunk_size].shape, generator=gen, dtype=F64) < 0.5
    g = g.masked_fill(reset, float("-inf"))
    do = torch.randn(1, sum(lens), H, V, generator=gen, dtype=F64)
    dfs = torch.randn(len(lens), H, K, V, generator=gen, dtype=F64)
    saved, mine = explicit_grads(q, k, v, g, beta, h0, do, dfs, lens, chunk_size=chunk_size)
    theirs = autograd_grads("kda_recurrent", q, k, v, g, beta, h0, do, dfs, lens)
    check_grads(mine, theirs, f"seed {SEED} lens {lens}")
    o, _ = ref.kda_recurrent(q, k, v, g, beta, cu_seqlens=cu_of(lens), initial_state=h0)
    assert rel_err(saved["o"], o) < REL_FP64


@pytest.mark.parametrize("g_mode", ["rand", "mild"])
@pytest.mark.parametrize("chunk_size", [64, 8])
def test_bwd_matches_autograd_recurrent(gen, chunk_size, g_mode):
    lens = rand_lens(gen, n_random=1, hi=100)
    H, K, V = 2, 16, 8
    q, k, v, g, beta, h0 = make_inputs(gen, lens, H, K, V, g_mode, init=True)
    do = torch.randn(1, sum(lens), H, V, generator=gen, dtype=F64)
    dfs = torch.randn(len(lens), H, K, V, generator=gen, dtype=F64)
    _, mine = explicit_grads(q, k, v, g, beta, h0, do, dfs, lens, chunk_size=chunk_size,
                             scale=0.7)
    theirs = autograd_grads("kda_recurrent", q, k, v, g, beta, h0, do, dfs, lens, scale=0.7)
    check_grads(mine, theirs, f"seed {SEED} lens {lens}")


@pytest.mark.parametrize("dfinal", [False, True])
def test_empty_documents_pass_the_state_and_its_gradient(gen, dfinal):
    """A zero-length document (cu_seqlens repeating a bound, first, inside and last in the pack): its final state
    is its initial state and its initial state's gradient is its final state's, in the saved forward and the
    explicit backward as through autograd of the recurrence; every other gradient as well."""
    lens = [0, 70, 0, 0, 5, 0]
    H, K, V = 2, 16, 8
    q, k, v, g, beta, h0 = make_inputs(gen, lens, H, K, V, "rand", init=True)
    do = torch.randn(1, sum(lens), H, V, generator=gen, dtype=F64)
    dfs = torch.randn(len(lens), H, K, V, generator=gen, dtype=F64) if dfinal else None
    saved, mine = explicit_grads(q, k, v, g, beta, h0, do, dfs, lens, chunk_size=64)
    _, want = ref.kda_recurrent(q, k, v, g, beta, cu_seqlens=cu_of(lens), initial_state=h0, output_final_state=True)
    assert rel_err(saved["final_state"], want) < REL_FP64
    for n in (0, 2, 3, 5):
        assert torch.equal(saved["final_state"][n], h0[n])
        assert torch.equal(mine[5][n], dfs[n] if dfinal else torch.zeros_like(h0[n]))
    theirs = autograd_grads("kda_recurrent", q, k, v, g, beta, h0, do, dfs, lens)
    check_grads(mine, theirs, f"seed {SEED} lens {lens}")


@pytest.mark.parametrize("fn", ["kda_recurrent", "kda_chunked"])
def test_a_pack_of_empty_documents(gen, fn):
    """T = 0 (every document empty): an empty output and the initial states as the final ones, as chunk_kda gives."""
    lens = [0, 0]
    q, k, v, g, beta, h0 = make_inputs(gen, lens, 2, 16, 8, "rand", init=True)
    o, s = getattr(ref, fn)(q, k, v, g, beta, cu_seqlens=cu_of(lens), initial_state=h0, output_final_state=True)
    assert o.shape == (1, 0, 2, 8) and o.dtype == F64
    assert torch.equal(s, h0)
    saved = ref.kda_chunked_fwd_saved(q, k, v, g, beta, cu_seqlens=cu_of(lens), initial_state=h0)
    assert saved["o"].shape == (1, 0, 2, 8) and torch.equal(saved["final_state"], h0)


@pytest.mark.parametrize("g_mode", ["rand", "mild"])
def test_bwd_matches_autograd_k128(gen, g_mode):
    lens = rand_lens(gen, n_random=1)
    H, K, V = 2, 128, 128
    q, k, v, g, beta, h0 = make_inputs(gen, lens, H, K, V, g_mode, init=True)
    do = torch.randn(1, sum(lens), H, V, generator=gen, dtype=F64)
    dfs = torch.randn(len(lens), H, K, V, generator=gen, dtype=F64)
    _, mine = explicit_grads(q, k, v, g, beta, h0, do, dfs, lens, chunk_size=64)
    theirs = autograd_grads("kda_chunked", q, k, v, g, beta, h0, do, dfs, lens, chunk_size=64)
    check_grads(mine, theirs, f"seed {SEED} lens {lens}")


def test_bwd_inputs_upcast_and_scale_check(gen):
    """fp32 / bf16 inputs are upcast to the saved dtype; a scale different from the
    forward's is refused."""
    lens = [5, 9]
    q, k, v, g, beta, h0 = make_inputs(gen, lens, 2, 8, 8, "rand", init=True)
    do = torch.randn(1, 14, 2, 8, generator=gen, dtype=F64)
    f32 = [x.float() for x in (q, k, v, g, beta, h0, do)]
    _, a = explicit_grads(*f32[:6], f32[6], None, lens, chunk_size=4)
    _, b = explicit_grads(*(x.double() for x in f32[:6]), f32[6].double(), None, lens,
                          chunk_size=4)
    for x, y in zip(a, b):
        assert x.dtype == F64 and torch.equal(x, y)
    saved = ref.kda_chunked_fwd_saved(q, k, v, g, beta, cu_seqlens=cu_of(lens), scale=0.5)
    with pytest.raises(ValueError):
        ref.kda_chunked_bwd(saved, do, q=q, k=k, v=v, g=g, beta=beta, scale=0.25)


# ----------------------------------------------------------------------------- saved tensors

@pytest.mark.parametrize("g_mode", ["rand", "mild"])
@pytest.mark.parametrize("chunk_size", [64, 8])
def test_saved_matches_chunk_prepare(gen, chunk_size, g_mode):
    lens = rand_lens(gen, n_random=1, hi=150)
    H, K, V = 2, 16, 12
    q, k, v, g, beta, h0 = make_inputs(gen, lens, H, K, V, g_mode, init=True)
    cu = cu_of(lens)
    sv = ref.kda_chunked_fwd_saved(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0,
                                   chunk_size=chunk_size, scale=0.4)
    o, s = ref.kda_chunked(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0,
                           output_final_state=True, chunk_size=chunk_size, scale=0.4)
    assert torch.equal(sv["o"], o) and torch.equal(sv["final_state"], s)
    assert not sv["o"].requires_grad

    bounds = cu.tolist()
    table = [(n, c0, min(c0 + chunk_size, b))
             for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
             for c0 in range(a, b, chunk_size)]
    assert sv["chunks"].tolist() == [list(t) for t in table]
    assert sv["S"].shape == (len(table), H, K, V)

    hf = lambda x, a, b: x[0, a:b].transpose(0, 1)                       # noqa: E731
    for c, (n, c0, c1) in enumerate(table):
        C = c1 - c0
        Qc, Kc, Vc, Gc = (hf(x, c0, c1) for x in (q, k, v, g))
        Bc = beta[0, c0:c1].transpose(0, 1)
        p = ref.chunk_prepare(Kc, Vc, Gc, Bc, q=Qc)
        get = lambda name: hf(sv[name], c0, c1)                          # noqa: E731
        getA = lambda name: hf(sv[name], c0, c1)[..., :C]                # noqa: E731
        for name in ("Gam", "W", "U", "Kg"):
            assert torch.equal(get(name), p[name]), name
        assert torch.equal(getA("Aqk"), p["Aqk"])
        assert torch.equal(sv["gam"][c], p["gam"])
        assert torch.equal(get("Qg"), Qc * torch.exp(p["Gam"]))
        for name in ("Aqk", "Akk", "Akk_inv"):                           # padding columns
            assert not hf(sv[name], c0, c1)[..., C:].any(), name
        # L and its inverse, from the definition (element-wise decays)
        E = torch.exp(p["Gam"][:, :, None, :] - p["Gam"][:, None, :, :])  # fine in fp64 here
        G = torch.einsum("hid,hjd,hijd->hij", Kc, Kc, E).tril(-1)
        L = getA("Akk")
        assert rel_err(L, Bc[:, :, None] * G) < 1e-12
        eye = torch.eye(C, dtype=F64)
        assert rel_err(getA("Akk_inv") @ (eye + L), eye.expand(H, C, C)) < 1e-12
        # the anchored grams (the kernels' recipe) equal the element-wise ones
        assert rel_err(ref_chunked._gated_gram(Qc, Kc, p["Gam"], strict=False), p["Aqk"]) < 1e-12
        assert rel_err(ref_chunked._gated_gram(Kc, Kc, p["Gam"], strict=True), G) < 1e-12
        # the state tape: the state entering the chunk, from an independent recurrence
        if c0 == bounds[n]:
            S_exp = h0[n]
        else:
            _, S_exp = ref.kda_recurrent(*(x[:, bounds[n]:c0] for x in (q, k, v, g, beta)),
                                         cu_seqlens=[0, c0 - bounds[n]],
                                         initial_state=h0[n:n + 1], output_final_state=True)
            S_exp = S_exp[0]
        assert rel_err(sv["S"][c], S_exp) < 1e-12
        assert rel_err(get("v_new"), p["U"] - p["W"] @ sv["S"][c]) < 1e-13


def test_walk_is_affine_in_the_end_gradient(gen):
    """The walk's step is dS = A_c^T dS_end + D_c with A_c = Diag(e^gam) - Kg^T W (the forward's
    affine map, as in fragment_summary) and D_c = scale Qg^T dO - W^T dVp_loc: what the
    context-parallel backward summaries (dS_in = M^T dS_out + D) rely on."""
    lens = [150]
    H, K, V = 2, 16, 8
    q, k, v, g, beta, h0 = make_inputs(gen, lens, H, K, V, "mild", init=True)
    do = torch.randn(1, 150, H, V, generator=gen, dtype=F64)
    dfs = torch.randn(1, H, K, V, generator=gen, dtype=F64)
    sv = ref.kda_chunked_fwd_saved(q, k, v, g, beta, cu_seqlens=[0, 150], initial_state=h0,
                                   chunk_size=64)
    dvl = ref.kda_bwd_dvp_local(sv, do)
    tape, dh0 = ref.kda_bwd_state_walk(sv, do, dvl, dfs)
    M_frag = torch.eye(K, dtype=F64).repeat(H, 1, 1)
    D_frag = torch.zeros(H, K, V, dtype=F64)
    hf = lambda x, a, b: x[0, a:b].transpose(0, 1)                       # noqa: E731
    for c in range(tape.shape[0] - 1, -1, -1):
        _, c0, c1 = sv["chunks"][c].tolist()
        Kg, Qg, W = (hf(sv[x], c0, c1) for x in ("Kg", "Qg", "W"))
        A = torch.diag_embed(torch.exp(sv["gam"][c])) - Kg.transpose(1, 2) @ W
        D = sv["scale"] * Qg.transpose(1, 2) @ hf(do, c0, c1) - W.transpose(1, 2) @ hf(dvl, c0, c1)
        dS_start = dh0[0] if c == 0 else tape[c - 1]
        assert rel_err(dS_start, A.transpose(1, 2) @ tape[c] + D) < 1e-12
        M_frag, D_frag = M_frag @ A, A.transpose(1, 2) @ D_frag + D
    M, _ = ref.fragment_summary(k[0], v[0], g[0], beta[0], chunk_size=64)
    assert rel_err(M_frag, M) < 1e-12
    assert rel_err(dh0[0], M.transpose(1, 2) @ dfs[0] + D_frag) < 1e-12


# ----------------------------------------------------------------------------- fp32 safety

@pytest.mark.parametrize("g_mode", ["neg5", "rand"])
@pytest.mark.parametrize("K", [32, 128])
def test_fp32_bwd_finite_with_g_neg5(gen, K, g_mode, monkeypatch):
    lens = [64, 128, 130, 1]
    H = 2
    q, k, v, g, beta, h0 = make_inputs(gen, lens, H, K, K, g_mode, init=True,
                                       dtype=torch.float32)
    do = torch.randn(1, sum(lens), H, K, generator=gen)
    dfs = torch.randn(len(lens), H, K, K, generator=gen)
    # Sanity: exp(Gam_i) * exp(-Gam_j) over a chunk would overflow fp32 here.
    assert not torch.isfinite(torch.exp(torch.tensor(5.0 * 63, dtype=torch.float32)))

    # Every exp the fp32 forward-saved + backward evaluates has argument <= 0 (factor <= 1).
    real_exp = torch.exp
    args_max = []

    def checked_exp(x, *a, **kw):
        args_max.append(x.max().item() if x.numel() else 0.0)
        return real_exp(x, *a, **kw)

    monkeypatch.setattr(torch, "exp", checked_exp)
    saved, mine = explicit_grads(q, k, v, g, beta, h0, do, dfs, lens, dtype=torch.float32,
                                 chunk_size=64)
    monkeypatch.setattr(torch, "exp", real_exp)
    assert args_max and max(args_max) <= 0.0

    assert all(x.dtype == torch.float32 for x in mine)
    for name, x in zip(GRAD_NAMES, mine):
        assert torch.isfinite(x).all(), name
    assert torch.isfinite(saved["o"]).all() and torch.isfinite(saved["S"]).all()
    _, ref64 = explicit_grads(*(x.double() for x in (q, k, v, g, beta, h0, do, dfs)), lens,
                              chunk_size=64)
    check_grads(mine, ref64, f"seed {SEED} fp32 vs fp64", tol=REL_FP32)


@pytest.mark.parametrize("with_halo", [False, True])
def test_conv_backward_matches_autograd(gen, with_halo):
    """reference.conv1d_silu_bwd (written out) against autograd through reference.conv1d_silu, with
    documents shorter than the window and a zero-length one."""
    lens, D = [2, 15, 0, 23], 8
    T = sum(lens)
    x = torch.randn(1, T, D, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(D, 4, generator=gen, dtype=F64, requires_grad=True)
    b = torch.randn(D, generator=gen, dtype=F64, requires_grad=True)
    halo = torch.randn(len(lens), 3, D, generator=gen, dtype=F64, requires_grad=True) if with_halo else None
    dy = torch.randn(1, T, D, generator=gen, dtype=F64)
    leaves = [x, w, b] + ([halo] if with_halo else [])
    y = ref.conv1d_silu(x, w, b, cu_seqlens=cu_of(lens), halo=halo)
    want = torch.autograd.grad(y, leaves, dy)
    got = ref.conv1d_silu_bwd(x, w, b, dy, cu_seqlens=cu_of(lens), halo=halo)
    assert (got[3] is None) == (not with_halo)
    for a, r in zip(got, want):
        assert rel_err(a, r) < REL_FP64
