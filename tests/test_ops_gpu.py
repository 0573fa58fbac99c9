"""The public ops on the GPU as training code calls them: torch.library's opcheck on every op,
torch.compile(fullgraph=True) and its CUDA-graph mode bitwise equal to eager, plain .sum() losses and
unused outputs (expanded or absent incoming gradients), q/k/v as views of one projection, zero-length
documents, and cu_seqlens in every form flash-linear-attention takes - each against the fp64 reference
or bitwise against the call it must equal.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import SEED, deterministic_mode, gpu, seed_of
from kda_aot import chunk_kda, reference
from kda_aot.nn import PackedKDA
from test_kda_bwd_gpu import BOUND
from test_kda_fwd_gpu import REL, rel_rms, rng

pytestmark = gpu
BF = torch.bfloat16
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def inputs(lens, H, gen, fused=False):
    """q, k, v (views of one [1, T, 3H, 128] projection when fused), g, beta, h0 as leaves, cu (CPU)."""
    T = sum(lens)
    if fused:
        qkv = torch.randn(1, T, 3 * H, 128, device="cuda", generator=gen).to(BF).requires_grad_()
        leaves = [qkv]
    else:
        leaves = [torch.randn(1, T, H, 128, device="cuda", generator=gen).to(BF).requires_grad_() for _ in range(3)]
    g = (-5 * torch.rand(1, T, H, 128, device="cuda", generator=gen)).requires_grad_()
    beta = torch.rand(1, T, H, device="cuda", generator=gen).to(BF).requires_grad_()
    h0 = (0.1 * torch.randn(len(lens), H, 128, 128, device="cuda", generator=gen)).requires_grad_()
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    return leaves, g, beta, h0, cu


def qkv_of(leaves, H):
    return leaves[0].split(H, dim=2) if len(leaves) == 1 else leaves


def reference_grads(q, k, v, g, beta, h0, cu, do, dht):
    """fp64 chunked reference of o, final state and every gradient (q and k L2-normalised first)."""
    cpu = [x.detach().cpu().double() for x in (q, k, v, g, beta)]
    qn, kn = (F.normalize(x, dim=-1) for x in cpu[:2])
    rs = reference.kda_chunked_fwd_saved(qn, kn, *cpu[2:], cu_seqlens=cu, initial_state=h0.detach().cpu())
    grads = reference.kda_chunked_bwd(rs, do.cpu().double(), None if dht is None else dht.cpu().double(),
                                      q=qn, k=kn, v=cpu[2], g=cpu[3], beta=cpu[4])
    return rs, grads


def normalised_grads(q, k, dqn, dkn):
    """d(loss)/dq from d(loss)/d(q / |q|) (the reference takes normalised q, k)."""
    out = []
    for x, dy in ((q, dqn), (k, dkn)):
        x = x.detach().cpu().double()
        n = x.norm(dim=-1, keepdim=True)
        y = x / n
        out.append((dy - y * (dy * y).sum(-1, keepdim=True)) / n)
    return out


# ------------------------------------------------------------------------------ opcheck

def _small(gen, T=150, H=2, N=3):
    q, k, v = (F.normalize(torch.randn(1, T, H, 128, device="cuda", generator=gen), dim=-1).to(BF) for _ in "qkv")
    g = -5 * torch.rand(1, T, H, 128, device="cuda", generator=gen)
    beta = torch.rand(1, T, H, device="cuda", generator=gen).to(BF)
    h0 = torch.randn(N, H, 128, 128, device="cuda", generator=gen)
    return q, k, v, g, beta, h0, torch.tensor([0, 0, 70, T])


def test_opcheck_every_op():
    """Schema, fake implementation against the real outputs (also with dynamic shapes), autograd
    registration: torch.library.opcheck on each op."""
    ops = torch.ops.kda_aot
    gen = rng("opcheck")
    q, k, v, g, beta, h0, cu = _small(gen)
    leaf = lambda x: x.clone().requires_grad_()  # noqa: E731
    for op in (ops.chunk_kda_fwd, ops.chunk_kda_fwd_saved):
        torch.library.opcheck(op, (leaf(q), leaf(k), leaf(v), leaf(g), leaf(beta), leaf(h0), cu, 0.1, True))
        torch.library.opcheck(op, (q, k, v, g, beta, None, cu, 0.1, False))
    do = torch.randn_like(q)
    dht = torch.randn_like(h0)
    torch.library.opcheck(ops.chunk_kda_bwd, (q, k, v, g, beta, h0, cu, 0.1, do, dht))
    torch.library.opcheck(ops.chunk_kda_bwd, (q, k, v, g, beta, None, cu, 0.1, do, None))
    context = ops.chunk_kda_fwd_saved(q, k, v, g, beta, h0, cu, 0.1, True)[2:]  # the saved context
    torch.library.opcheck(ops.chunk_kda_bwd_saved, (q, k, v, g, beta, h0, cu, 0.1, *context, do, dht))
    x = torch.randn(1, q.shape[1], 256, device="cuda", generator=gen).to(BF)
    w, b = torch.randn(256, 4, device="cuda", generator=gen), torch.randn(256, device="cuda", generator=gen)
    halo = torch.randn(3, 3, 256, device="cuda", generator=gen).to(BF)
    for form in ("default", "l2norm"):
        torch.library.opcheck(ops.causal_conv1d_silu_fwd, (leaf(x), leaf(w), leaf(b), leaf(halo), cu, form))
        torch.library.opcheck(ops.causal_conv1d_silu_bwd, (x, w, b, halo, cu, x, form, True))
    torch.library.opcheck(ops.l2norm_fwd, (leaf(q), 1e-6))
    torch.library.opcheck(ops.l2norm_bwd, (q, torch.rand(q.shape[:-1], device="cuda") + 1, do))


# ------------------------------------------------------------------- losses, views, layouts

@pytest.mark.parametrize("backward", ["replay", "saved"])
@pytest.mark.parametrize("loss", ["sum", "o_only", "state_only"])
def test_plain_losses_and_unused_outputs(backward, loss):
    """loss = o.sum() + final_state.sum() (expanded incoming gradients), o alone (no state gradient),
    the state alone (no output gradient): every gradient against fp64, q/k/v views of one projection."""
    H, lens = 2, [1, 63, 64, 65, 300]
    leaves, g, beta, h0, cu = inputs(lens, H, rng(("loss", backward, loss)), fused=True)
    q, k, v = qkv_of(leaves, H)
    o, s = chunk_kda(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                     use_qk_l2norm_in_kernel=True, backward=backward)
    total = {"sum": o.sum() + s.sum(), "o_only": o.sum(), "state_only": s.sum()}[loss]
    total.backward()
    do = torch.zeros_like(o) if loss == "state_only" else torch.ones_like(o)
    dht = None if loss == "o_only" else torch.ones_like(s)
    rs, want = reference_grads(q, k, v, g, beta, h0, cu, do, dht)
    if loss != "state_only":
        assert rel_rms(o.detach().cpu(), rs["o"]) < REL
    dq, dk = normalised_grads(q, k, want[0], want[1])
    dqkv = leaves[0].grad.cpu()
    got = dict(zip(NAMES, (dqkv[:, :, :H], dqkv[:, :, H:2 * H], dqkv[:, :, 2 * H:], g.grad.cpu(), beta.grad.cpu(),
                           h0.grad.cpu())))
    for name, ref in zip(NAMES, (dq, dk, *want[2:])):
        e = rel_rms(got[name], ref)
        assert torch.isfinite(got[name]).all() and e < BOUND.get(name, REL), f"{name} {e:.3e} (seed {SEED})"


def test_strided_views_equal_contiguous_inputs_bitwise():
    """Transposed and sliced views give bitwise the outputs and gradients of their contiguous copies."""
    H, lens = 3, [100, 29]
    gen = rng("views")
    T = sum(lens)
    base = [torch.randn(1, H, T, 128, device="cuda", generator=gen).to(BF) for _ in range(3)]
    base += [-5 * torch.rand(1, T, H, 256, device="cuda", generator=gen),
             torch.rand(1, H, T, device="cuda", generator=gen).to(BF)]
    cu = torch.tensor([0, 100, T])
    do = torch.randn(1, T, H, 128, device="cuda", generator=gen).to(BF)

    def run(copy):
        leaves = [x.clone().requires_grad_() for x in base]
        xs = [x.transpose(1, 2) for x in leaves[:3]] + [leaves[3][..., ::2], leaves[4].transpose(1, 2)]
        assert not any(x.is_contiguous() for x in xs)
        o, _ = chunk_kda(*(x.contiguous() if copy else x for x in xs), cu_seqlens=cu)
        o.backward(do)
        return [o.detach()] + [x.grad for x in leaves]
    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("lens", [[0, 70, 5], [70, 5, 0], [3, 0, 0, 64, 0, 129, 0], [0, 0]],
                         ids=["first", "last", "consecutive", "all-empty"])
@pytest.mark.parametrize("backward", ["replay", "saved"])
def test_zero_length_documents(lens, backward):
    """Padded packs: bitwise the pack without the empty documents; an empty document's final state is
    its initial state, its initial-state gradient the final-state gradient."""
    H = 2
    leaves, g, beta, h0, cu = inputs(lens, H, rng(("empty", tuple(lens), backward)))
    kept = [i for i, n in enumerate(lens) if n]
    T = sum(lens)
    gen = rng(("empty-grads", tuple(lens)))
    do = torch.randn(1, T, H, 128, device="cuda", generator=gen).to(BF)
    dht = torch.randn(len(lens), H, 128, 128, device="cuda", generator=gen)
    o, s = chunk_kda(*leaves, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True, backward=backward)
    torch.autograd.backward((o, s), (do, dht))
    got = [o.detach(), s.detach()] + [x.grad for x in (*leaves, g, beta, h0)]
    empty = [i for i, n in enumerate(lens) if not n]
    assert torch.equal(s[empty], h0[empty]) and torch.equal(h0.grad[empty], dht[empty])
    if not kept:
        assert o.shape == (1, 0, H, 128) and all(x.grad.shape == x.shape for x in (*leaves, g, beta))
        return
    fresh = [x.detach().clone().requires_grad_() for x in (*leaves, g, beta)]
    h0k = h0.detach()[kept].clone().requires_grad_()
    ok, sk = chunk_kda(*fresh, cu_seqlens=torch.tensor([0, *[lens[i] for i in kept]]).cumsum(0),
                       initial_state=h0k, output_final_state=True, backward=backward)
    torch.autograd.backward((ok, sk), (do, dht[kept]))
    assert torch.equal(o, ok) and torch.equal(s[kept], sk)
    for a, b in zip(got[2:-1], [x.grad for x in fresh]):
        assert torch.equal(a, b)
    assert torch.equal(h0.grad[kept], h0k.grad)


def test_cu_seqlens_forms_are_bitwise_the_same():
    """int32 or int64, on the CPU or the GPU, and GPU + its CPU copy (cu_seqlens_cpu: no host sync)."""
    H, lens = 2, [77, 200, 1]
    leaves, g, beta, h0, cu = inputs(lens, H, rng("cu-forms"))
    args = [x.detach() for x in (*leaves, g, beta)]
    want = chunk_kda(*args, cu_seqlens=cu, initial_state=h0.detach(), output_final_state=True)
    for kw in (dict(cu_seqlens=cu.long()), dict(cu_seqlens=cu.cuda()), dict(cu_seqlens=cu.long().cuda()),
               dict(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)):
        got = chunk_kda(*args, initial_state=h0.detach(), output_final_state=True, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), kw


def test_a_device_cu_seqlens_is_read_once():
    """FLA's layer passes cu_seqlens on the GPU, the same tensor to every layer: the first call reads it (a host
    sync); later forwards and backwards on that tensor make no host sync at all (torch's sync debug mode raises at
    one), and give the bits of the first."""
    H, lens = 2, [1, 63, 64, 65, 300]
    leaves, g, beta, h0, cu = inputs(lens, H, rng("cu-once"))
    cu_dev = cu.cuda()
    do = torch.randn(1, sum(lens), H, 128, device="cuda", generator=rng("cu-once-do")).to(BF)

    def step():
        for x in (*leaves, g, beta):
            x.grad = None
        o, _ = chunk_kda(*leaves, g, beta, cu_seqlens=cu_dev, use_qk_l2norm_in_kernel=True)
        o.backward(do)
        return [o.detach(), *(x.grad for x in (*leaves, g, beta))]

    first = step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_cu_seqlens_errors_name_the_argument():
    leaves, g, beta, h0, cu = inputs([10, 20], 1, rng("cu-errors"))
    args = [x.detach() for x in (*leaves, g, beta)]
    with pytest.raises(ValueError, match="cu_seqlens: must be non-decreasing"):
        chunk_kda(*args, cu_seqlens=torch.tensor([0, 20, 10, 30]))
    with pytest.raises(ValueError, match="cu_seqlens_cpu: expected a CPU tensor"):
        chunk_kda(*args, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu.cuda())
    with pytest.raises(ValueError, match="cu_seqlens_cpu: give cu_seqlens too"):
        chunk_kda(*args, cu_seqlens_cpu=cu)
    with pytest.raises(ValueError, match=r"initial_state: expected shape \[2, 1, 128, 128\]"):
        chunk_kda(*args, cu_seqlens=cu, initial_state=h0.detach()[:1])


# ------------------------------------------------------------------------------ compile

def _b3_step(m, xs, g, beta, cu):
    o, s = m(*xs, g, beta, cu_seqlens=cu, output_final_state=True)
    return o.float().sum() + s.sum(), o


def _module_and_inputs(mode, tag, lens=(700, 1, 64, 0, 300)):
    H = 4
    T, D = sum(lens), H * 128
    gen = rng(tag)
    torch.manual_seed(seed_of(("module", tag)))
    m = PackedKDA(H, 128, conv_bias=True, backward=mode).cuda()
    assert m.backend == "auto"
    xs = [torch.randn(1, T, D, device="cuda", generator=gen).to(BF).requires_grad_() for _ in range(3)]
    g = -5 * torch.rand(1, T, H, 128, device="cuda", generator=gen)
    beta = torch.rand(1, T, H, device="cuda", generator=gen).to(BF)
    return m, xs, g, beta, torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


def _run(fn, m, xs, g, beta, cu):
    for t in xs + list(m.parameters()):
        t.grad = None
    loss, o = fn(m, xs, g, beta, cu)
    loss.backward()
    return [o.detach().clone()] + [t.grad.clone() for t in xs + list(m.parameters())]


@pytest.mark.parametrize("mode", ["replay", "saved"])
def test_compiled_step_is_bitwise_eager(mode):
    """torch.compile(fullgraph=True) of a B3 step (PackedKDA on the kernels: conv + fused norm, KDA,
    a sum loss): one graph, and the output and every gradient bitwise the eager step's."""
    torch._dynamo.reset()
    m, xs, g, beta, cu = _module_and_inputs(mode, ("compile", mode))
    eager = _run(_b3_step, m, xs, g, beta, cu)
    compiled = torch.compile(_b3_step, fullgraph=True)
    for _ in range(2):
        got = _run(compiled, m, xs, g, beta, cu)
        for a, b in zip(eager, got):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["replay", "saved"])
def test_reduce_overhead_replays_bitwise_on_every_pack(mode):
    """mode="reduce-overhead": inductor's kernels replay as CUDA graphs, the ops planned from cu_seqlens
    run between them (kda_aot._runtime.packing.PLANNED_FROM_HOST), no cudagraph skip; every step is bitwise the
    eager step, also after the pack changes under the same shapes (a graph of one pack's launches
    would replay them for the other)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    m, xs, g, beta, cu = _module_and_inputs(mode, ("graphs", mode))
    other = torch.tensor([0, 3, 600, 700, 1065, sum(cu.diff().tolist())], dtype=torch.int32)
    assert other.shape == cu.shape and other[-1] == cu[-1]
    eager = {id(c): _run(_b3_step, m, xs, g, beta, c) for c in (cu, other)}
    compiled = torch.compile(_b3_step, fullgraph=True, mode="reduce-overhead")
    for c in (cu, cu, other, cu, other, other):
        got = _run(compiled, m, xs, g, beta, c)
        for a, b in zip(eager[id(c)], got):
            assert torch.equal(a, b)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def fla_call_leaves(gen, T, H, D=128):
    """FLA's layer call's inputs as its layer makes them: one [1, T, 3 H D] projection for q, k, v, the raw bf16 gate
    (x 8, so that g reaches below -30 with A_log and dt_bias), beta's logits, A_log, dt_bias."""
    proj = (2 * torch.randn(1, T, 3 * H * D, device="cuda", generator=gen)).to(BF).requires_grad_()
    raw = (8 * torch.randn(1, T, H, D, device="cuda", generator=gen)).to(BF).requires_grad_()
    logits = torch.randn(1, T, H, device="cuda", generator=gen).to(BF).requires_grad_()
    a_log = torch.log(15 * torch.rand(H, device="cuda", generator=gen) + 1).requires_grad_()
    dt_bias = (0.1 * torch.randn(H * D, device="cuda", generator=gen)).requires_grad_()
    return proj, raw, logits, a_log, dt_bias


def in_mode(step, deterministic):
    """step() in torch's deterministic mode or out of it (GPU tests run in it: conftest.nan_filled_memory)."""
    with deterministic_mode(deterministic):
        return step()


@pytest.mark.parametrize("backward", ["replay", "saved"])
def test_compiled_fla_layer_call_is_bitwise_eager(backward):
    """FLA's layer call as its layer makes it (q, k, v views of one projection, the raw bf16 gate with A_log and
    dt_bias reaching g < -30, beta logits, the norm in the call, a device cu_seqlens), `o.sum()` as the loss,
    under torch.compile(fullgraph=True): finite and bitwise the eager call. Dynamo's builtins differ between
    torch versions (torch 2.11 cannot trace bool() of a tuple), so the kernels' own call path is traced here."""
    gen = rng("compiled-fla-layer-call")
    H, D, lens = 2, 128, [1, 63, 64, 65, 700]
    T = sum(lens)
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
    leaves = proj, raw, logits, a_log, dt_bias = fla_call_leaves(gen, T, H, D)

    def call(proj, raw, logits, a_log, dt_bias):
        q, k, v = (t.view(1, T, H, D) for t in proj.split(H * D, dim=-1))
        return chunk_kda(q, k, v, raw, logits, A_log=a_log, dt_bias=dt_bias, cu_seqlens=cu, backward=backward,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)[0]

    def step(fn):
        for x in leaves:
            x.grad = None
        o = fn(*leaves)
        o.sum().backward()
        return [o.detach()] + [x.grad.clone() for x in leaves]

    with torch.no_grad():
        g = -a_log.exp()[:, None] * F.softplus(raw.float() + dt_bias.view(H, D))
    assert g.min().item() < -30
    eager = step(call)
    compiled = step(torch.compile(call, fullgraph=True))
    for name, a, b in zip(("o", "dproj", "draw", "dlogits", "dA_log", "ddt_bias"), eager, compiled):
        assert torch.isfinite(a).all(), f"{backward} {name}: not finite"
        assert torch.equal(a, b), f"{backward} {name}: compiled differs from eager"


@pytest.mark.parametrize("backward", ["replay", "saved"])
def test_deterministic_mode_is_bitwise_the_default(backward):
    """Under torch.use_deterministic_algorithms(True) torch fills every tensor it allocates uninitialised with NaN
    (torch.utils.deterministic.fill_uninitialized_memory): a call that read memory no kernel wrote, or ran a torch
    op that mode refuses, would show it here. FLA's layer call with an initial state, the final state and both in the
    loss gives finite outputs and gradients, bitwise those of the default mode."""
    gen = rng("deterministic-mode")
    H, D, lens = 2, 128, [1, 0, 63, 64, 65, 700]
    T = sum(lens)
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    proj, raw, logits, a_log, dt_bias = fla_call_leaves(gen, T, H, D)
    h0 = (0.1 * torch.randn(len(lens), H, D, D, device="cuda", generator=gen)).requires_grad_()
    leaves = (proj, raw, logits, a_log, dt_bias, h0)

    def step():
        for x in leaves:
            x.grad = None
        q, k, v = (t.view(1, T, H, D) for t in proj.split(H * D, dim=-1))
        o, ht = chunk_kda(q, k, v, raw, logits, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                          A_log=a_log, dt_bias=dt_bias, backward=backward, use_qk_l2norm_in_kernel=True,
                          use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        (o.sum() + ht.sum()).backward()
        return [o.detach(), ht.detach()] + [x.grad.clone() for x in leaves]

    default = in_mode(step, False)
    deterministic = in_mode(step, True)
    for name, a, b in zip(("o", "ht", "dproj", "draw", "dlogits", "dA_log", "ddt_bias", "dh0"), deterministic, default):
        assert torch.isfinite(a).all(), f"{backward} {name}: not finite in deterministic mode"
        assert torch.equal(a, b), f"{backward} {name}: deterministic mode differs from the default"


@pytest.mark.parametrize("layout", ["contiguous", "doc_zigzag"])
def test_compiled_cp_step_on_one_gpu_is_bitwise_eager(tmp_path, layout):
    """The CP path on the kernels (a one-rank NCCL group: the plan is the single-device segmentation, the
    exchanges trivial) under torch.compile(fullgraph=True): PackedKDA's conv + halo + CP KDA, both modes,
    bitwise the eager step."""
    import datetime
    import torch.distributed as dist
    from kda_aot import cp
    assert not dist.is_initialized()
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for mode in ("replay", "saved"):
            torch._dynamo.reset()
            m, xs, g, beta, cu = _module_and_inputs(mode, ("cp-compile", layout, mode), lens=(700, 1, 64, 300))
            plan = cp.make_plan(cu, layout, group=dist.group.WORLD)

            def step(m, xs, g, beta, cu):
                o, _ = m(*xs, g, beta, plan=plan)
                return o.float().sum(), o
            eager = _run(step, m, xs, g, beta, cu)
            got = _run(torch.compile(step, fullgraph=True), m, xs, g, beta, cu)
            for a, b in zip(eager, got):
                assert torch.equal(a, b)
    finally:
        dist.destroy_process_group()


def test_module_on_a_pack_of_empty_documents():
    """T = 0 (every document padding): PackedKDA's convs and KDA run nothing and return empty outputs, the
    final state is the initial state, and the backward gives zero weight gradients."""
    m = PackedKDA(2, 128, conv_bias=True).cuda()
    xs = [torch.zeros(1, 0, 256, device="cuda", dtype=BF, requires_grad=True) for _ in range(3)]
    h0 = torch.randn(2, 2, 128, 128, device="cuda", requires_grad=True)
    o, s = m(*xs, torch.zeros(1, 0, 2, 128, device="cuda"), torch.zeros(1, 0, 2, device="cuda", dtype=BF),
             cu_seqlens=torch.tensor([0, 0, 0]), initial_state=h0, output_final_state=True)
    assert o.shape == (1, 0, 2, 128) and torch.equal(s, h0)
    s.sum().backward()
    assert torch.equal(h0.grad, torch.ones_like(h0)) and all(p.grad.abs().sum() == 0 for p in m.parameters())


def test_module_in_deterministic_mode_is_bitwise_the_default():
    """PackedKDA (its convs' workspaces, the norm, KDA with states) under torch.use_deterministic_algorithms(True),
    which fills every uninitialised allocation with NaN: finite and bitwise the default mode's step."""
    gen = rng("module-deterministic-mode")
    H, lens = 2, [300, 0, 129, 64]
    T = sum(lens)
    torch.manual_seed(seed_of("module-empty-docs"))
    m = PackedKDA(H, 128, conv_bias=True, backend="cuda").cuda()
    xs = [torch.randn(1, T, H * 128, device="cuda", generator=gen).to(BF).requires_grad_() for _ in range(3)]
    g = -5 * torch.rand(1, T, H, 128, device="cuda", generator=gen)
    beta = torch.rand(1, T, H, device="cuda", generator=gen).to(BF)
    h0 = (0.1 * torch.randn(len(lens), H, 128, 128, device="cuda", generator=gen)).requires_grad_()
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    leaves = [*xs, h0, *m.parameters()]

    def step():
        for t in leaves:
            t.grad = None
        o, s = m(*xs, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True)
        (o.float().sum() + s.sum()).backward()
        return [o.detach(), s.detach()] + [t.grad.clone() for t in leaves]

    default = in_mode(step, False)
    deterministic = in_mode(step, True)
    for i, (a, b) in enumerate(zip(deterministic, default)):
        assert torch.isfinite(a).all(), f"output {i}: not finite in deterministic mode"
        assert torch.equal(a, b), f"output {i}: deterministic mode differs from the default"
