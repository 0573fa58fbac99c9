"""Per-kernel device time of one PackedKDA B3 step (forward + replay backward) on one GPU, without a
plan (single-device path), to place the time outside the KDA kernels (conv, L2 norm, casts)."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench.packs import HEAD_DIM, PACKS
from kda_aot.nn import PackedKDA

pack = sys.argv[1] if len(sys.argv) > 1 else "Q1"
H = int(sys.argv[2]) if len(sys.argv) > 2 else 32
lens = PACKS[pack]
T, D = sum(lens), H * HEAD_DIM
cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
m = PackedKDA(H, HEAD_DIM, backend="cuda", backward="replay").cuda()
xs = [torch.randn(1, T, D, device="cuda").to(torch.bfloat16).requires_grad_() for _ in range(3)]
g = -5 * torch.rand(1, T, H, HEAD_DIM, device="cuda")
beta = torch.rand(1, T, H, device="cuda").to(torch.bfloat16)
do = torch.randn(1, T, H, HEAD_DIM, device="cuda").to(torch.bfloat16)


def step():
    o, _ = m(*xs, g, beta, cu_seqlens=cu)
    o.backward(do)


for _ in range(2):
    step()
torch.cuda.synchronize()
ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
ev[0].record()
step()
ev[1].record()
torch.cuda.synchronize()
print(f"B3 single device, no plan: {ev[0].elapsed_time(ev[1]):.1f} ms")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
