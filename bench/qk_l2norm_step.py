"""FLA's layer call (q, k L2-normalised in the call, the raw bf16 gate activated in the kernels, beta as logits),
one replay training step, with the norm inside kda_fwd_chunk and kda_bwd_gate (Options.qk_l2norm_fused, shipped)
and with the l2norm op first (off), interleaved off on off on: ms per step (CUDA events over `iters` steps).

    python3 bench/qk_l2norm_step.py [pack] [heads] [iters]"""
import sys

import torch

from bench.packs import PACKS
from bench.single import fla_gate_inputs, inputs
from kda_aot import chunk_kda, options

pack = sys.argv[1] if len(sys.argv) > 1 else "Q1"
H = int(sys.argv[2]) if len(sys.argv) > 2 else 32
iters = int(sys.argv[3]) if len(sys.argv) > 3 else 8
q, k, v, _, _, cu = inputs(PACKS[pack], H)
g, a_log, dt_bias, logits = fla_gate_inputs(q.shape[1], H)
leaves = [x.detach().clone().requires_grad_() for x in (q * 3, k * 3, v, g, logits, a_log, dt_bias)]  # raw q, k
do = torch.randn_like(v)
cu = cu.cpu()


def step():
    for x in leaves:
        x.grad = None
    chunk_kda(*leaves[:5], A_log=leaves[5], dt_bias=leaves[6], cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)[0].backward(do)


for fused in (False, True, False, True):
    with options.using(qk_l2norm_fused=fused):
        step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
        print(f"timing {pack} H={H} qk_l2norm_fused={fused}: {start.elapsed_time(end) / iters:.2f} ms a step")
