"""The public ops as torch.library custom ops, traced without a GPU: their fake implementations (the
shapes, dtypes and strides torch.compile plans with), their registered autograd (a whole training step
traces into one graph, the backward ops included) and a strict export (dynamo: no graph break).

Nothing here runs a kernel: the tensors are fake (make_fx, torch.export), so the CPU checks what the
compiler sees; tests/test_ops_gpu.py runs the same steps on the GPU against eager and fp64.
"""
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode

import kda_aot
from kda_aot.ops.chunk_kda_ops import KEPT, SAVED, max_chunks
from kda_aot._runtime.packing import CHUNK, chunk_table

OPS = torch.ops.kda_aot
BF = torch.bfloat16


def kda_inputs(T=200, H=2, N=3, fused=True):
    """q, k, v as views of one fused projection (what a layer passes), g, beta, h0."""
    qkv = torch.randn(1, T, 3 * H, 128, dtype=BF)
    return qkv, -torch.rand(1, T, H, 128), torch.rand(1, T, H, dtype=BF), torch.randn(N, H, 128, 128)


def kda_ops_in(graph) -> list:
    return [str(n.target) for n in graph.nodes if n.op == "call_function" and "kda_aot" in str(n.target)]


@pytest.mark.parametrize("lens", [[5, 70, 3], [0, 64, 0, 0, 65, 1, 0], [130]])
def test_max_chunks_bounds_the_chunk_count(lens):
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    chunks, _ = chunk_table(cu)
    assert len(chunks) // 2 <= max_chunks(sum(lens), len(lens))


@pytest.mark.parametrize("mode", ["inference", "replay", "saved"])
@pytest.mark.parametrize("final", [False, True])
def test_forward_fakes_give_the_real_shapes(mode, final):
    T, H, N = 200, 2, 3
    saved = mode == "saved"
    with FakeTensorMode():
        q = torch.empty(1, T, H, 128, dtype=BF)
        g, beta = torch.empty(1, T, H, 128), torch.empty(1, T, H, dtype=BF)
        cu = torch.empty(N + 1, dtype=torch.int64)
        if saved:
            out = OPS.chunk_kda_fwd_saved(q, q, q, g, beta, None, cu, 0.1, final)
        else:
            out = OPS.chunk_kda_fwd(q, q, q, g, beta, None, cu, 0.1, final, keep=mode == "replay")
        o, fs = out[:2]
        assert o.shape == (1, T, H, 128) and o.dtype == BF and o.is_contiguous()
        assert fs.shape == ((N, H, 128, 128) if final else (0,)) and fs.dtype == torch.float32
        assert len(out) == 2 + (len(SAVED) if saved else len(KEPT))
        if not saved:  # what the replay reads from the forward, or two [0] without keep
            assert all(x.shape == ((1, T, H, 64) if mode == "replay" else (0,)) for x in out[2:])
        if saved:
            context = dict(zip(SAVED, out[2:]))
            rows = T // CHUNK + N
            assert context["gamma"].shape == (rows, H, 128) and context["tape"].shape == (rows, H, 128, 128)
            assert context["aqk"].shape == context["akk_inv"].shape == (1, T, H, 64)
            assert all(context[n].shape == (1, T, H, 128) and context[n].dtype == BF
                       for n in ("w", "u", "qg", "kg", "vnew"))


def test_backward_and_other_fakes_give_the_real_shapes():
    T, H, N, D = 100, 2, 3, 256
    with FakeTensorMode():
        q = torch.empty(1, T, H, 128, dtype=BF)
        g, beta, h0 = torch.empty(1, T, H, 128), torch.empty(1, T, H, dtype=BF), torch.empty(N, H, 128, 128)
        cu = torch.empty(N + 1, dtype=torch.int32)
        for state in (None, h0):
            dq, dk, dv, dg, dbeta, dh0, da_log, ddt_bias = OPS.chunk_kda_bwd(q, q, q, g, beta, state, cu, 0.1, q, None)
            assert dq.dtype == dv.dtype == BF and dg.dtype == torch.float32 and dbeta.dtype == BF
            assert dbeta.shape == (1, T, H) and dh0.shape == ((0,) if state is None else (N, H, 128, 128))
            assert da_log.shape == ddt_bias.shape == (0,)
        a_log, dt_bias = torch.empty(H), torch.empty(H, 128)  # the gate activated in the kernels
        *_, da_log, ddt_bias = OPS.chunk_kda_bwd(q, q, q, g, beta, None, cu, 0.1, q, None, a_log, dt_bias, 1, 0.0)
        assert da_log.shape == (H,) and ddt_bias.shape == (H, 128) and da_log.dtype == torch.float32
        x, w = torch.empty(1, T, D, dtype=BF), torch.empty(D, 4)
        y = OPS.causal_conv1d_silu_fwd(x, w, None, None, cu, "default")
        assert y.shape == x.shape and y.dtype == BF
        halo = torch.empty(N, 3, D, dtype=BF)
        dx, dw, db, dhalo = OPS.causal_conv1d_silu_bwd(x, w, w[:, 0], halo, cu, x, "default", True)
        assert dx.shape == x.shape and dw.shape == (D, 4) and db.shape == (D,) and dhalo.shape == halo.shape
        assert dhalo.dtype == BF and dw.dtype == torch.float32
        y, rstd = OPS.l2norm_fwd(q, 1e-6)
        assert y.shape == q.shape and rstd.shape == (1, T, H) and rstd.dtype == torch.float32


@pytest.mark.parametrize("backward", ["replay", "saved"])
@pytest.mark.parametrize("loss", ["sum", "o_only", "state_only"])
def test_training_step_traces_with_the_backward_ops(backward, loss):
    """A step as training code writes it (views of one projection, q/k normalised in the op, a plain
    .sum() loss: expanded incoming gradients, or none for an unused output) traces into one graph
    with the forward and backward ops, and every gradient has its input's shape and dtype."""
    H = 2

    def step(qkv, g, beta, h0, cu):
        q, k, v = qkv.split(H, dim=2)
        o, s = kda_aot.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, backward=backward)
        total = {"sum": o.float().sum() + s.sum(), "o_only": o.float().sum(), "state_only": s.sum()}[loss]
        return torch.autograd.grad(total, (qkv, g, beta, h0))

    qkv, g, beta, h0 = kda_inputs(H=H)
    for t in (qkv, g, beta, h0):
        t.requires_grad_()
    cu = torch.tensor([0, 0, 70, 200])
    gm = make_fx(step, tracing_mode="fake")(qkv, g, beta, h0, cu)
    ops = kda_ops_in(gm.graph)
    fwd, bwd = ("kda_aot.chunk_kda_fwd_saved", "kda_aot.chunk_kda_bwd_saved") if backward == "saved" else \
        ("kda_aot.chunk_kda_fwd", "kda_aot.chunk_kda_bwd")
    assert f"{fwd}.default" in ops and f"{bwd}.default" in ops and ops.count("kda_aot.l2norm_bwd.default") == 2
    outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    for got, want in zip(outs, (qkv, g, beta, h0)):
        meta = got.meta["val"]
        assert meta.shape == want.shape and meta.dtype == want.dtype


def test_packed_module_exports_in_one_graph():
    """PackedKDA on the kernels (conv + fused norm, KDA) exported by dynamo in strict mode: one graph,
    no break, the custom ops in it."""
    H, T = 2, 130
    m = kda_aot.nn.PackedKDA(H, 128, conv_bias=True, backend="cuda")

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, q, k, v, g, beta, cu):
            return self.m(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)

    x = [torch.randn(1, T, H * 128, dtype=BF) for _ in range(3)]
    ep = torch.export.export(Step(), (*x, -torch.rand(1, T, H, 128), torch.rand(1, T, H, dtype=BF),
                                      torch.tensor([0, 5, 5, T])), strict=True)
    ops = kda_ops_in(ep.graph)
    assert ops.count("kda_aot.causal_conv1d_silu_fwd.default") == 3 and "kda_aot.chunk_kda_fwd.default" in ops


def test_auto_backend_without_a_gpu_is_the_reference():
    from kda_aot.nn import resolve_backend
    x = torch.zeros(1)
    assert resolve_backend("auto", x) == "reference" and resolve_backend("cuda", x) == "cuda"
    assert kda_aot.nn.PackedKDA(1, 8).backend == "auto"
    from kda_aot.cp import get_backend
    assert get_backend("auto", like=x).name == "reference"


def test_auto_backend_takes_the_reference_for_another_head_dim(monkeypatch):
    """On a GPU the kernels serve, "auto" still runs a head dim other than 128 on the reference, for PackedKDA
    and the CP ops alike (registry.auto_backend decides for both; "cuda" asked for explicitly refuses it)."""
    from kda_aot._runtime import registry
    from kda_aot.cp import get_backend
    from kda_aot.nn import resolve_backend
    monkeypatch.setattr(registry, "serves", lambda device: True)  # a served GPU, for tensors on any device
    x = torch.zeros(1, dtype=torch.bfloat16)
    assert resolve_backend("auto", x, 128) == "cuda" and resolve_backend("auto", x, 64) == "reference"
    assert resolve_backend("cuda", x, 64) == "cuda"
    assert registry.auto_backend(x) == "cuda" and registry.auto_backend(x.float()) == "reference"
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)  # the CP ops' q: heads of 64
    assert get_backend("auto", like=q).name == "reference"


def test_auto_backend_says_why_a_gpu_tensor_runs_on_the_reference(monkeypatch):
    """A CUDA tensor that "auto" sends to the reference (fp32 torch math) warns with the reason; a served bf16 one and
    a CPU one do not. (Fake CUDA tensors: no GPU needed.)"""
    from kda_aot._runtime import registry
    with FakeTensorMode():
        x32 = torch.empty(2, device="cuda")
        x16 = torch.empty(2, device="cuda", dtype=BF)
    monkeypatch.setattr(registry, "serves", lambda device: True)
    with pytest.warns(UserWarning, match=r"runs kda_aot.reference .* on cuda:0: float32 inputs \(the kernels take "
                                         r"bfloat16: cast them or run under torch.autocast\)"):
        assert registry.auto_backend(x32) == "reference"
    with pytest.warns(UserWarning, match=r"on cuda:0: head_dim 64 \(the kernels' is 128\)"):
        assert registry.auto_backend(x16, 64) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.auto_backend(x16) == "cuda"
        assert registry.auto_backend(torch.zeros(2)) == "reference"
    monkeypatch.undo()
    # traced (the CP ops choose under torch.compile): no manifest read for a tensor that gets no warning
    picked = torch.compile(lambda x: x + (1 if registry.auto_backend(x) == "reference" else 2), fullgraph=True,
                           backend="eager")(torch.zeros(2, dtype=BF))
    assert torch.equal(picked, torch.ones(2, dtype=BF))


def test_fla_layer_call_traces_into_one_graph():
    """FLA's layer call (gate and beta activations, GVA, V-first states, l2norm in the op) traces with the
    forward and backward ops; every gradient (raw g, A_log, dt_bias, beta logits, the V-first state) has
    its input's shape and dtype."""
    H, HV, T = 2, 4, 130

    def step(q, k, v, g, b, h0, A_log, dt_bias, cu):
        o, s = kda_aot.chunk_kda(q, k, v, g, b, None, h0, True, True, True, True, cu_seqlens=cu, state_v_first=True,
                                 A_log=A_log, dt_bias=dt_bias)
        return torch.autograd.grad(o.float().sum() + s.sum(), (q, k, v, g, b, h0, A_log, dt_bias))

    ins = [torch.randn(1, T, H, 128, dtype=BF), torch.randn(1, T, H, 128, dtype=BF),
           torch.randn(1, T, HV, 128, dtype=BF), torch.randn(1, T, HV, 128, dtype=BF),
           torch.randn(1, T, HV, dtype=BF), torch.randn(2, HV, 128, 128), torch.rand(HV), torch.randn(HV * 128)]
    for t in ins:
        t.requires_grad_()
    gm = make_fx(step, tracing_mode="fake")(*ins, torch.tensor([0, 70, T]))
    ops = kda_ops_in(gm.graph)
    assert "kda_aot.chunk_kda_fwd.default" in ops and "kda_aot.chunk_kda_bwd.default" in ops
    outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    for got, want in zip(outs, ins):
        meta = got.meta["val"]
        assert meta.shape == want.shape and meta.dtype == want.dtype


def test_a_device_cu_seqlens_is_copied_to_the_host_once_per_tensor_and_version():
    """host_copy: the same device tensor gives the same CPU copy (no second sync); written in place, or another
    tensor, a new copy; a CPU tensor is its own copy. (A fake CUDA tensor stands for a real one.)"""
    import gc

    from kda_aot._runtime.packing import _HOST_COPIES, host_copy
    with FakeTensorMode():
        cu = torch.tensor([0, 64, 100], dtype=torch.int32, device="cuda")
        first = host_copy(cu)
        assert first.device.type == "cpu" and host_copy(cu) is first
        cu.add_(0)  # a new version: its values may have changed
        second = host_copy(cu)
        assert second is not first and host_copy(cu) is second
        other = torch.tensor([0, 64, 100], dtype=torch.int32, device="cuda")
        assert host_copy(other) is not second
        entries = len(_HOST_COPIES)
        del cu, other
        gc.collect()
        assert len(_HOST_COPIES) == entries - 2  # an entry goes with its tensor
    on_cpu = torch.tensor([0, 3])
    assert host_copy(on_cpu) is on_cpu
