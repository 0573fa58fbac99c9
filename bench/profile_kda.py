"""Per-kernel device time of one KDA training step (replay: forward, then the backward's forward
replay and backward kernels) on one pack (torch.profiler), to place the time."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench.packs import PACKS
from bench.single import inputs
from kda_aot import chunk_kda

pack = sys.argv[1] if len(sys.argv) > 1 else "Q1"
H = int(sys.argv[2]) if len(sys.argv) > 2 else 32
q, k, v, g, beta, cu = inputs(PACKS[pack], H)
leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
do = torch.randn_like(v)


def step():
    for x in leaves:
        x.grad = None
    chunk_kda(*leaves, cu_seqlens=cu, backward="replay")[0].backward(do)


for _ in range(2):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
