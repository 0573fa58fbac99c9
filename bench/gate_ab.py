"""A/B of the gated backward half: kda_bwd_gate full (one CTA per (chunk, head)), full_staged (its bf16
inputs in shared memory), split (two CTAs over 64 channels each) and split_staged (shipped), interleaved, on
one pack; the rest of chunk_kda_bwd is the same in all."""
import sys

import torch

from kda_aot.bench.common import interleaved
from kda_aot.bench.packs import PACKS
from kda_aot.bench.single import inputs
from kda_aot.kda import GATE_FORMS, chunk_kda_bwd, chunk_kda_fwd

pack = sys.argv[1] if len(sys.argv) > 1 else "Q1"
H = int(sys.argv[2]) if len(sys.argv) > 2 else 32
q, k, v, g, beta, cu = inputs(PACKS[pack], H)
_, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, save_tape=True)
do = torch.randn_like(q)
ms = interleaved({form: (lambda f=form: chunk_kda_bwd(saved, do, gate_form=f)) for form in GATE_FORMS},
                 iters=7, warmup=1)
print(f"{pack} H={H} chunk_kda_bwd: " + ", ".join(f"{f} {t:.2f} ms" for f, t in ms.items()))
