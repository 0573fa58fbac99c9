"""Per-kernel device time of one KDA training step (replay: forward, then the backward's forward
replay and backward kernels) on one pack (torch.profiler), to place the time.

    python3 bench/profile_kda.py [pack] [heads] [call] [options]

call: "log_decay" (g the log decay, beta given: the single benchmark's step) or "fla_layer" (FLA's layer
call: the raw bf16 gate with A_log and dt_bias activated in the kernels, beta as bf16 logits, q and k
L2-normalised in the call) or "gate" (that call without the norm: against log_decay, the activations' cost).
options: kda_aot.options as `name=value,...` (e.g. `walk_form=full,pipeline=0`), in force for every step."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench.packs import PACKS
from bench.single import inputs, training_call
from kda_aot import chunk_kda, options

pack = sys.argv[1] if len(sys.argv) > 1 else "Q1"
H = int(sys.argv[2]) if len(sys.argv) > 2 else 32
call = sys.argv[3] if len(sys.argv) > 3 else "log_decay"
options.swap(options.parse(sys.argv[4] if len(sys.argv) > 4 else ""))
q, k, v, g, beta, cu = inputs(PACKS[pack], H)
do = torch.randn_like(v)
leaves, kw = training_call(q, k, v, g, beta, call)


def forward():
    return chunk_kda(*leaves[:5], cu_seqlens=cu, **kw)[0]

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
