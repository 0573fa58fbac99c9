"""The per-head L2 norm kernels (kda_aot.ops.norm) against the fp64 formula, and their bad-input errors.

Bounds: y and dx are rounded to bf16 once after fp32 arithmetic on exact bf16 inputs (a 128-term
fp32 sum, relative error ~1e-6), so their relative RMS error is the bf16 rounding, ~2^-9 / sqrt(3)
≈ 1.1e-3 for y; dx = rstd (dy - y <dy, y>) loses at most a few bits more to the cancellation of
its two terms: bound 4e-3 for both. Outputs poisoned before each run.
"""
import pytest
import torch

from conftest import HAS_GPU, gpu
from reftools import rel_rms
from kda_aot import reference
from kda_aot.ops.norm import l2norm, l2norm_backward, l2norm_forward

DEV = "cuda" if HAS_GPU else "cpu"


def fp64_norm(x, dy):
    x64 = x.double().requires_grad_()
    y = reference.l2norm(x64)
    y.backward(dy.double())
    return y.detach(), x64.grad


@gpu
@pytest.mark.parametrize("shape", [(1, 1, 1, 128), (1, 1000, 3, 128), (1, 4097, 32, 128), (7, 128)])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_matches_fp64(shape, scale):
    from test_kda_fwd_gpu import rng
    gen = rng(("l2norm", shape, scale))
    x = (scale * torch.randn(shape, device="cuda", generator=gen)).to(torch.bfloat16)
    dy = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
    y, rstd = l2norm_forward(x, out={"y": torch.full_like(x, float("nan")),
                                     "rstd": torch.full(shape[:-1], float("nan"), device="cuda")})
    dx = l2norm_backward(x, rstd, dy, out=torch.full_like(x, float("nan")))
    want_y, want_dx = fp64_norm(x, dy)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    ey, edx = rel_rms(y, want_y), rel_rms(dx, want_dx)
    print(f"{shape} scale {scale}: y {ey:.2e} dx {edx:.2e}")
    assert ey < 4e-3 and edx < 4e-3
    want_rstd = torch.rsqrt((x.double() ** 2).sum(-1) + reference.L2NORM_EPS)
    assert rel_rms(rstd, want_rstd) < 1e-6


@gpu
def test_autograd_and_determinism():
    from test_kda_fwd_gpu import rng
    gen = rng("l2norm-autograd")
    x = torch.randn(1, 3000, 4, 128, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(1, 3000, 4, 128, device="cuda", generator=gen).to(torch.bfloat16)
    y = l2norm(x)
    y.backward(dy)
    g1 = x.grad.clone()
    x.grad = None
    y2 = l2norm(x)
    y2.backward(dy)
    assert torch.equal(y, y2) and torch.equal(g1, x.grad)
    _, want = fp64_norm(x.detach(), dy)
    assert rel_rms(g1, want) < 4e-3


@gpu
def test_zero_and_non_finite_rows():
    x = torch.zeros(3, 128, device="cuda", dtype=torch.bfloat16)
    x[1, 5] = float("inf")
    x[2, 7] = float("nan")
    y, _ = l2norm_forward(x)
    assert (y[0] == 0).all()                      # eps keeps a zero row finite, as FLA
    assert not torch.isfinite(y[1]).all() and not torch.isfinite(y[2]).all()


def test_bad_input_is_refused_before_any_kernel():
    x = torch.randn(2, 128, device=DEV).to(torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        l2norm(x.float())
    with pytest.raises(ValueError, match=r"\[\.\.\., 128\]"):
        l2norm(torch.randn(2, 64, device=DEV).to(torch.bfloat16))
    with pytest.raises(ValueError, match="eps"):
        l2norm(x, eps=0.0)
    with pytest.raises(TypeError, match="eps: expected a number, got str"):
        l2norm(x, eps="a")
    with pytest.raises(TypeError, match="torch.Tensor"):
        l2norm([1.0] * 128)
    if not HAS_GPU:
        # (compiled, chunk_kda's call with use_qk_l2norm_in_kernel meets this refusal first: it names that call's form)
        with pytest.raises(ValueError, match=r"x: l2norm runs its kernels on a CUDA GPU.*kda_aot.reference.l2norm is .*"
                                             r"use_qk_l2norm_in_kernel=True: kda_aot.reference.kda_chunked on"):
            l2norm(x)


@gpu
def test_binding_checks_descriptors():
    x = torch.randn(4, 128, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="rstd"):
        l2norm_forward(x, out={"rstd": torch.empty(5, device="cuda")})
    with pytest.raises(ValueError, match="contiguous"):
        l2norm_backward(x, torch.ones(4, device="cuda"), torch.randn(128, 4, device="cuda").to(torch.bfloat16).t())
