"""chunk_kda_cp, conv1d_silu_cp and PackedKDA's CP path in this process: the errors a call gets before any
collective (no process group, no GPU for backend="cuda", a bad backward mode) and, on a one-rank gloo group (W = 1:
the plan is the single-device segmentation), the module's conv biases, the lifetime of the CP contexts and
torch.compile over changing plans. The multi-rank cases (spawned gloo worlds) are tests/test_cp_gloo.py."""
import pytest
import torch

from kda_aot import cp
from kda_aot.nn import PackedKDA

from conftest import generator
from reftools import rel_err

REL_BOUND = 1e-4  # fp32 CP against the fp32 single device (tests/test_cp_gloo.py's bound and its reasons)


def test_not_initialised_is_a_clear_error():
    import torch.distributed as dist
    assert not dist.is_initialized()
    plan = cp.make_plan([0, 8], "contiguous", world_size=2, rank=0)
    q = torch.randn(1, 4, 1, 4)
    with pytest.raises(RuntimeError, match="not initialised"):
        cp.chunk_kda_cp(q, q, q, -q.abs(), torch.rand(1, 4, 1), plan=plan)
    with pytest.raises(RuntimeError, match="not initialised"):
        cp.conv_halo(torch.randn(1, 4, 8), plan)
    with pytest.raises(RuntimeError, match="not initialised"):
        cp.make_plan([0, 8], "contiguous", group=object())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a GPU-less machine shows")
def test_cuda_backend_needs_a_gpu():
    plan = cp.make_plan([0, 8], "contiguous", world_size=1, rank=0)
    q = torch.randn(1, 8, 1, 4)
    with pytest.raises(RuntimeError, match="backend='cuda' needs a CUDA GPU"):
        cp.chunk_kda_cp(q, q, q, -q.abs(), torch.rand(1, 8, 1), plan=plan, backend="cuda")


def test_backward_mode_is_checked():
    plan = cp.make_plan([0, 8], "contiguous", world_size=1, rank=0)
    q = torch.randn(1, 8, 1, 4)
    with pytest.raises(ValueError, match="backward must be one of"):
        cp.chunk_kda_cp(q, q, q, -q.abs(), torch.rand(1, 8, 1), plan=plan, backward="x")


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo group in this process (W = 1: the plan is the single-device segmentation)."""
    import datetime
    import torch.distributed as dist
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield dist.group.WORLD
    dist.destroy_process_group()


def _small(T=100, H=2, D=16, seed=0):
    gen = generator(("small", T, H, D, seed))
    q, k, v = (torch.randn(1, T, H * D, generator=gen, requires_grad=True) for _ in range(3))
    return q, k, v, -torch.rand(1, T, H, D, generator=gen), torch.rand(1, T, H, generator=gen)


def test_module_without_conv_bias_and_mixed_biases_train_under_cp(one_rank):
    """PackedKDA's default (conv_bias=False) and a conv call with one bias missing: their CP backward runs
    and matches the single-device path."""
    from kda_aot.cp import keys
    cu = [0, 30, 100]
    plan = cp.make_plan(cu, "contiguous", group=one_rank)
    m = PackedKDA(2, 16)
    q, k, v, g, beta = _small()
    m(q, k, v, g, beta, plan=plan)[0].sum().backward()
    cp_grads = [t.grad.clone() for t in (q, k, v)] + [p.grad.clone() for p in m.parameters()]
    for t in (q, k, v, *m.parameters()):
        t.grad = None
    m(q, k, v, g, beta, cu_seqlens=cu)[0].sum().backward()
    for a, b in zip(cp_grads, [t.grad for t in (q, k, v)] + [p.grad for p in m.parameters()]):
        assert rel_err(a, b) < REL_BOUND
    x1, x2 = (torch.randn(1, 100, 8, requires_grad=True) for _ in range(2))
    w1, w2, b1 = (torch.randn(8, 4, requires_grad=True), torch.randn(8, 4, requires_grad=True),
                  torch.randn(8, requires_grad=True))
    ys = cp.conv1d_silu_cp([x1, x2], [w1, w2], [b1, None], plan=plan)
    (ys[0].sum() + ys[1].sum()).backward()
    assert b1.grad is not None and w2.grad is not None and x2.grad is not None
    assert not keys._CONTEXTS


def test_contexts_live_as_long_as_the_graph(one_rank):
    """No context outlives its graph (a forward whose backward never runs, saved mode included); a
    saved-tensor hook that copies (activation offload) keeps it; a second backward in saved mode is a clear
    error; conv_halo's backward runs after its plan is dropped."""
    from kda_aot.cp import keys
    plan = cp.make_plan([0, 40, 100], "zigzag", group=one_rank)
    q, k, v, g, beta = (torch.randn(1, 100, 2, 8, requires_grad=True) for _ in range(5))
    g, beta = -g.detach().abs().requires_grad_(), beta.detach()[..., 0].sigmoid().requires_grad_()
    for mode in ("replay", "saved"):
        o, _ = cp.chunk_kda_cp(q, k, v, g, beta, plan=plan, backward=mode)
        del o
        assert not keys._CONTEXTS, mode
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        o, s = cp.chunk_kda_cp(q, k, v, g, beta, plan=plan, output_final_state=True, backward="saved")
    (o.sum() + s.sum()).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="saved context went with the first backward"):
        (o.sum() + s.sum()).backward()
    del o, s
    xh = torch.randn(1, 100, 8, requires_grad=True)
    halo = cp.conv_halo(xh, cp.make_plan([0, 40, 100], "zigzag", group=one_rank))
    halo.sum().backward()
    assert xh.grad is not None and not keys._CONTEXTS


def test_compiled_cp_step_serves_every_plan_and_ignores_autocast(one_rank):
    """torch.compile traces one graph for plans of the same document count (each step may bring a new
    pack: the plan is a tensor to the ops); the ops run with autocast off (eager and compiled agree)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    def step(q, k, v, g, beta, plan):
        o, s = cp.chunk_kda_cp(q, k, v, g, beta, plan=plan, output_final_state=True)
        return o.sum() + s.sum()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    gen = generator("compiled")
    xs = [torch.randn(1, 100, 2, 8, generator=gen) for _ in range(5)]
    xs[3], xs[4] = -xs[3].abs(), xs[4][..., 0].sigmoid()
    for cut in (10, 40, 70, 90):
        plan = cp.make_plan([0, cut, 100], "contiguous", group=one_rank)
        leaves = [x.clone().requires_grad_() for x in xs]
        compiled(*leaves, plan).backward()
        want = [x.clone().requires_grad_() for x in xs]
        step(*want, plan).backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, want))
    assert counters["stats"]["unique_graphs"] == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = cp.make_plan([0, 50, 100], "contiguous", group=one_rank)
        a = cp.chunk_kda_cp(*xs, plan=plan)[0]
    assert torch.equal(a, cp.chunk_kda_cp(*xs, plan=plan)[0])
