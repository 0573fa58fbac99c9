"""Tensors on a GPU other than the current one (a process that drives several GPUs from one thread, or a
model moved to cuda:1 without torch.cuda.set_device): every op launches on its tensors' device, gives the
bits it gives when that device is current, and leaves the current device as it found it. Needs two GPUs.

Each test runs the call with cuda:0 current first (so no launch on cuda:1 found anything set up there by an
earlier call), then with cuda:1 current, and compares bitwise. Autograd runs a CUDA backward on the thread of
the tensors' device, where that device is current, so the backward ops are also called directly here, on the
test's thread."""
import pytest
import torch

from conftest import HAS_GPU, gpu, seed_of
from kda_aot import chunk_kda
from kda_aot.nn import PackedKDA
from kda_aot.ops.chunk_kda_ops import SAVED
from kda_aot.schedule.kda import GATE_RAW, GATE_SOFTPLUS

pytestmark = [gpu, pytest.mark.skipif(not HAS_GPU or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]
BF = torch.bfloat16
LENS, H = [300, 0, 129, 64], 4
OPS = torch.ops.kda_aot


def _call_inputs(gen, gate_in_kernel):
    """CPU tensors (both arms move the same values): q, k, v, g, beta, h0, A_log, dt_bias, do, dht, cu."""
    T, N = sum(LENS), len(LENS)
    q, k, v = (torch.nn.functional.normalize(torch.randn(1, T, H, 128, generator=gen), dim=-1).to(BF) for _ in "qkv")
    if gate_in_kernel:
        g = 4 * torch.randn(1, T, H, 128, generator=gen)
        a_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * 128, generator=gen)
    else:
        g, a_log, dt_bias = -5 * torch.rand(1, T, H, 128, generator=gen), None, None
    beta = torch.rand(1, T, H, generator=gen).to(BF)
    h0 = 0.1 * torch.randn(N, H, 128, 128, generator=gen)
    do = torch.randn(1, T, H, 128, generator=gen).to(BF)
    dht = torch.randn(N, H, 128, 128, generator=gen)
    cu = torch.tensor([0, *LENS]).cumsum(0).to(torch.int32)
    return q, k, v, g, beta, h0, a_log, dt_bias, do, dht, cu


def _on_each_current_device(run):
    """run() with cuda:0 current, then with cuda:1 current; the current device must be left as it was."""
    with torch.cuda.device(0):
        got = run()
        torch.cuda.synchronize(1)
        assert torch.cuda.current_device() == 0
    with torch.cuda.device(1):
        want = run()
        torch.cuda.synchronize(1)
        assert torch.cuda.current_device() == 1
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.device == torch.device("cuda:1"), (i, a.device)
        assert torch.isfinite(a).all(), i
        assert torch.equal(a, b), f"output {i} differs from the call made with cuda:1 current"


@pytest.mark.parametrize("backward", ["replay", "saved"])
@pytest.mark.parametrize("gate_in_kernel", [False, True], ids=["log-decay", "gate-in-kernel"])
def test_ops_forward_and_backward_on_another_device(gen, backward, gate_in_kernel):
    """The custom ops themselves, forward then backward on this thread: chunk_kda's, the conv's, the norm's."""
    cpu = _call_inputs(gen, gate_in_kernel)
    kind = GATE_SOFTPLUS if gate_in_kernel else GATE_RAW
    w = torch.randn(H * 128, 4, generator=gen)
    bias = torch.randn(H * 128, generator=gen)

    def run():
        q, k, v, g, beta, h0, a_log, dt_bias, do, dht, cu = (None if x is None else x.to("cuda:1") for x in cpu)
        cu = cu.cpu()
        scale = 128 ** -0.5
        if backward == "saved":
            o, ht, *context = OPS.chunk_kda_fwd_saved(q, k, v, g, beta, h0, cu, scale, True, a_log, dt_bias, kind)
            assert len(context) == len(SAVED)
            grads = OPS.chunk_kda_bwd_saved(q, k, v, g, beta, h0, cu, scale, *context, do, dht, a_log, dt_bias, kind)
        else:
            o, ht, aqk, inv_pack = OPS.chunk_kda_fwd(q, k, v, g, beta, h0, cu, scale, True, a_log, dt_bias, kind,
                                                     keep=True)
            grads = OPS.chunk_kda_bwd(q, k, v, g, beta, h0, cu, scale, do, dht, a_log, dt_bias, kind,
                                      aqk=aqk, inv_pack=inv_pack)
        x = q.reshape(1, -1, H * 128)
        y = OPS.causal_conv1d_silu_fwd(x, w.to("cuda:1"), bias.to("cuda:1"), None, cu, "default")
        conv_grads = OPS.causal_conv1d_silu_bwd(x, w.to("cuda:1"), bias.to("cuda:1"), None, cu, y, "default", False)
        n, rstd = OPS.l2norm_fwd(k, 1e-6)
        dn = OPS.l2norm_bwd(k, rstd, do)
        return [o, ht, *(t for t in grads if t.numel()), y, *conv_grads[:3], n, rstd, dn]

    _on_each_current_device(run)


@pytest.mark.parametrize("backward", ["replay", "saved"])
@pytest.mark.parametrize("gate_in_kernel", [False, True], ids=["log-decay", "gate-in-kernel"])
def test_chunk_kda_on_another_device(gen, backward, gate_in_kernel):
    """The user's call with autograd: o, the final state and every gradient."""
    cpu = _call_inputs(gen, gate_in_kernel)

    def run():
        q, k, v, g, beta, h0, a_log, dt_bias, do, dht, cu = (None if x is None else x.to("cuda:1") for x in cpu)
        leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0, a_log, dt_bias) if x is not None]
        o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                          use_gate_in_kernel=gate_in_kernel, cu_seqlens=cu.cpu(), A_log=a_log, dt_bias=dt_bias,
                          backward=backward)
        ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
        return [o, ht, *(x.grad for x in leaves)]

    _on_each_current_device(run)


def test_packed_kda_module_on_another_device(gen):
    """PackedKDA (its convs, the q, k norm and chunk_kda) forward and backward."""
    T = sum(LENS)
    xs = [torch.randn(1, T, H * 128, generator=gen).to(BF) for _ in range(3)]
    g, beta = -5 * torch.rand(1, T, H, 128, generator=gen), torch.rand(1, T, H, generator=gen).to(BF)
    do, cu = torch.randn(1, T, H, 128, generator=gen).to(BF), torch.tensor([0, *LENS]).cumsum(0).to(torch.int32)
    seed = seed_of("module-on-another-device")  # the same weights on both devices

    def run():
        torch.manual_seed(seed)
        m = PackedKDA(H, 128, conv_bias=True, backend="cuda").to("cuda:1")
        leaves = [x.to("cuda:1").requires_grad_() for x in xs]
        o, _ = m(*leaves, g.to("cuda:1"), beta.to("cuda:1"), cu_seqlens=cu)
        o.backward(do.to("cuda:1"))
        return [o, *(x.grad for x in leaves), *(p.grad for p in m.parameters())]

    _on_each_current_device(run)
