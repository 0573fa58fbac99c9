"""Per-kernel device time of the KDA forward on one pack (torch.profiler), to place the time."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kda_aot.bench.packs import PACKS
from kda_aot.bench.single import inputs
from kda_aot.kda import chunk_kda_fwd

pack = sys.argv[1] if len(sys.argv) > 1 else "Q1"
H = int(sys.argv[2]) if len(sys.argv) > 2 else 32
q, k, v, g, beta, cu = inputs(PACKS[pack], H)
for _ in range(2):
    chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
