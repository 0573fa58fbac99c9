"""Tensors on a GPU other than the current one (a process that drives several GPUs from one thread, or a
model moved to cuda:1 without torch.cuda.set_device): every op launches on its tensors' device, gives the
bits it gives when that device is current, and leaves the current device as it found it. Needs two GPUs."""
import pytest
import torch

from conftest import HAS_GPU
from kda_aot import chunk_kda
from kda_aot.nn import PackedKDA

pytestmark = pytest.mark.skipif(not HAS_GPU or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
BF = torch.bfloat16
LENS, H = [300, 0, 129, 64], 4


def _call_inputs(gen, gate_in_kernel):
    """CPU tensors (both arms move the same values): q, k, v, g, beta, h0, A_log, dt_bias, do, dht, cu."""
    T, N = sum(LENS), len(LENS)
    q, k, v = (torch.randn(1, T, H, 128, generator=gen).to(BF) for _ in "qkv")
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


def _chunk_kda_step(cpu, device, backward, gate_in_kernel):
    """o, the final state and every gradient of one chunk_kda call on `device`."""
    q, k, v, g, beta, h0, a_log, dt_bias, do, dht, cu = (None if x is None else x.to(device) for x in cpu)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0, a_log, dt_bias) if x is not None]
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                      use_gate_in_kernel=gate_in_kernel, cu_seqlens=cu.cpu(), A_log=a_log, dt_bias=dt_bias,
                      backward=backward)
    ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
    torch.cuda.synchronize(device)
    return [o, ht, *(x.grad for x in leaves)]


def _assert_bitwise_on(got, want, device):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.device == torch.device(device), (i, a.device)
        assert torch.isfinite(a).all(), i
        assert torch.equal(a, b), f"output {i} differs from the call made with {device} current"


@pytest.mark.parametrize("backward", ["replay", "saved"])
@pytest.mark.parametrize("gate_in_kernel", [False, True], ids=["log-decay", "gate-in-kernel"])
def test_chunk_kda_on_another_device(gen, backward, gate_in_kernel):
    cpu = _call_inputs(gen, gate_in_kernel)
    with torch.cuda.device(1):
        want = _chunk_kda_step(cpu, "cuda:1", backward, gate_in_kernel)
    with torch.cuda.device(0):
        got = _chunk_kda_step(cpu, "cuda:1", backward, gate_in_kernel)
        assert torch.cuda.current_device() == 0
    _assert_bitwise_on(got, want, "cuda:1")


def _module_step(cpu, device):
    """PackedKDA (its convs, the q, k norm and chunk_kda) forward and backward on `device`."""
    xs, g, beta, do, cu = cpu
    torch.manual_seed(11)
    m = PackedKDA(H, 128, conv_bias=True, backend="cuda").to(device)
    xs = [x.to(device).requires_grad_() for x in xs]
    o, _ = m(*xs, g.to(device), beta.to(device), cu_seqlens=cu)
    o.backward(do.to(device))
    torch.cuda.synchronize(device)
    return [o, *(x.grad for x in xs), *(p.grad for p in m.parameters())]


def test_packed_kda_module_on_another_device(gen):
    T = sum(LENS)
    xs = [torch.randn(1, T, H * 128, generator=gen).to(BF) for _ in range(3)]
    cpu = (xs, -5 * torch.rand(1, T, H, 128, generator=gen), torch.rand(1, T, H, generator=gen).to(BF),
           torch.randn(1, T, H, 128, generator=gen).to(BF), torch.tensor([0, *LENS]).cumsum(0).to(torch.int32))
    with torch.cuda.device(1):
        want = _module_step(cpu, "cuda:1")
    with torch.cuda.device(0):
        got = _module_step(cpu, "cuda:1")
        assert torch.cuda.current_device() == 0
    _assert_bitwise_on(got, want, "cuda:1")
