"""CUDA-graph capture of a whole single-device B3 step (PackedKDA forward + replay backward) and
its replays: bitwise equal to the eager step (every kernel is deterministic; CPU cu_seqlens, so the
step makes no host sync; one eager step warms the pack tables and the head-group decision)."""
import pytest
import torch

from conftest import gpu, seed_of
from kda_aot.nn import PackedKDA
from test_kda_fwd_gpu import rng

pytestmark = gpu


PACK, PIECED = [700, 1, 64, 300], [3000, 2200]


@pytest.mark.parametrize("mode,plan,pipeline,lens", [
    ("replay", None, "0", PACK), ("saved", None, "0", PACK),
    ("replay", (("split", 0, 1), ("full", 1, 3), ("split", 3, 4)), "0", PACK),
    ("saved", None, "1", PACK), ("replay", None, "1", PACK),
    ("saved", None, "1", PIECED), ("replay", None, "1", PIECED)],
    ids=["replay", "saved", "replay-mixed-walks", "saved-pipelined", "replay-pipelined", "saved-pieces",
         "replay-pieces"])
def test_b3_step_captures_and_replays_bitwise(monkeypatch, kda_options, mode, plan, pipeline, lens):
    """plan: a mixed walk plan (launches forked onto side streams and joined) forced on every walk;
    pipeline: the pipelined forward and replay (Options.pipeline), the groups' walks on side streams;
    PIECED: the last group's chain walked in pieces (the handoff buffers, the replay's walks from both ends)."""
    from kda_aot.schedule import fit, grouping
    kda_options(pipeline=pipeline == "1")
    if plan is not None:
        monkeypatch.setattr(fit, "plan_walk", lambda *args, **kw: plan)
    if lens is PIECED:
        assert grouping.last_group_pieces(tuple((n + 63) // 64 for n in lens)) is not None
    H = 4
    T, D = sum(lens), H * 128
    gen = rng(("graph", mode, plan, len(lens)))
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)          # on the CPU
    torch.manual_seed(seed_of(("graph-module", mode, plan, len(lens))))
    m = PackedKDA(H, 128, conv_bias=True, backend="cuda", backward=mode).cuda()
    xs = [torch.randn(1, T, D, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(3)]
    g = -5 * torch.rand(1, T, H, 128, device="cuda", generator=gen)
    beta = torch.rand(1, T, H, device="cuda", generator=gen).to(torch.bfloat16)
    do = torch.randn(1, T, H, 128, device="cuda", generator=gen).to(torch.bfloat16)
    params = list(m.parameters())

    def step():
        for t in xs + params:
            t.grad = None
        o, _ = m(*xs, g, beta, cu_seqlens=cu)
        o.backward(do)
        return o

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):          # warm-up on a side stream, as torch.cuda.graphs asks
        o_eager = step().detach().clone()
        eager = [t.grad.clone() for t in xs + params]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in xs + params:
        t.grad = None
    with torch.cuda.graph(graph):
        o_static = step()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o_static, o_eager)
        for t, want in zip(xs + params, eager):
            assert torch.equal(t.grad, want)
