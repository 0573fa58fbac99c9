"""Tests of kda_aot/reference (CPU, fp64 unless stated).

Inputs are fresh random every run. The run seed is printed (visible with -s or on failure)
and each test derives its own seed from it; reproduce a run with KDA_TEST_SEED=<seed>.
"""

import pytest
import torch
import torch.nn.functional as F

from kda_aot import reference as ref

from conftest import SEED
from reftools import cu_of, make_inputs, rand_lens, rel_err

F64 = torch.float64
REL_FP64 = 1e-10      # chunked vs recurrent, fp64 (observed <= ~3e-15)




# ----------------------------------------------------------------------------- chunked == recurrent

@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("g_mode", ["neg5", "zero", "rand"])
@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("chunk_size", [64, 8])
def test_chunked_matches_recurrent(gen, chunk_size, H, g_mode, init):
    lens = rand_lens(gen)
    q, k, v, g, beta, h0 = make_inputs(gen, lens, H, 16, 16, g_mode, init)
    kw = dict(cu_seqlens=cu_of(lens), initial_state=h0, output_final_state=True)
    o_r, s_r = ref.kda_recurrent(q, k, v, g, beta, **kw)
    o_c, s_c = ref.kda_chunked(q, k, v, g, beta, chunk_size=chunk_size, **kw)
    assert o_c.dtype == F64 and o_c.shape == (1, sum(lens), H, 16)
    assert s_c.shape == (len(lens), H, 16, 16)
    msg = f"seed {SEED} lens {lens}"
    assert rel_err(o_c, o_r) < REL_FP64, msg
    assert rel_err(s_c, s_r) < REL_FP64, msg


def _with_resets(gen, g, strong=False):
    """g with ~5 % of its (token, channel) entries -inf (resets) and, when strong, some below -1e4."""
    g = g.clone()
    g[torch.rand(g.shape, generator=gen, dtype=F64) < 0.05] = float("-inf")
    if strong:
        g[torch.rand(g.shape, generator=gen, dtype=F64) < 0.05] = -3e4
    return g


@pytest.mark.parametrize("strong", [False, True])
@pytest.mark.parametrize("chunk_size", [64, 8])
def test_chunked_matches_recurrent_with_resets(gen, chunk_size, strong):
    """g = -inf (a reset: exp = 0) and g far below -1000: the chunked form (and the fragment summary)
    is the recurrence, finite everywhere."""
    lens = rand_lens(gen)
    q, k, v, g, beta, h0 = make_inputs(gen, lens, 2, 16, 16, "rand", True)
    g = _with_resets(gen, g, strong)
    kw = dict(cu_seqlens=cu_of(lens), initial_state=h0, output_final_state=True)
    o_r, s_r = ref.kda_recurrent(q, k, v, g, beta, **kw)
    o_c, s_c = ref.kda_chunked(q, k, v, g, beta, chunk_size=chunk_size, **kw)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert rel_err(o_c, o_r) < REL_FP64 and rel_err(s_c, s_r) < REL_FP64, f"seed {SEED} lens {lens}"
    a, b = 0, lens[0]
    M, B = ref.fragment_summary(*(x[0, a:b] for x in (k, v, g)), beta[0, a:b], chunk_size=chunk_size)
    _, s_zero = ref.kda_recurrent(q, k, v, g, beta, cu_seqlens=cu_of(lens), output_final_state=True)
    assert torch.isfinite(M).all() and rel_err(B, s_zero[0]) < REL_FP64


def test_chunked_backward_matches_autograd_with_resets(gen):
    """The explicit chunked backward on g with resets equals autograd through the recurrence."""
    lens = [70, 5, 64]
    q, k, v, g, beta, h0 = make_inputs(gen, lens, 2, 16, 16, "rand", True)
    g = _with_resets(gen, g)
    do = torch.randn(q.shape[:-1] + (16,), generator=gen, dtype=F64)
    dht = torch.randn(h0.shape, generator=gen, dtype=F64)
    sv = ref.kda_chunked_fwd_saved(q, k, v, g, beta, cu_seqlens=cu_of(lens), initial_state=h0)
    got = ref.kda_chunked_bwd(sv, do, dht, q=q, k=k, v=v, g=g, beta=beta)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = ref.kda_recurrent(*leaves[:5], cu_seqlens=cu_of(lens), initial_state=leaves[5], output_final_state=True)
    ((o * do).sum() + (ht * dht).sum()).backward()
    for x, leaf in zip(got, leaves):
        assert torch.isfinite(x).all() and rel_err(x, leaf.grad) < 1e-8, f"seed {SEED}"


@pytest.mark.parametrize("first", [-30.0, -1e4, float("-inf"), -5.0])
def test_entering_decay_makes_a_floored_gate_exact_for_the_initial_state(gen, first):
    """The kernels floor g at kda.GATE_FLOOR; the op multiplies the initial state (and its gradient) by
    kda.entering_decay of each document's first token. With g floored the same way, the recurrence
    then gives the unfloored dh0 and o to ~e^-20 relative (without the factor, dh0 would be e^(-20 - g)
    too large where the first g is below the floor), and leaves everything unchanged above the floor."""
    from kda_aot.schedule.kda import GATE_FLOOR, entering_decay
    lens = [5, 70, 1]
    q, k, v, g, beta, h0 = make_inputs(gen, lens, 2, 16, 16, "rand", True)
    g = g - 25.0 * torch.rand(g.shape, generator=gen, dtype=F64)  # many tokens below the floor
    starts = cu_of(lens)[:-1]
    g[0, starts] = first
    do = torch.randn(q.shape[:-1] + (16,), generator=gen, dtype=F64)

    def step(g_used, decay):
        h = h0.clone().requires_grad_()
        o, ht = ref.kda_recurrent(q, k, v, g_used, beta, cu_seqlens=cu_of(lens),
                                  initial_state=h * decay, output_final_state=True)
        (o * do).sum().backward()
        return o, ht, h.grad

    exact = step(g, 1.0)
    floored = torch.clamp(g, min=GATE_FLOOR)
    decay = entering_decay(g[0, starts])
    assert decay.shape == (len(lens), 2, 16, 1) and decay.dtype == torch.float32
    got = step(floored, decay.double())
    for name, a, b in zip(("o", "final_state", "dh0"), got, exact):
        assert torch.isfinite(a).all()
        assert rel_err(a, b) < 1e-6 if b.norm() > 0 else torch.equal(a, b), f"{name} seed {SEED}"
    if first == -5.0:
        assert torch.equal(decay, torch.ones_like(decay))
    else:
        assert rel_err(step(floored, 1.0)[2], exact[2]) > 1.0  # the floor alone: dh0 wrong


@pytest.mark.parametrize("g_mode", ["rand", "mild"])
@pytest.mark.parametrize("K,V,H,chunk_size", [(32, 24, 2, 64), (24, 40, 1, 4), (128, 128, 2, 64)])
def test_chunked_matches_recurrent_shapes(gen, K, V, H, chunk_size, g_mode):
    lens = rand_lens(gen, n_random=1)
    q, k, v, g, beta, h0 = make_inputs(gen, lens, H, K, V, g_mode, init=True)
    kw = dict(cu_seqlens=cu_of(lens, torch.int64), initial_state=h0, output_final_state=True,
              scale=0.3)
    o_r, s_r = ref.kda_recurrent(q, k, v, g, beta, **kw)
    o_c, s_c = ref.kda_chunked(q, k, v, g, beta, chunk_size=chunk_size, **kw)
    msg = f"seed {SEED} lens {lens}"
    assert rel_err(o_c, o_r) < REL_FP64, msg
    assert rel_err(s_c, s_r) < REL_FP64, msg


def test_defaults_and_upcast(gen):
    """bf16/fp32 inputs are upcast; scale defaults to K**-0.5; cu_seqlens may be a list;
    no final state unless asked."""
    lens = [5, 9]
    q, k, v, g, beta, _ = make_inputs(gen, lens, 2, 8, 8, "rand", dtype=torch.float32)
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    o1, s1 = ref.kda_chunked(qb, kb, vb, g, beta, cu_seqlens=[0, 5, 14], chunk_size=4)
    assert s1 is None and o1.dtype == F64
    o2, _ = ref.kda_recurrent(*(x.to(F64) for x in (qb, kb, vb, g, beta)),
                              cu_seqlens=cu_of(lens), scale=8 ** -0.5)
    assert rel_err(o1, o2) < REL_FP64


def test_zero_length_documents(gen):
    """A zero-length document (padding) leaves its state as it was: final = initial state (or zero); the
    other documents are as in the pack without it."""
    lens = [0, 5, 0, 0, 70, 3, 0]
    q, k, v, g, beta, h0 = make_inputs(gen, lens, 2, 16, 16, "rand", True)
    kept = [i for i, n in enumerate(lens) if n]
    for fn in (ref.kda_recurrent, ref.kda_chunked):
        o, s = fn(q, k, v, g, beta, cu_seqlens=cu_of(lens), initial_state=h0, output_final_state=True)
        o_c, s_c = fn(q, k, v, g, beta, cu_seqlens=cu_of([lens[i] for i in kept]), initial_state=h0[kept],
                      output_final_state=True)
        assert torch.equal(o, o_c) and torch.equal(s[kept], s_c)
        assert all(torch.equal(s[i], h0[i]) for i, n in enumerate(lens) if not n)
    x = torch.randn(1, sum(lens), 8, generator=gen, dtype=F64)
    w = torch.randn(8, 4, generator=gen, dtype=F64)
    assert torch.equal(ref.conv1d_silu(x, w, cu_seqlens=cu_of(lens)),
                       ref.conv1d_silu(x, w, cu_seqlens=cu_of([lens[i] for i in kept])))


def test_bad_cu_seqlens_raise(gen):
    q, k, v, g, beta, _ = make_inputs(gen, [4], 1, 4, 4)
    for cu in ([0, 3], [1, 4], [0, 3, 2, 4]):
        with pytest.raises(ValueError):
            ref.kda_chunked(q, k, v, g, beta, cu_seqlens=cu)
    for cu in ([0, 2.5, 4], [0, True, 4], "04"):  # refused, never truncated
        with pytest.raises(TypeError, match="cu_seqlens: expected a tensor or a sequence of ints"):
            ref.kda_chunked(q, k, v, g, beta, cu_seqlens=cu)
    assert torch.equal(ref.kda_chunked(q, k, v, g, beta, cu_seqlens=range(0, 5, 2))[0],
                       ref.kda_chunked(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 2, 4]))[0])
    assert torch.equal(ref.kda_chunked(q, k, v, g, beta, cu_seqlens=iter([0, 2, 4]))[0],  # an iterator, read once
                       ref.kda_chunked(q, k, v, g, beta, cu_seqlens=[0, 2, 4])[0])
    with pytest.raises(TypeError) as e:  # a long bad list is named, not printed whole
        ref.kda_chunked(q, k, v, g, beta, cu_seqlens=[0.5] * 100_000)
    assert len(str(e.value)) < 200


# ----------------------------------------------------------------------------- fp32 safety

@pytest.mark.parametrize("K", [32, 128])
def test_fp32_chunked_finite_with_g_neg5(gen, K):
    lens = [64, 128, 130, 1]
    q, k, v, g, beta, h0 = make_inputs(gen, lens, 2, K, K, "neg5", init=True,
                                       dtype=torch.float32)
    # Sanity: the naive exp(Gam_i) * exp(-Gam_j) would overflow fp32 here.
    assert not torch.isfinite(torch.exp(torch.tensor(5.0 * 64, dtype=torch.float32)))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    kw = dict(cu_seqlens=cu_of(lens), output_final_state=True, chunk_size=64)
    o, s = ref.kda_chunked(*leaves[:5], initial_state=leaves[5], dtype=torch.float32, **kw)
    assert o.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    (o.sum() + s.sum()).backward()
    for x in leaves:
        assert torch.isfinite(x.grad).all()
    o64, s64 = ref.kda_chunked(q, k, v, g, beta, initial_state=h0, **kw)
    # fp32 rounding (6e-8) through sums of ~K * 64 products: measured 1.4-5.0e-7 (o) and 0.6-1.2e-7 (state) over
    # ten draws; an overflow or a lost decay factor would be O(1)
    assert rel_err(o.double(), o64) < 1e-5 and rel_err(s.double(), s64) < 1e-5


# ----------------------------------------------------------------------------- gradcheck

@pytest.mark.parametrize("fn", ["kda_recurrent", "kda_chunked"])
def test_gradcheck_kda(gen, fn):
    lens = [3, 6, 1]
    q, k, v, g, beta, h0 = make_inputs(gen, lens, 2, 3, 2, "rand", init=True)
    g = g * 0.3  # keep decays moderate so the finite differences are well scaled
    f = getattr(ref, fn)
    extra = {"chunk_size": 4} if fn == "kda_chunked" else {}

    def run(q, k, v, g, beta, h0):
        return f(q, k, v, g, beta, cu_seqlens=cu_of(lens), initial_state=h0,
                 output_final_state=True, **extra)

    inputs = tuple(x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0))
    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_conv(gen):
    lens = [1, 2, 5]
    D = 3
    x = torch.randn(1, sum(lens), D, generator=gen, dtype=F64)
    w = torch.randn(D, 4, generator=gen, dtype=F64)
    b = torch.randn(D, generator=gen, dtype=F64)
    halo = torch.randn(len(lens), 3, D, generator=gen, dtype=F64)

    def run(x, w, b, halo):
        return ref.conv1d_silu(x, w, b, cu_seqlens=cu_of(lens), halo=halo)

    inputs = tuple(t.clone().requires_grad_(True) for t in (x, w, b, halo))
    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


# ----------------------------------------------------------------------------- affine summaries

def _slice_tokens(x, a, b):
    return x[0, a:b]


@pytest.mark.parametrize("g_mode", ["zero", "mild", "rand"])
@pytest.mark.parametrize("chunk_size", [64, 8])
def test_fragment_summary_composes(gen, chunk_size, g_mode):
    """Walking a document fragment by fragment with S <- M S + B equals the single walk,
    and the fragment outputs computed from the composed entering states equal the
    single-device outputs (a context-parallel forward in miniature)."""
    H, K, V = 2, 16, 12
    Ld = int(torch.randint(150, 260, (1,), generator=gen))
    q, k, v, g, beta, _ = make_inputs(gen, [Ld], H, K, V, g_mode)
    S0 = torch.randn(1, H, K, V, generator=gen, dtype=F64)
    o_full, s_full = ref.kda_recurrent(q, k, v, g, beta, cu_seqlens=[0, Ld],
                                       initial_state=S0, output_final_state=True)
    r = sorted(torch.randperm(Ld - 1, generator=gen)[:2].add(1).tolist())
    splits = [
        [0, Ld],                        # one fragment
        [0, r[0], Ld],                  # two fragments, arbitrary cut
        [0, r[0], r[1], Ld],            # three fragments, arbitrary cuts
        [0, 64, 128, Ld],               # chunk-aligned cuts
    ]
    for cuts in splits:
        S, S_zero, entering = S0[0], torch.zeros(H, K, V, dtype=F64), []
        for a, b in zip(cuts[:-1], cuts[1:]):
            M, B = ref.fragment_summary(*(_slice_tokens(x, a, b) for x in (k, v, g, beta)),
                                        chunk_size=chunk_size)
            assert M.shape == (H, K, K) and B.shape == (H, K, V)
            entering.append(S)
            S = M @ S + B
            S_zero = M @ S_zero + B
        msg = f"seed {SEED} Ld {Ld} cuts {cuts}"
        assert rel_err(S, s_full[0]) < REL_FP64, msg
        # from a zero start the composition equals the walk without initial state
        _, s_nz = ref.kda_recurrent(q, k, v, g, beta, cu_seqlens=[0, Ld],
                                    output_final_state=True)
        assert rel_err(S_zero, s_nz[0]) < REL_FP64, msg
        # fragments as separate "documents" entered with the composed states
        o_frag, _ = ref.kda_chunked(q, k, v, g, beta, cu_seqlens=cuts,
                                    initial_state=torch.stack(entering), chunk_size=chunk_size)
        assert rel_err(o_frag, o_full) < REL_FP64, msg


def test_fragment_summary_empty_and_single_token(gen):
    H, K, V = 2, 4, 3
    M, B = ref.fragment_summary(torch.zeros(0, H, K), torch.zeros(0, H, V),
                                torch.zeros(0, H, K), torch.zeros(0, H))
    assert torch.equal(M, torch.eye(K, dtype=F64).expand(H, K, K))
    assert torch.equal(B, torch.zeros(H, K, V, dtype=F64))
    # one token: M = (I - b k k^T) Diag(exp g), B = b k v^T
    _, k, v, g, beta, _ = make_inputs(gen, [1], H, K, V, "rand")
    M, B = ref.fragment_summary(k[0], v[0], g[0], beta[0])
    kk, vv, gg, bb = k[0, 0], v[0, 0], g[0, 0], beta[0, 0]
    eye = torch.eye(K, dtype=F64)
    M_exp = (eye - bb[:, None, None] * kk[:, :, None] * kk[:, None, :]) @ torch.diag_embed(gg.exp())
    B_exp = bb[:, None, None] * kk[:, :, None] * vv[:, None, :]
    assert rel_err(M, M_exp) < 1e-13 and rel_err(B, B_exp) < 1e-13


# ----------------------------------------------------------------------------- conv1d + SiLU

def conv_independent(x, w, b, lens, halo):
    """Per-document F.conv1d (groups=D) with left zero padding or the halo prepended."""
    D = x.shape[-1]
    ys, a = [], 0
    for n, L in enumerate(lens):
        xs = x[0, a:a + L].T                                       # [D, L]
        pre = halo[n].T if halo is not None else torch.zeros(D, 3, dtype=x.dtype)
        y = F.conv1d(torch.cat([pre, xs], dim=1)[None], w[:, None, :], b, groups=D)
        ys.append(F.silu(y[0]).T)
        a += L
    return torch.cat(ys)[None]


@pytest.mark.parametrize("use_halo", [False, True])
@pytest.mark.parametrize("use_bias", [False, True])
def test_conv1d_silu_matches_conv1d(gen, use_halo, use_bias):
    lens = [1, 2, 3, 4, 63, 64, 65]
    lens = [lens[i] for i in torch.randperm(len(lens), generator=gen).tolist()]
    D = 8
    x = torch.randn(1, sum(lens), D, generator=gen, dtype=F64)
    w = torch.randn(D, 4, generator=gen, dtype=F64)
    b = torch.randn(D, generator=gen, dtype=F64) if use_bias else None
    halo = torch.randn(len(lens), 3, D, generator=gen, dtype=F64) if use_halo else None
    y = ref.conv1d_silu(x, w, b, cu_seqlens=cu_of(lens), halo=halo)
    assert y.shape == x.shape and y.dtype == F64
    assert rel_err(y, conv_independent(x, w, b, lens, halo)) < 1e-13, f"seed {SEED} lens {lens}"


def test_conv1d_silu_zero_halo_equals_no_halo_and_split(gen):
    """A zero halo equals no halo; splitting a document into segments whose halos are the
    3 preceding tokens reproduces the unsplit result (what context parallelism relies on)."""
    D, L = 5, 40
    x = torch.randn(1, L, D, generator=gen, dtype=torch.float32)
    w = torch.randn(D, 4, generator=gen, dtype=torch.float32)
    b = torch.randn(D, generator=gen, dtype=torch.float32)
    y = ref.conv1d_silu(x, w, b, cu_seqlens=[0, L])
    y0 = ref.conv1d_silu(x, w, b, cu_seqlens=[0, L], halo=torch.zeros(1, 3, D))
    assert torch.equal(y, y0)
    cuts = [0, 2, 17, 18, L]
    halo = torch.stack([torch.cat([torch.zeros(3, D), x[0]])[s:s + 3] for s in cuts[:-1]])
    ys = ref.conv1d_silu(x, w, b, cu_seqlens=cuts, halo=halo)
    assert rel_err(ys, y) < 1e-14


def test_a_positive_gate_is_refused(gen):
    q, k, v = (torch.randn(1, 8, 1, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    beta = torch.rand(1, 8, 1, generator=gen, dtype=torch.float64)
    for bad in (0.5, float("nan")):
        g = -torch.rand(1, 8, 1, 16, generator=gen, dtype=torch.float64)
        g[0, 3, 0, 5] = bad
        for fn in (ref.kda_chunked, ref.kda_recurrent):
            with pytest.raises(ValueError, match="g: the log decay must be <= 0"):
                fn(q, k, v, g, beta, cu_seqlens=[0, 8])
    g[0, 3, 0, 5] = float("-inf")  # a reset is legal
    ref.kda_chunked(q, k, v, g, beta, cu_seqlens=[0, 8])


def test_scale_and_dtype_are_checked_as_the_ops_check_them(gen):
    """A NaN or non-numeric scale is refused as chunk_kda and PackedKDA refuse it (not an all-NaN output), and a
    working dtype the chunked forms cannot compute in is named (not torch's missing-kernel error); fp32 works, and
    the recurrent form takes half precision."""
    q, k, v = (torch.randn(1, 8, 1, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    beta = torch.rand(1, 8, 1, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, 8, 1, 16, generator=gen, dtype=torch.float64)
    for fn in (ref.kda_chunked, ref.kda_recurrent, ref.kda_chunked_fwd_saved):
        with pytest.raises(ValueError, match="scale: expected a finite number, got nan"):
            fn(q, k, v, g, beta, cu_seqlens=[0, 8], scale=float("nan"))
        with pytest.raises(TypeError, match="scale: expected a real number or None, got str"):
            fn(q, k, v, g, beta, cu_seqlens=[0, 8], scale="0.25")
    for fn in (ref.kda_chunked, ref.kda_chunked_fwd_saved):
        for dtype in (torch.float16, torch.bfloat16):
            with pytest.raises(TypeError, match=f"dtype: the chunked reference computes in torch.float64 or "
                                                f"torch.float32, got {dtype}"):
                fn(q, k, v, g, beta, cu_seqlens=[0, 8], dtype=dtype)
    o16, _ = ref.kda_recurrent(q, k, v, g, beta, cu_seqlens=[0, 8], dtype=torch.bfloat16)
    assert o16.dtype == torch.bfloat16 and torch.isfinite(o16).all()
    o64, _ = ref.kda_chunked(q, k, v, g, beta, cu_seqlens=[0, 8], scale=torch.tensor(0.3))
    o32, _ = ref.kda_chunked(q, k, v, g, beta, cu_seqlens=[0, 8], scale=0.3, dtype=torch.float32)
    assert o32.dtype == torch.float32 and rel_err(o32, o64) < 1e-5


def test_the_activations_check_their_arguments_as_the_ops_do(gen):
    """kda_gate, l2norm and beta_sigmoid, the forms the ops' CPU refusals name: a missing or wrong parameter is named
    (not an AttributeError or a reshape error), an integer tensor is refused (not silently zeros); without
    cu_seqlens the reference runs one document, as documented."""
    g = torch.randn(1, 8, 2, 16, generator=gen, dtype=F64)
    with pytest.raises(ValueError, match="A_log: required with use_gate_in_kernel=True unless lower_bound is set"):
        ref.kda_gate(g, None, None, None)
    with pytest.raises(ValueError, match=r"A_log: expected 2 elements \(\[HV\] for HV = 2\), got shape \[4\]"):
        ref.kda_gate(g, torch.zeros(4), None, None)
    with pytest.raises(ValueError, match=r"dt_bias: expected 32 elements"):
        ref.kda_gate(g, torch.zeros(2), torch.zeros(16), None)
    with pytest.raises(ValueError, match="lower_bound: must be a finite number < 0"):
        ref.kda_gate(g, None, None, 0.5)
    assert torch.equal(ref.kda_gate(g, None, None, -1.0), -torch.sigmoid(g))
    with pytest.raises(TypeError, match="x: expected a floating-point tensor, got torch.int64"):
        ref.l2norm(torch.ones(2, 16, dtype=torch.int64))
    b = torch.randn(1, 8, 2, generator=gen, dtype=F64)
    assert torch.equal(ref.beta_sigmoid(b, dtype=F64), torch.sigmoid(b))
    q, k, v = (torch.randn(1, 8, 2, 16, generator=gen, dtype=F64) for _ in range(3))
    beta = torch.rand(1, 8, 2, generator=gen, dtype=F64)
    assert torch.equal(ref.kda_chunked(q, k, v, -g.abs(), beta)[0],
                       ref.kda_chunked(q, k, v, -g.abs(), beta, cu_seqlens=[0, 8])[0])
