"""causal_conv1d_silu kernels on the GPU against the fp64 reference, bitwise form and run checks.

Error bounds (elementwise, inputs are exact bf16/fp32 so the only errors are ours):
- y and dx are bf16: round-to-nearest costs at most 2^-8 of |ref|; the fp32 work before it
  (4 FMAs, expf, silu') adds ~1e-6 relative to the summands, covered by 1e-4 * max|ref|.
- dweight, dbias, dhalo are fp32 sums of up to T products: norm-wise 1e-4 (a sequential fp32 sum
  over n terms errs by at most ~n * 2^-24 relative; n <= 1024 per partial chain here).
Outputs are poisoned with NaN first: an unwritten element fails every bound.
"""

import pytest
import torch

from conftest import SEED, gpu
from reftools import rel_rms
from kda_aot import causal_conv1d_silu, reference
from kda_aot._runtime import registry
from kda_aot.ops.conv import conv1d_silu_backward, conv1d_silu_forward
from test_kda_fwd_gpu import require_form, rng

pytestmark = gpu
BF16_REL = 2.0 ** -8


def pack(lens, D, gen, *, halo=False, cu_dtype=torch.int32, bias=True):
    T = sum(lens)
    x = torch.randn(1, T, D, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(D, 4, device="cuda", generator=gen) * 0.5
    b = torch.randn(D, device="cuda", generator=gen) * 0.5 if bias else None
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(cu_dtype)
    h = torch.randn(len(lens), 3, D, device="cuda", generator=gen).to(torch.bfloat16) if halo else None
    dy = torch.randn(1, T, D, device="cuda", generator=gen).to(torch.bfloat16)
    return x, w, b, cu, h, dy


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def run_kernels(x, w, b, cu, h, dy, fwd_form="default", bwd_form="default"):
    N, D = cu.numel() - 1, x.shape[2]
    y = conv1d_silu_forward(x, w, b, cu, h, out=poisoned(x.shape, torch.bfloat16), form=fwd_form)
    out = {"dx": poisoned(x.shape, torch.bfloat16), "dweight": poisoned((D, 4), torch.float32)}
    if b is not None:
        out["dbias"] = poisoned((D,), torch.float32)
    if h is not None:
        out["dhalo"] = poisoned((N, 3, D), torch.float32)
    dx, dw, db, dh = conv1d_silu_backward(x, w, b, cu, dy, h, need_dhalo=h is not None, out=out, form=bwd_form)
    return y, dx, dw, db, dh


def reference_grads(x, w, b, cu, h, dy):
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b, h)]
    y = reference.conv1d_silu(leaves[0], leaves[1], leaves[2], cu_seqlens=cu.cpu(), halo=leaves[3])
    y.backward(dy.double())
    return (y.detach(),) + tuple(None if t is None else t.grad for t in leaves)


def assert_bf16_close(got, ref, what):
    assert torch.isfinite(got).all(), f"{what}: unwritten or non-finite elements"
    err = (got.double() - ref).abs()
    bound = BF16_REL * ref.abs() + 1e-4 * ref.abs().max()
    bad = err > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} elements out of bound, worst err {err.max().item():.3e} (seed {SEED})"


def assert_f32_close(got, ref, what, rel=1e-4):
    assert torch.isfinite(got).all(), f"{what}: unwritten or non-finite elements"
    e = rel_rms(got, ref)
    assert e < rel, f"{what}: relative error {e:.3e} (seed {SEED})"


def check_against_reference(x, w, b, cu, h, dy):
    """Every output of the forward and backward kernels within the bounds above; none unwritten."""
    y, dx, dw, db, dh = run_kernels(x, w, b, cu, h, dy)
    ry, rdx, rdw, rdb, rdh = reference_grads(x, w, b, cu, h, dy)
    assert_bf16_close(y, ry, "y")
    assert_bf16_close(dx, rdx, "dx")
    assert_f32_close(dw, rdw, "dweight")
    if b is None:
        assert db is None
    else:
        assert_f32_close(db, rdb, "dbias")
    if h is not None:
        assert_f32_close(dh, rdh, "dhalo")


PACKS = {
    "tiny": [1, 2, 3, 4],
    "edges": [63, 64, 65, 1, 2, 3, 4, 130],
    "long": [1, 2, 3, 4, 63, 64, 65, 2000, 3001, 1],
    "one_doc": [4099],
}


@pytest.mark.parametrize("name", list(PACKS))
@pytest.mark.parametrize("D", [128, 136, 1024])
@pytest.mark.parametrize("halo", [False, True])
def test_matches_reference(name, D, halo):
    check_against_reference(*pack(PACKS[name], D, rng((name, D, halo)), halo=halo))


@pytest.mark.parametrize("D", [3 * 32 * 128, 12288])
def test_wide_channels(D):
    check_against_reference(*pack([1, 63, 64, 65, 700, 1], D, rng(("wide", D)), halo=True, cu_dtype=torch.int64))


def test_no_bias_int64_cu():
    check_against_reference(*pack(PACKS["edges"], 256, rng("nobias"), bias=False, cu_dtype=torch.int64))


def variant_forms(program):
    """The test-only tilings of the plain conv (the l2norm forms compute something else: tested below)."""
    return [r["form"] for r in registry.records()
            if r["program"] == program and r["form"] != "default" and not r["form"].startswith("l2norm")]


@pytest.mark.parametrize("fwd_form,bwd_form", [(f, "default") for f in variant_forms("conv1d_silu_fwd")] +
                         [("default", b) for b in variant_forms("conv1d_silu_bwd")])
@pytest.mark.parametrize("halo", [False, True])
def test_variant_forms_are_bitwise_equal(fwd_form, bwd_form, halo):
    """Other tilings (test-only records; short_tiles puts an edge every 5 tokens) change nothing but
    the dweight/dbias summation order. A test-only record that is not built fails here, by design."""
    x, w, b, cu, h, dy = pack(PACKS["long"], 128, rng(("tiles", halo)), halo=halo)
    a = run_kernels(x, w, b, cu, h, dy)
    s = run_kernels(x, w, b, cu, h, dy, fwd_form, bwd_form)
    assert torch.equal(a[0], s[0]) and torch.equal(a[1], s[1])
    if halo:
        assert torch.equal(a[4], s[4])
    assert_f32_close(s[2], a[2].double(), "dweight", rel=1e-5)
    assert_f32_close(s[3], a[3].double(), "dbias", rel=1e-5)


def reference_norm_grads(x, w, b, cu, h, dy):
    """fp64 conv, then the per-head L2 norm (reference.l2norm), and their gradients."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b, h)]
    y = reference.conv1d_silu(leaves[0], leaves[1], leaves[2], cu_seqlens=cu.cpu(), halo=leaves[3])
    heads = y.view(*y.shape[:-1], -1, 128)
    yn = reference.l2norm(heads).view_as(y)
    yn.backward(dy.double())
    return (yn.detach(),) + tuple(None if t is None else t.grad for t in leaves)


@pytest.mark.parametrize("name", ["tiny", "edges", "long"])
@pytest.mark.parametrize("D", [128, 1024, 4096])
@pytest.mark.parametrize("halo", [False, True])
def test_l2norm_form_matches_reference(name, D, halo):
    """The l2norm forms (conv + SiLU + per-head L2 norm in one pass, both ways) against the fp64 conv
    followed by the fp64 norm: y and dx within the bf16 bound above (the norm's sums are fp32 before
    the one rounding), dweight, dbias, dhalo within 1e-4; outputs poisoned, as everywhere here."""
    x, w, b, cu, h, dy = pack(PACKS[name], D, rng(("l2norm", name, D, halo)), halo=halo)
    y, dx, dw, db, dh = run_kernels(x, w, b, cu, h, dy, "l2norm", "l2norm")
    ry, rdx, rdw, rdb, rdh = reference_norm_grads(x, w, b, cu, h, dy)
    assert_bf16_close(y, ry, "y")
    assert_bf16_close(dx, rdx, "dx")
    assert_f32_close(dw, rdw, "dweight")
    assert_f32_close(db, rdb, "dbias")
    if halo:
        assert_f32_close(dh, rdh, "dhalo")
    # the autograd op picks the form
    xl = x.clone().requires_grad_()
    got = causal_conv1d_silu(xl, w, b, cu_seqlens=cu.cpu(), halo=h, l2norm=True)
    assert torch.equal(got, y)
    got.backward(dy)
    assert torch.equal(xl.grad, dx)


@pytest.mark.parametrize("halo", [False, True])
def test_l2norm_batched_rows_are_bitwise_the_row_by_row_ones(halo):
    """The shipped l2norm forms take the head sums of several rows side by side (norm_batch), the test-only
    l2norm_short_tiles forms one row at a time with a tile edge every 5 tokens: y, dx and dhalo bitwise
    equal (dweight / dbias differ only in their tile summation order)."""
    require_form("conv1d_silu_fwd", "l2norm_short_tiles")
    require_form("conv1d_silu_bwd", "l2norm_short_tiles")
    x, w, b, cu, h, dy = pack(PACKS["long"], 256, rng(("l2norm tiles", halo)), halo=halo)
    a = run_kernels(x, w, b, cu, h, dy, "l2norm", "l2norm")
    s = run_kernels(x, w, b, cu, h, dy, "l2norm_short_tiles", "l2norm_short_tiles")
    assert torch.equal(a[0], s[0]) and torch.equal(a[1], s[1])
    if halo:
        assert torch.equal(a[4], s[4])
    assert_f32_close(s[2], a[2].double(), "dweight", rel=1e-5)
    assert_f32_close(s[3], a[3].double(), "dbias", rel=1e-5)


def test_a_list_of_boundaries_is_the_tensor():
    """causal_conv1d_silu takes cu_seqlens as a list of ints too (as chunk_kda and PackedKDA do): the same bits."""
    x, w, b, cu, h, _ = pack(PACKS["long"], 256, rng("list-cu"), halo=True)
    want = causal_conv1d_silu(x, w, b, cu_seqlens=cu, halo=h)
    assert torch.equal(causal_conv1d_silu(x, w, b, cu_seqlens=cu.tolist(), halo=h), want)


def test_two_runs_are_bitwise_equal():
    x, w, b, cu, h, dy = pack(PACKS["long"], 512, rng("determinism"), halo=True)
    a = run_kernels(x, w, b, cu, h, dy)
    c = run_kernels(x, w, b, cu, h, dy)
    for u, v in zip(a, c):
        assert torch.equal(u, v)


def test_halo_continues_a_split_document():
    """A document cut in two, the second part given the 3 tokens before it as halo, gives the same y."""
    gen = rng("split")
    x, w, b, cu, _, dy = pack([300], 128, gen)
    whole = conv1d_silu_forward(x, w, b, cu)
    cut = 101
    cu2 = torch.tensor([0, cut, 300], device="cuda", dtype=torch.int32)
    halo = torch.zeros(2, 3, 128, device="cuda", dtype=torch.bfloat16)
    halo[1] = x[0, cut - 3:cut]
    split = conv1d_silu_forward(x, w, b, cu2, halo)
    assert torch.equal(whole, split)
    # the halo gradient is exactly what the first part's tokens miss: dx_split + dhalo = dx of the whole
    ref_dx = reference_grads(x, w, b, cu, None, dy)[1]
    dx_split, _, _, dh = conv1d_silu_backward(x, w, b, cu2, dy, halo, need_dhalo=True)
    fixed = dx_split.double()
    fixed[0, cut - 3:cut] += dh[1].double()
    # one bf16 rounding, of dx_split, sits inside the sum
    err = (fixed - ref_dx).abs()
    bound = BF16_REL * (dx_split.double().abs() + ref_dx.abs()) + 1e-4 * ref_dx.abs().max()
    assert not (err > bound).any(), f"worst err {err.max().item():.3e} (seed {SEED})"


def test_autograd_op_matches_kernels_and_keeps_dtypes():
    x, w, b, cu, h, dy = pack(PACKS["edges"], 128, rng("autograd"), halo=True)
    xs = x.clone().requires_grad_()
    wb = w.to(torch.bfloat16).requires_grad_()
    bb = b.clone().requires_grad_()
    hs = h.clone().requires_grad_()
    y = causal_conv1d_silu(xs, wb, bb, cu_seqlens=cu, halo=hs)
    y.backward(dy)
    ky, kdx, kdw, kdb, kdh = run_kernels(x, wb.detach().float(), b, cu, h, dy)
    assert torch.equal(y, ky) and torch.equal(xs.grad, kdx)
    assert wb.grad.dtype == torch.bfloat16 and torch.equal(wb.grad, kdw.to(torch.bfloat16))
    assert torch.equal(bb.grad, kdb) and torch.equal(hs.grad, kdh.to(torch.bfloat16))


def test_nonfinite_input_gives_nonfinite_output_not_a_hang():
    x, w, b, cu, h, dy = pack([10, 20], 128, rng("nan"))
    x[0, 5, 3] = float("nan")
    y = conv1d_silu_forward(x, w, b, cu)
    assert torch.isnan(y[0, 5:9, 3]).all()
    assert torch.isfinite(y[0, 10:, :]).all()  # the next document does not see it
