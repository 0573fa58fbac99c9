"""Grouped value heads (FLA's HV > H) inside the kernels: kda_fwd_chunk and kda_bwd_gate read q, k head
h // (HV / H) for value head h, and the backward sums each q, k head's group of dq, dk in a fixed order.
Against the fp64 reference at HV / H = 2 and 4, every walk form, both backward modes (bitwise equal, also
in replay head groups), and bitwise against the same kernels run on q, k repeated per value head (the
values they read are the same, so the forward's bits and the per-value-head dq, dk are too)."""
import pytest
import torch

from conftest import SEED, gpu
from kda_aot import chunk_kda, reference
from kda_aot.schedule.backward import sum_value_head_groups
from kda_aot.schedule.kda import chunk_kda_fwd
from test_kda_bwd_gpu import BOUND
from test_kda_fwd_gpu import PACKS, REL, make, poisoned, rel_rms, rng

pytestmark = gpu

WALK_FORMS = ["full", "split", "quarter"]


def make_gva(lens, H, G, tag, init=True):
    """q, k of H heads and v, g, beta, h0 of H * G heads (make's inputs, q and k narrowed to H heads)."""
    q, k, v, g, beta, cu, h0 = make(lens, H * G, "rand", rng(("gva", H, G, tag)), init)
    return q[:, :, :H].contiguous(), k[:, :, :H].contiguous(), v, g, beta, cu, h0


def repeated(x, G):
    return x.repeat_interleave(G, dim=2)


@pytest.mark.parametrize("G", [2, 4])
@pytest.mark.parametrize("form", WALK_FORMS)
@pytest.mark.parametrize("pack", ["edges", "long"])
def test_forward_matches_reference_and_the_repeated_heads(G, form, pack):
    H = 2
    q, k, v, g, beta, cu, h0 = make_gva(PACKS[pack], H, G, ("fwd", form, pack))
    T, N, HV = q.shape[1], cu.numel() - 1, H * G
    out = {"o": poisoned(torch.empty(1, T, HV, 128, device="cuda", dtype=torch.bfloat16)),
           "final_state": poisoned(torch.empty(N, HV, 128, 128, device="cuda"))}
    o, ht, _ = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True, out=out,
                             walk_form=form)
    ro, rht = reference.kda_recurrent(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), cu_seqlens=cu.cpu(),
                                      initial_state=h0.cpu(), output_final_state=True)
    eo, eh = rel_rms(o.cpu(), ro), rel_rms(ht.cpu(), rht)
    print(f"G={G} {form} {pack}: o {eo:.2e} state {eh:.2e}")
    assert eo < REL and eh < REL, f"o {eo:.3e} state {eh:.3e} (seed {SEED})"
    o1, ht1, _ = chunk_kda_fwd(repeated(q, G), repeated(k, G), v, g, beta, cu_seqlens=cu, initial_state=h0,
                               output_final_state=True, walk_form=form)
    assert torch.equal(o, o1) and torch.equal(ht, ht1), "in-kernel GVA differs from the kernels on repeated q, k"


def _grads(q, k, v, g, beta, cu, h0, dout, dht, mode):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = chunk_kda(*leaves[:5], cu_seqlens=cu, initial_state=leaves[5], output_final_state=True, backward=mode)
    torch.autograd.backward((o, ht), (dout, dht))
    return [x.grad for x in leaves]


@pytest.mark.parametrize("G", [2, 4])
@pytest.mark.parametrize("form", WALK_FORMS)
def test_gradients_both_modes_bitwise_and_right(kda_options, G, form):
    H = 3 if G == 2 else 2
    lens = PACKS["long"]
    q, k, v, g, beta, cu, h0 = make_gva(lens, H, G, ("bwd", form))
    T, N, HV = q.shape[1], len(lens), H * G
    dout = torch.randn(1, T, HV, 128, device="cuda", generator=rng(("gva-do", G))).to(torch.bfloat16)
    dht = torch.randn(N, HV, 128, 128, device="cuda", generator=rng(("gva-dht", G)))
    kda_options(walk_form=form)
    saved = _grads(q, k, v, g, beta, cu, h0, dout, dht, "saved")
    replay = _grads(q, k, v, g, beta, cu, h0, dout, dht, "replay")
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), saved, replay):
        assert torch.equal(a, b), f"{name}: saved and replay differ"
    assert saved[0].shape == q.shape and saved[1].shape == k.shape
    # replay head groups are whole q, k heads with their value heads (max_heads counts value heads); runs of
    # whole segments sum dq, dk over the value heads per run
    for groups in ({"max_heads": 1}, {"max_heads": 2 * G}, {"max_tokens": 1100}, {"max_heads": G, "max_tokens": 1100}):
        kda_options(**{"max_heads": 0, "max_tokens": 0, **groups})
        grouped = _grads(q, k, v, g, beta, cu, h0, dout, dht, "replay")
        for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), replay, grouped):
            assert torch.equal(a, b), f"{name}: the replay in groups ({groups}) differs"
    kda_options(max_heads=0, max_tokens=0)
    cpu = [x.cpu() for x in (q, k, v, g, beta)]
    rs = reference.kda_chunked_fwd_saved(*cpu, cu_seqlens=cu.cpu(), initial_state=h0.cpu())
    want = reference.kda_chunked_bwd(rs, dout.cpu(), dht.cpu(), q=cpu[0], k=cpu[1], v=cpu[2], g=cpu[3], beta=cpu[4])
    for name, x, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), replay, want):
        e = rel_rms(x.cpu(), ref)
        print(f"G={G} {form} {name}: {e:.2e}")
        assert e < BOUND.get(name, REL), f"{name}: {e:.3e} (seed {SEED})"
    # the same kernels on q, k repeated per value head: the same dv, dg, dbeta, dh0, and dq, dk per value head
    # that sum (in the fixed order) to the grouped ones
    rq, rk = repeated(q, G), repeated(k, G)
    leaves = [x.clone().requires_grad_() for x in (rq, rk, v, g, beta, h0)]
    o, ht = chunk_kda(*leaves[:5], cu_seqlens=cu, initial_state=leaves[5], output_final_state=True, backward="saved")
    torch.autograd.backward((o, ht), (dout, dht))
    assert torch.equal(sum_value_head_groups(leaves[0].grad, H), saved[0])
    assert torch.equal(sum_value_head_groups(leaves[1].grad, H), saved[1])
    for name, a, b in zip(("dv", "dg", "dbeta", "dh0"), saved[2:], [x.grad for x in leaves[2:]]):
        assert torch.equal(a, b), f"{name}: differs from the kernels on repeated q, k"


def test_without_grouping_the_head_sum_is_the_identity():
    """HV == H: kda_bwd_gate's dq, dk are the gradients themselves (no reduction, no copy)."""
    x = torch.randn(1, 5, 3, 128, device="cuda").to(torch.bfloat16)
    assert sum_value_head_groups(x, 3) is x
