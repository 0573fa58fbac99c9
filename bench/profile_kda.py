"""Per-kernel device time of one KDA training step (replay: forward, then the backward's forward
replay and backward kernels) on one pack (torch.profiler), to place the time.

    python3 bench/profile_kda.py [pack] [heads] [call]

call: "log_decay" (g the log decay, beta given: the single benchmark's step) or "fla_layer" (FLA's layer
call: the raw bf16 gate with A_log and dt_bias activated in the kernels, beta as bf16 logits, q and k
L2-normalised in the call)."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench.packs import PACKS
from bench.single import fla_gate_inputs, inputs
from kda_aot import chunk_kda

pack = sys.argv[1] if len(sys.argv) > 1 else "Q1"
H = int(sys.argv[2]) if len(sys.argv) > 2 else 32
call = sys.argv[3] if len(sys.argv) > 3 else "log_decay"
q, k, v, g, beta, cu = inputs(PACKS[pack], H)
do = torch.randn_like(v)
if call == "fla_layer":
    g, a_log, dt_bias, beta = fla_gate_inputs(q.shape[1], H)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, a_log, dt_bias)]
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)

    def forward():
        return chunk_kda(*leaves[:5], A_log=leaves[5], dt_bias=leaves[6], cu_seqlens=cu, **kw)[0]
elif call == "log_decay":
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]

    def forward():
        return chunk_kda(*leaves, cu_seqlens=cu, backward="replay")[0]
else:
    raise SystemExit(f"call: expected log_decay or fla_layer, got {call}")


def step():
    for x in leaves:
        x.grad = None
    forward().backward(do)


for _ in range(2):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=70))
