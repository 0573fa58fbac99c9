"""FLA's causal conv1d (what its ShortConvolution runs in training: fla-core 0.6.0's causal_conv1d_fwd and
_bwd) dispatched to kda_aot's conv + SiLU kernels by `import kda_aot.fla`: bitwise kda_aot's own op on the same
inputs, and against the fp64 reference as accurate as FLA's Triton kernels on the same inputs in the same
process (FLA_KDA_AOT_CONV=0), to a tie's margin (below). Calls the kernels do not serve (no activation) still
run FLA's kernels.

Bounds: y and dx within the conv kernels' bf16 bound (tests/test_conv_gpu.py: 2^-8 of each element plus 1e-4 of
the largest); every output's relative RMS error at most 1.1x FLA's (both round the same fp32 sums to bf16: a
tie, which draws move by a few per cent) plus 1e-6 (the weight's bf16 gradient, rounded in both)."""
import pytest
import torch

from conftest import gpu, import_fla
from reftools import rel_rms
from test_conv_gpu import assert_bf16_close, rng
import kda_aot
from kda_aot import reference

pytestmark = gpu
TIE = 1.1


@pytest.fixture
def fla_conv(monkeypatch):
    """(FLA's ShortConvolution class, the kernel calls kda_aot's backend made) with the backend registered."""
    conv = import_fla("fla.modules.causal_conv1d")
    import kda_aot.fla as backend
    calls = []
    for name in ("conv1d_silu_fwd_op", "conv1d_silu_bwd_op"):
        def counted(*args, inner=getattr(backend, name), name=name):
            calls.append(name)
            return inner(*args)
        monkeypatch.setattr(backend, name, counted)
    monkeypatch.delenv("FLA_KDA_AOT", raising=False)
    monkeypatch.delenv("FLA_KDA_AOT_CONV", raising=False)
    return conv.ShortConvolution, calls


def run_layer(layer, x, dy, **kw):
    leaf = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y, final = layer(leaf, **kw)
    y.backward(dy)
    grads = {"y": y.detach(), "dx": leaf.grad}
    grads.update({n: p.grad for n, p in layer.named_parameters()})
    return grads, final


def reference_of(layer, x, dy, cu):
    """fp64 y and gradients of x, the weight and the bias (the layer's weight is [D, 1, 4])."""
    w = layer.weight.detach().double().squeeze(1).requires_grad_()
    b = None if layer.bias is None else layer.bias.detach().double().requires_grad_()
    leaf = x.detach().double().reshape(1, -1, x.shape[-1]).requires_grad_()
    y = reference.conv1d_silu(leaf, w, b, cu_seqlens=cu)
    y.backward(dy.double().reshape(y.shape))
    out = {"y": y.detach().reshape(x.shape), "dx": leaf.grad.reshape(x.shape), "weight": w.grad.unsqueeze(1)}
    if b is not None:
        out["bias"] = b.grad
    return out


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", ["packed", "batch"])
def test_short_convolution_runs_on_kda_aot(fla_conv, monkeypatch, bias, shape):
    ShortConvolution, calls = fla_conv
    gen = rng(("fla-conv", bias, shape))
    D = 384
    layer = ShortConvolution(hidden_size=D, kernel_size=4, bias=bias, activation="silu").cuda().to(torch.bfloat16)
    if shape == "packed":  # a padded pack: an empty document, one of a token, one across several chunks
        lens = [70, 0, 1, 300, 64]
        cu_cpu = torch.tensor([0] + lens).cumsum(0)
        kw, x_shape, seqs = {"cu_seqlens": cu_cpu.cuda().to(torch.int32)}, (1, sum(lens), D), cu_cpu
    else:  # FLA's [B, T, D] without cu_seqlens: B sequences
        kw, x_shape, seqs = {}, (3, 130, D), torch.arange(4) * 130
    x = (torch.randn(x_shape, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    dy = torch.randn(x_shape, device="cuda", generator=gen).to(torch.bfloat16)
    ours, _ = run_layer(layer, x, dy, **kw)
    assert calls == ["conv1d_silu_fwd_op", "conv1d_silu_bwd_op"], calls
    monkeypatch.setenv("FLA_KDA_AOT_CONV", "0")
    theirs, _ = run_layer(layer, x, dy, **kw)
    assert len(calls) == 2, "FLA_KDA_AOT_CONV=0 still called kda_aot"
    ref = reference_of(layer, x, dy, seqs)
    assert_bf16_close(ours["y"], ref["y"], "y")
    assert_bf16_close(ours["dx"], ref["dx"], "dx")
    for name, r in ref.items():
        e_ours, e_fla = rel_rms(ours[name], r), rel_rms(theirs[name], r)
        assert e_ours <= TIE * e_fla + 1e-6, f"{name}: kda_aot {e_ours:.3e} against FLA's {e_fla:.3e}"
    # bitwise kda_aot's own op on the same inputs
    leaf = x.detach().reshape(1, -1, D).clone().requires_grad_()
    w = layer.weight.detach().squeeze(1).clone().requires_grad_()
    b = None if layer.bias is None else layer.bias.detach().clone().requires_grad_()
    y = kda_aot.causal_conv1d_silu(leaf, w, b, cu_seqlens=seqs)
    y.backward(dy.reshape(y.shape))
    assert torch.equal(ours["y"], y.detach().reshape(x_shape)) and torch.equal(ours["dx"], leaf.grad.reshape(x_shape))
    assert torch.equal(ours["weight"], w.grad.unsqueeze(1))
    if b is not None:
        assert torch.equal(ours["bias"], b.grad)


def test_a_final_state_and_the_calls_it_declines(fla_conv, monkeypatch):
    """output_final_state: the kernels' y beside FLA's own final state (its layout); the backward then has a
    final-state gradient (autograd's zeros for the unused state), which FLA's kernels take. No activation: FLA's
    kernels (kda_aot's apply SiLU)."""
    ShortConvolution, calls = fla_conv
    gen = rng("fla-conv-state")
    D, lens = 256, [100, 37]
    cu = torch.tensor([0] + lens).cumsum(0).cuda()
    layer = ShortConvolution(hidden_size=D, kernel_size=4, activation="silu").cuda().to(torch.bfloat16)
    x = torch.randn(1, sum(lens), D, device="cuda", generator=gen).to(torch.bfloat16)
    dy = torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16)
    ours, ours_state = run_layer(layer, x, dy, cu_seqlens=cu, output_final_state=True)
    assert calls == ["conv1d_silu_fwd_op"], calls
    monkeypatch.setenv("FLA_KDA_AOT_CONV", "0")
    theirs, their_state = run_layer(layer, x, dy, cu_seqlens=cu, output_final_state=True)
    assert len(calls) == 1, "FLA_KDA_AOT_CONV=0 still called kda_aot"
    assert torch.equal(ours_state, their_state)
    # both round y to bf16 from fp32 sums of the same four products: they differ by at most one bf16 ulp (2^-8 to
    # 2^-7 of the value) where the roundings split, ~5.7e-3 relative RMS if every element split (simulated); 8e-3
    # holds that and fails at two ulps
    assert rel_rms(ours["y"], theirs["y"].double()) < 8e-3
    assert torch.equal(ours["dx"], theirs["dx"]) and torch.equal(ours["weight"], theirs["weight"])  # FLA's backward
    monkeypatch.delenv("FLA_KDA_AOT_CONV")
    plain = ShortConvolution(hidden_size=D, kernel_size=4, activation=None).cuda().to(torch.bfloat16)
    got, _ = run_layer(plain, x, dy, cu_seqlens=cu)
    assert len(calls) == 1 and torch.isfinite(got["y"]).all(), "a call without activation went to kda_aot"
