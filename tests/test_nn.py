"""Tests of kda_aot.nn.PackedKDA on one device (its CP path is tested in test_cp_gloo.py).

Fresh inputs every run; the seed is printed (replay with KDA_TEST_SEED=<seed>).
"""
from __future__ import annotations


import pytest
import torch

from kda_aot import reference
from kda_aot.nn import PackedKDA

from conftest import HAS_GPU, SEED, generator, gpu
from reftools import rel_err
print(f"[test_nn] KDA_TEST_SEED={SEED}")

F64 = torch.float64


def gen_for(tag):
    return generator(tag)


def inputs(tag, lens, H, Dh, dtype=torch.float32):
    gen = gen_for(tag)
    T = sum(lens)
    x = [torch.randn(1, T, H * Dh, generator=gen, dtype=F64).to(dtype) for _ in range(3)]
    g = -torch.exp(torch.empty(1, T, H, Dh, dtype=F64).uniform_(-5, 1.6, generator=gen)).to(dtype)
    beta = torch.rand(1, T, H, generator=gen, dtype=F64).to(dtype)
    cu = torch.tensor([0] + lens).cumsum(0)
    return x, g, beta, cu


def module(H, Dh, tag, **kw):
    torch.manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=gen_for("init" + tag))))
    return PackedKDA(H, Dh, **kw)


def manual(m, q, k, v, g, beta, cu, dtype=F64):
    """The layer written out with the reference pieces, independently of PackedKDA."""
    H, Dh = m.num_heads, m.head_dim
    outs = []
    for x, n in zip((q, k, v), "qkv"):
        y = reference.conv1d_silu(x, getattr(m, f"{n}_conv_weight"), getattr(m, f"{n}_conv_bias"),
                                  cu_seqlens=cu, dtype=dtype)
        outs.append(y.reshape(1, -1, H, Dh))
    qc, kc, vc = outs
    if m.qk_l2norm:
        qc = qc / torch.sqrt((qc * qc).sum(-1, keepdim=True) + 1e-6)
        kc = kc / torch.sqrt((kc * kc).sum(-1, keepdim=True) + 1e-6)
    return reference.kda_chunked(qc, kc, vc, g, beta, cu_seqlens=cu, dtype=dtype)[0]


def test_parameters_and_repr():
    m = PackedKDA(4, 32)
    names = dict(m.named_parameters())
    assert set(names) == {"q_conv_weight", "k_conv_weight", "v_conv_weight"}
    assert all(p.shape == (128, 4) for p in names.values())
    assert all(p.abs().max() <= 0.5 for p in names.values())     # U(-1/2, 1/2) init
    mb = PackedKDA(2, 8, conv_bias=True, qk_l2norm=False, backward="saved")
    assert {n for n, _ in mb.named_parameters()} >= {"q_conv_bias", "k_conv_bias", "v_conv_bias"}
    assert mb.v_conv_bias.shape == (16,)
    assert "backward='saved'" in repr(mb) and "qk_l2norm=False" in repr(mb)
    assert PackedKDA(1).q_conv_weight.shape == (128, 4)             # head_dim defaults to 128


@pytest.mark.parametrize("conv_bias,qk_l2norm", [(False, True), (True, False), (True, True)])
def test_matches_the_layer_written_out(conv_bias, qk_l2norm):
    H, Dh, lens = 2, 16, [5, 70, 1, 64, 130]
    (q, k, v), g, beta, cu = inputs(f"manual{conv_bias}{qk_l2norm}", lens, H, Dh, F64)
    m = module(H, Dh, "m", conv_bias=conv_bias, qk_l2norm=qk_l2norm).double()
    o, final = m(q, k, v, g, beta, cu_seqlens=cu)
    assert o.shape == (1, sum(lens), H, Dh) and o.dtype == F64 and final is None
    want = manual(m, q, k, v, g, beta, cu)
    assert ((o - want).abs().max() / want.abs().max()).item() < 1e-12, f"seed {SEED}"


def test_fp32_final_state_and_gradients_flow():
    H, Dh, lens = 2, 16, [40, 100]
    (q, k, v), g, beta, cu = inputs("grads", lens, H, Dh)
    m = module(H, Dh, "g", conv_bias=True)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    h0 = torch.randn(len(lens), H, Dh, Dh, generator=gen_for("h0"), requires_grad=True)
    o, final = m(*leaves, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float32 and final.shape == (len(lens), H, Dh, Dh)
    (o.square().sum() + final.sum()).backward()
    for t in leaves + [h0] + list(m.parameters()):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().max() > 0
    # fp32 module vs the fp64 layer: the reference's fp32 rounding only
    m64 = module(H, Dh, "g", conv_bias=True).double()
    want = manual(m64, *(t.double() for t in (q, k, v, g, beta)), cu)
    o32, _ = m(q, k, v, g, beta, cu_seqlens=cu)
    assert ((o32.double() - want).abs().max() / want.abs().max()).item() < 1e-4


def test_gradcheck_small():
    H, Dh, lens = 1, 3, [2, 5]
    (q, k, v), g, beta, cu = inputs("gradcheck", lens, H, Dh, F64)
    m = module(H, Dh, "gc", conv_bias=True).double()
    def manual_with(m, ps, q, k, v, g, beta, cu):
        # the layer as a function of the parameters too, so that gradcheck can vary them
        wq, bq, wk, bk, wv, bv = ps
        convs = [reference.conv1d_silu(x, w, b, cu_seqlens=cu).reshape(1, -1, H, Dh)
                 for x, w, b in ((q, wq, bq), (k, wk, bk), (v, wv, bv))]
        qc, kc, vc = convs
        qc = qc / torch.sqrt((qc * qc).sum(-1, keepdim=True) + 1e-6)
        kc = kc / torch.sqrt((kc * kc).sum(-1, keepdim=True) + 1e-6)
        return reference.kda_chunked(qc, kc, vc, g * 0.3, beta, cu_seqlens=cu, chunk_size=4)[0]

    # The module's own forward equals the functional one (so gradcheck covers the module).
    o_mod, _ = m(q, k, v, g * 0.3, beta, cu_seqlens=cu)
    ordered = [m.q_conv_weight, m.q_conv_bias, m.k_conv_weight, m.k_conv_bias,
               m.v_conv_weight, m.v_conv_bias]
    o_fun = manual_with(m, ordered, q, k, v, g, beta, cu)
    # chunk_size differs (4 vs 64): the same maths, rounding only
    assert ((o_mod - o_fun).abs().max() / o_fun.abs().max()).item() < 1e-12
    leaves = tuple(t.clone().requires_grad_(True) for t in [q, k, v, g, beta] + ordered)
    assert torch.autograd.gradcheck(lambda *a: manual_with(m, a[5:], *a[:5], cu), leaves,
                                    eps=1e-6, atol=1e-8, rtol=1e-6)
    # module gradients (autograd through PackedKDA) == the functional ones
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    o, _ = m(*ins[:3], ins[3] * 0.3, ins[4], cu_seqlens=cu)
    w = torch.randn_like(o)
    (o * w).sum().backward()
    f_ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    f_ps = [p.detach().clone().requires_grad_(True) for p in ordered]
    (manual_with(m, f_ps, *f_ins, cu) * w).sum().backward()
    for a, b in list(zip(ins, f_ins)) + list(zip(ordered, f_ps)):
        assert rel_err(a.grad, b.grad) < 1e-10


def test_argument_errors():
    m = PackedKDA(2, 8)
    (q, k, v), g, beta, cu = inputs("err", [4, 4], 2, 8)
    with pytest.raises(ValueError, match="exactly one of cu_seqlens"):
        m(q, k, v, g, beta)
    with pytest.raises(ValueError, match="group is only used with a plan"):
        m(q, k, v, g, beta, cu_seqlens=cu, group=object())
    with pytest.raises(ValueError, match=r"q must be \[1, T, 16\]"):
        m(q[..., :8], k, v, g, beta, cu_seqlens=cu)
    with pytest.raises(ValueError, match="backward must be one of"):
        PackedKDA(2, 8, backward="recompute")
    with pytest.raises(ValueError, match="backend must be one of"):
        PackedKDA(2, 8, backend="triton")
    for args, kw, err, match in (((2.7, 8), {}, TypeError, "num_heads: expected an int, got 2.7"),
                                 ((True, 8), {}, TypeError, "num_heads: expected an int, got True"),
                                 ((2, "8"), {}, TypeError, "head_dim: expected an int"),
                                 ((0, 8), {}, ValueError, "num_heads: must be >= 1, got 0"),
                                 ((2, 8), dict(conv_bias="no"), TypeError, "conv_bias: expected a bool, got 'no'"),
                                 ((2, 8), dict(qk_l2norm=2), TypeError, "qk_l2norm: expected a bool, got 2"),
                                 ((2, 8), dict(qk_l2norm=1.0), TypeError, "qk_l2norm: expected a bool, got 1.0")):
        with pytest.raises(err, match=match):
            PackedKDA(*args, **kw)
    assert PackedKDA(torch.tensor(2), 8).num_heads == 2  # an integer of any kind
    # a switch as configs carry it: 0 / 1 (argparse, JSON) or a numpy / torch bool
    assert PackedKDA(2, 8, conv_bias=1, qk_l2norm=0).qk_l2norm is False and PackedKDA(2, 8, conv_bias=1).q_conv_bias is not None
    assert PackedKDA(2, 8, qk_l2norm=torch.tensor(True)).qk_l2norm is True
    # cu_seqlens_cpu is cu_seqlens' CPU copy: the conv and KDA read the same boundaries or the call refuses
    with pytest.raises(ValueError, match="cu_seqlens_cpu: must hold cu_seqlens' values"):
        m(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 2, 8]))
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu: expected shape \[3\] \(as cu_seqlens\), got \[2\]"):
        m(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="cu_seqlens_cpu: give cu_seqlens too"):
        m(q, k, v, g, beta, plan=object(), cu_seqlens_cpu=cu)
    assert torch.equal(m(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu.int())[0], m(q, k, v, g, beta,
                                                                                        cu_seqlens=cu)[0])
    # on the reference backend as on the kernels: the scale, the boundaries, the gate's dtype and device
    with pytest.raises(ValueError, match="scale: expected a finite number"):
        m(q, k, v, g, beta, cu_seqlens=cu, scale=float("nan"))
    with pytest.raises(TypeError, match="scale: expected a real number"):
        m(q, k, v, g, beta, cu_seqlens=cu, scale="x")
    with pytest.raises(TypeError, match="cu_seqlens: expected a tensor or a sequence of ints"):
        m(q, k, v, g, beta, cu_seqlens=[0, 3.5, 8])
    as_list = m(q, k, v, g, beta, cu_seqlens=cu.tolist())[0]  # integers of any kind are boundaries
    assert cu.tolist() == [0, 4, 8]
    assert torch.equal(m(q, k, v, g, beta, cu_seqlens=range(0, 9, 4))[0], as_list)
    assert torch.equal(m(q, k, v, g, beta, cu_seqlens=[torch.tensor(c) for c in cu.tolist()])[0], as_list)
    with pytest.raises(TypeError, match="g: expected a floating-point tensor"):
        m(q, k, v, g.long(), beta, cu_seqlens=cu)
    # integers would come back from the reference path as zeros of their dtype
    with pytest.raises(TypeError, match="q: expected a floating-point tensor, got torch.int64"):
        m(q.long(), k, v, g, beta, cu_seqlens=cu)
    with pytest.raises(TypeError, match="beta: expected a floating-point tensor, got torch.int64"):
        m(q, k, v, g, beta.long(), cu_seqlens=cu)
    with pytest.raises(TypeError, match="initial_state: expected a torch.Tensor, got list"):
        m(q, k, v, g, beta, cu_seqlens=cu, initial_state=[[0.0]])
    with pytest.raises(ValueError, match="g: on meta but q is on cpu"):
        m(q, k, v, g.to("meta"), beta, cu_seqlens=cu)


def test_shapes_are_checked_before_the_convs_run(monkeypatch):
    """g, beta and the initial state's rows are named before any conv runs (the CUDA backend would launch them)."""
    (q, k, v), g, beta, cu = inputs("early", [5, 11], 2, 8)
    m = module(2, 8, "early")
    calls, conv = [], reference.conv1d_silu
    monkeypatch.setattr(reference, "conv1d_silu", lambda *a, **kw: calls.append(1) or conv(*a, **kw))
    for args, kw, match in (((g, beta[..., :1]), {}, r"beta: expected shape \[1, 16, 2\]"),
                            ((g[..., :4], beta), {}, r"g: expected shape \[1, 16, 2, 8\]"),
                            ((g, beta), dict(initial_state=torch.zeros(3, 2, 8, 8)),
                             r"initial_state: expected shape \[2, 2, 8, 8\]")):
        with pytest.raises(ValueError, match=match):
            m(q, k, v, *args, cu_seqlens=cu, **kw)
    assert not calls
    m(q, k, v, g, beta, cu_seqlens=cu)
    assert len(calls) == 3  # (the spy sees the module's convs)


@pytest.mark.skipif(HAS_GPU, reason="the CPU-tensor refusal is what a GPU-less machine can show")
def test_cuda_backend_refuses_cpu_tensors_naming_the_reference_backend():
    m = PackedKDA(2, 128, backend="cuda")
    (q, k, v), g, beta, cu = inputs("cuda-on-cpu", [4, 4], 2, 128, torch.bfloat16)
    with pytest.raises(ValueError, match=r"q: PackedKDA\(backend='cuda'\) runs its kernels on a CUDA GPU, got a tensor "
                                         r"on cpu; on the CPU, PackedKDA\(backend='auto'\) runs the same module"):
        m(q, k, v, g, beta, cu_seqlens=cu)


def test_cuda_backend_needs_head_dim_128():
    m = PackedKDA(2, 8, backend="cuda")
    (q, k, v), g, beta, cu = inputs("cuda", [4, 4], 2, 8)
    with pytest.raises(ValueError, match="head_dim must be 128"):
        m(q, k, v, g, beta, cu_seqlens=cu)


@gpu
def test_cuda_layer_matches_reference_layer():
    """The whole layer on the CUDA kernels (bf16 activations) against the reference backend in fp64 on the same
    bf16 inputs: relative RMS 1e-2 for o and every gradient. The budget: bf16 storage of the conv outputs, of
    o and of each gradient (2^-9 relative each, ~1.6e-3 RMS), and the kernels' own error against fp64
    (2-4e-3 on the numerics cases, tests/test_kda_numerics_gpu.py), summed with room for the conv's
    gradient through the norm."""
    H, Dh, lens = 2, 128, [65, 1, 200]
    (q, k, v), g, beta, cu = inputs("layer", lens, H, Dh)
    q, k, v, beta = (t.to(torch.bfloat16) for t in (q, k, v, beta))
    mc = module(H, Dh, "layer", backend="cuda").cuda()
    mr = module(H, Dh, "layer").double()
    xs_c = [t.cuda().requires_grad_() for t in (q, k, v)]
    xs_r = [t.double().requires_grad_() for t in (q, k, v)]
    oc, _ = mc(*xs_c, g.cuda(), beta.cuda(), cu_seqlens=cu)
    orr, _ = mr(*xs_r, g.double(), beta.double(), cu_seqlens=cu)
    do = torch.randn(orr.shape, generator=gen_for("layer-do"), dtype=F64)
    oc.backward(do.to(torch.bfloat16).cuda())
    orr.backward(do)
    rel = lambda a, b: ((a.double().cpu() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(oc, orr.detach()) < 1e-2
    for a, b in zip(xs_c, xs_r):
        assert rel(a.grad, b.grad) < 1e-2
    for n in ("q_conv_weight", "k_conv_weight", "v_conv_weight"):
        assert rel(getattr(mc, n).grad, getattr(mr, n).grad) < 1e-2, n


@gpu
@pytest.mark.parametrize("Dh", [64, 128])
def test_cuda_conv_qkv_matches_reference(Dh):
    """backend='cuda' runs the conv through kda_aot.causal_conv1d_silu (bf16 in and out):
    within bf16 rounding (2^-8 relative, plus the fp32 L2 norm) of the reference path."""
    H, lens = 2, [5, 70, 1, 64, 130]
    (q, k, v), g, beta, cu = inputs("cudaconv", lens, H, Dh)
    mc = module(H, Dh, "cc", conv_bias=True, backend="cuda").cuda()
    mr = module(H, Dh, "cc", conv_bias=True)
    xs = [t.cuda().to(torch.bfloat16) for t in (q, k, v)]
    got = mc.conv_qkv(*xs, cu_seqlens=cu.cuda())
    want = mr.conv_qkv(*(t.float().cpu() for t in xs), cu_seqlens=cu)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        assert ((a.float().cpu() - b).abs().max() / b.abs().max()).item() < 2 * 2.0 ** -8


def test_fla_conv_weights_round_trip_and_compute_the_same():
    """FLA's ShortConvolution weights ([D, 1, 4], nn.Conv1d depthwise, left-padded) load as PackedKDA's conv
    weights: torch's conv1d with them gives the reference conv's pre-activation, and the round trip is exact."""
    from kda_aot import reference
    m = PackedKDA(2, 16, conv_bias=True, backend="reference")
    D = 32
    fla = {f"attn.{n}_conv1d.weight": torch.randn(D, 1, 4) for n in "qkv"}
    fla.update({f"attn.{n}_conv1d.bias": torch.randn(D) for n in "qkv"})
    fla["attn.A_log"] = torch.zeros(2)  # not a conv key: left alone
    m.load_fla_conv_state_dict(fla, prefix="attn.")
    back = m.fla_conv_state_dict(prefix="attn.")
    assert set(back) == {k for k in fla if "conv1d" in k} and all(torch.equal(back[k], fla[k]) for k in back)
    x = torch.randn(1, 50, D, dtype=torch.float64)
    w, b = fla["attn.q_conv1d.weight"].double(), fla["attn.q_conv1d.bias"].double()
    conv = torch.nn.functional.conv1d(x.transpose(1, 2), w, b, padding=3, groups=D)[..., :50].transpose(1, 2)
    ours = reference.conv1d_silu(x, m.q_conv_weight.double(), m.q_conv_bias.double(), cu_seqlens=[0, 50])
    assert torch.allclose(ours, torch.nn.functional.silu(conv), atol=1e-12)
    with pytest.raises(ValueError, match="q_conv1d.bias: missing"):
        m.load_fla_conv_state_dict({k: v for k, v in fla.items() if k != "attn.q_conv1d.bias"}, prefix="attn.")
    with pytest.raises(ValueError, match="present, but this module has no conv bias"):
        PackedKDA(2, 16, backend="reference").load_fla_conv_state_dict(fla, prefix="attn.")
    with pytest.raises(ValueError, match=r"expected \[32, 4\]"):
        m.load_fla_conv_state_dict(dict(fla, **{"attn.k_conv1d.weight": torch.randn(D, 1, 3)}), prefix="attn.")
