"""use_qk_l2norm_in_kernel inside kda_fwd_chunk and kda_bwd_gate (Options.qk_l2norm_fused, shipped on) against
the l2norm op first (off): bitwise the same o, final state and every gradient, in both backward modes, with
grouped value heads and both kda_bwd_gate forms, and in the replay's head groups; the rstd the forward keeps is
l2norm_fwd's, bitwise; the fused call launches no l2norm_fwd. (The fused path against the fp64 reference of
FLA's formulas: tests/test_fla_signature_gpu.py, whose calls set use_qk_l2norm_in_kernel; saved == replay there.)"""
import pytest
import torch

from conftest import gpu
from test_fla_signature_gpu import cuda_inputs
import kda_aot
from kda_aot import options
from kda_aot._runtime import registry
from kda_aot.ops import chunk_kda as op
from kda_aot.ops.norm import l2norm_forward

pytestmark = gpu
NAMES = ("q", "k", "v", "g", "b", "h0", "A_log", "dt_bias")


def raw_inputs(H, HV, tag):
    """FLA-signature inputs with q, k far from unit rows (so that the norm matters)."""
    x = cuda_inputs(H, HV, tag)
    x["q"], x["k"] = (x[n] * 3 for n in ("q", "k"))
    return x


def call(x, backward, **changes):
    """(o, final state, gradients) of FLA's layer call with use_qk_l2norm_in_kernel under Options(**changes)."""
    leaves = {n: x[n].clone().requires_grad_() for n in NAMES}
    with options.using(**changes):
        o, s = kda_aot.chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["b"], None, leaves["h0"],
                                 True, True, True, True, cu_seqlens=x["cu"], A_log=leaves["A_log"],
                                 dt_bias=leaves["dt_bias"], backward=backward)
        torch.autograd.backward((o, s), (x["do"].to(torch.bfloat16), x["dht"]))
    return o, s, {n: leaves[n].grad for n in NAMES}


def assert_same(a, b, what):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"{what}: o or the final state differ"
    for n in NAMES:
        assert torch.equal(a[2][n], b[2][n]), f"{what}: d{n} differs"


@pytest.mark.parametrize("H,HV", [(2, 2), (2, 4), (4, 4)])
@pytest.mark.parametrize("backward", ["replay", "saved"])
@pytest.mark.parametrize("gate_form", ["split_staged", "full"])
def test_fused_norm_is_bitwise_the_l2norm_op_first(H, HV, backward, gate_form):
    x = raw_inputs(H, HV, ("fused", H, HV))
    fused = call(x, backward, qk_l2norm_fused=True, gate_form=gate_form)
    separate = call(x, backward, qk_l2norm_fused=False, gate_form=gate_form)
    assert_same(fused, separate, f"H={H} HV={HV} {backward} {gate_form}")


@pytest.mark.parametrize("H,HV", [(2, 2), (2, 4)])
def test_fused_norm_saved_is_the_replay_and_its_head_groups(H, HV):
    x = raw_inputs(H, HV, ("groups", H, HV))
    saved = call(x, "saved")
    assert_same(saved, call(x, "replay"), "saved vs replay")
    assert_same(saved, call(x, "replay", max_heads=HV // H), "saved vs the replay a q, k head at a time")


@pytest.mark.parametrize("H,HV", [(2, 2), (2, 4)])
def test_forward_rstd_is_l2norm_fwds(H, HV):
    """kda_fwd_chunk's rstd (written once per q, k head by the group's first value head) is l2norm_fwd's."""
    x = raw_inputs(H, HV, ("rstd", H, HV))
    q, k = x["q"].contiguous(), x["k"].contiguous()
    g = -torch.rand_like(x["g"]) * 5
    beta = torch.rand_like(x["b"]).to(torch.bfloat16)
    out = op.chunk_kda_fwd_op(q, k, x["v"], g, beta, None, x["cu"], 128 ** -0.5, False, qk_l2norm=True)
    qk_rstd = out[-1]
    assert qk_rstd.shape == (2, *q.shape[:3])
    assert torch.equal(qk_rstd[0], l2norm_forward(q)[1]) and torch.equal(qk_rstd[1], l2norm_forward(k)[1])


def test_fused_call_launches_no_l2norm_fwd(monkeypatch):
    seen, library = [], registry.library
    monkeypatch.setattr(registry, "library", lambda program, form="default": seen.append(program) or
                        library(program, form))
    call(raw_inputs(2, 2, "launches"), "replay")
    assert "l2norm_fwd" not in seen and seen.count("l2norm_bwd") == 2, seen
