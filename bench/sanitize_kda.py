"""Small KDA forward + backward-walk run for compute-sanitizer (memcheck, racecheck): short and long documents,
initial and final state, grouped value heads."""
import torch
import torch.nn.functional as F

from kda_aot._runtime import registry
from kda_aot.schedule.kda import chunk_kda_fwd
from kda_aot.schedule.backward import chunk_kda_bwd, chunk_kda_bwd_walk

lens, H = [1, 63, 64, 65, 200], 2
T = sum(lens)
q = F.normalize(torch.randn(1, T, H, 128, device="cuda"), dim=-1).to(torch.bfloat16)
k = F.normalize(torch.randn(1, T, H, 128, device="cuda"), dim=-1).to(torch.bfloat16)
v = torch.randn(1, T, H, 128, device="cuda").to(torch.bfloat16)
# g in [-5, 0] on half the channels, [-60, 0] on the rest, and resets (g = -inf) on a few: every gate path
g = torch.rand(1, T, H, 128, device="cuda") * torch.tensor([5.0, 60.0], device="cuda").repeat(64)
g = torch.where(torch.rand_like(g) < 0.01, torch.full_like(g, float("-inf")), -g)
beta = torch.rand(1, T, H, device="cuda").to(torch.bfloat16)
cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
h0 = torch.randn(len(lens), H, 128, 128, device="cuda")
for form in ("full", "split"):
    _, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                save_tape=True, walk_form=form)
do, dht = torch.randn_like(q), torch.randn_like(h0)
chunk_kda_bwd(saved, do, dht)
# a mixed walk plan: one launch per run of segments, each on its own stream (sliced segment tables)
from kda_aot.schedule import fit  # noqa: E402
plan_walk = fit.plan_walk
fit.plan_walk = lambda *args, **kw: (("split", 0, 1), ("full", 1, 3), ("split", 3, 5))
_, _, mixed = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                            save_tape=True, pipeline=False)  # the plan names every segment: one walk
chunk_kda_bwd(mixed, do, dht)
fit.plan_walk = plan_walk
# the pipelined forward: chunk-stage launches over chunk ranges, each group's walk on a side stream
chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True, save_tape=True,
              pipeline=True)
# the gate's activation in the kernels (raw gate; softplus with A_log and dt_bias, sigmoid without A_log)
from kda_aot.schedule.kda import GATE_SIGMOID, GATE_SOFTPLUS, GateActivation  # noqa: E402
raw = torch.randn_like(g) * 4
for gate in (GateActivation(GATE_SOFTPLUS, torch.randn(H, device="cuda") + 1, torch.randn(H, 128, device="cuda")),
             GateActivation(GATE_SIGMOID, None, torch.randn(H, 128, device="cuda"), -3.0),
             GateActivation(GATE_SIGMOID, torch.randn(H, device="cuda"), torch.randn(H, 128, device="cuda"), -3.0)):
    for form in ("full", "split"):
        for raw_g in (raw, raw.to(torch.bfloat16)):  # the raw gate in fp32, and in bf16 read as it is (dg in bf16)
            _, _, gated = chunk_kda_fwd(q, k, v, raw_g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                        save_tape=True, walk_form=form, gate=gate)
            chunk_kda_bwd(gated, do, dht, gate_form="full" if form == "full" else None)
# beta's activation in the kernels: the logits in bf16 (sigmoid) and fp32 (2 sigmoid), read by kda_fwd_chunk,
# kda_bwd_chunk and kda_bwd_gate
from kda_aot.schedule.kda import BETA_SIGMOID, BETA_SIGMOID_2  # noqa: E402
logits = torch.randn(1, T, H, device="cuda") * 3
for beta_kind, b in ((BETA_SIGMOID, logits.to(torch.bfloat16)), (BETA_SIGMOID_2, logits)):
    for form in ("full", "split"):
        _, _, activated = chunk_kda_fwd(q, k, v, g, b, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                        save_tape=True, walk_form=form, beta_kind=beta_kind)
        chunk_kda_bwd(activated, do, dht, gate_form="full" if form == "full" else None)
from kda_aot.ops.norm import l2norm_backward, l2norm_forward
y, rstd = l2norm_forward(q)
l2norm_backward(q, rstd, do)
# the test-only forms, each when built (one missing does not hide the others)
runs = {
    "kda_bwd_walk/split": lambda: chunk_kda_bwd_walk(saved, do, dht, walk_form="split"),
    "kda_fwd_walk/quarter": lambda: chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0,
                                                  output_final_state=True, save_tape=True, walk_form="quarter"),
    "kda_bwd_walk/quarter": lambda: chunk_kda_bwd_walk(saved, do, dht, walk_form="quarter"),
}
for form in ("full",):
    runs[f"kda_bwd_gate/{form}"] = lambda form=form: chunk_kda_bwd(saved, do, dht, gate_form=form)
for name, run in runs.items():
    try:
        run()
    except registry.RecordError as e:
        print(f"sanitize_kda: skipped {name} ({e})")
# the replay backward through autograd: the forward and backward walks side by side on two streams
from kda_aot import chunk_kda  # noqa: E402
leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
chunk_kda(*leaves, cu_seqlens=cu.cpu(), initial_state=h0, backward="replay")[0].backward(do)
from kda_aot import options  # noqa: E402
with options.using(pipeline=True):  # the pipelined replay: chunk-stage ranges, the groups' walks on side streams
    chunk_kda(*leaves, cu_seqlens=cu.cpu(), initial_state=h0, backward="replay")[0].backward(do)
# grouped value heads: q, k of one head read by H value heads in kda_fwd_chunk and kda_bwd_gate, both modes and
# the replay in head groups of whole q, k heads
qk = [x[:, :, :1].contiguous().requires_grad_() for x in (q, k)]
for mode in ("saved", "replay"):
    o, ht = chunk_kda(*qk, *(x.clone().requires_grad_() for x in (v, g, beta)), cu_seqlens=cu.cpu(),
                      initial_state=h0, output_final_state=True, backward=mode)
    torch.autograd.backward((o, ht), (do, dht))
with options.using(max_heads=1):
    chunk_kda(*qk, *(x.clone().requires_grad_() for x in (v, g, beta)), cu_seqlens=cu.cpu(), initial_state=h0,
              backward="replay")[0].backward(do)
# FLA's layer call: use_qk_l2norm_in_kernel (the l2norm op, then the kernels) on raw q, k
for mode in ("saved", "replay"):
    o, ht = chunk_kda(*(x.clone().requires_grad_() for x in (q * 3, k * 3, v, g, beta)), cu_seqlens=cu.cpu(),
                      initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, backward=mode)
    torch.autograd.backward((o, ht), (do, dht))
torch.cuda.synchronize()
# the replay's chunk stage from what the forward kept (kda_fwd_chunk/replay), with the gate and beta activated
# and grouped value heads (q and k of one head, v of two)
qk = [x[:, :, :1].clone().requires_grad_() for x in (q, k)]
gated = [x.clone().requires_grad_() for x in (v, raw.to(torch.bfloat16), logits.to(torch.bfloat16))]
chunk_kda(*qk, gated[0], gated[1], gated[2], A_log=torch.randn(H, device="cuda"),
          dt_bias=torch.randn(H * 128, device="cuda"), use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
          cu_seqlens=cu.cpu(), backward="replay")[0].backward(do)
# the replay in tiles: runs of whole segments write dv, dg, dq, dk into their rows of the whole gradients;
# head groups read copies
from kda_aot.options import Options, using  # noqa: E402
for tiles in (Options(max_tokens=130), Options(max_heads=1), Options(max_tokens=130, max_heads=1)):
    with using(tiles):
        chunk_kda(*leaves, cu_seqlens=cu.cpu(), initial_state=h0, backward="replay")[0].backward(do)
print("sanitize_kda: ok")
