"""The main job: `python -m kda_aot`.

With a GPU: the packed KDA training step (`kda_aot.chunk_kda`, forward and forward + backward in
both backward modes) on pack Q1 with H = 32, and the conv1d + SiLU training step on Q1 with
D = 12,288, each timed side by side with flash-linear-attention when it is installed, then the
reference KDA training step on a small packed example. Without a GPU it says so and runs the
reference (KDA forward + backward, conv forward + backward) on a small pack on the CPU.
"""
from __future__ import annotations

import json
import sys
import time

import torch

from . import reference


def reference_step(device: str) -> dict:
    """One KDA + conv training step of the fp64 reference on a small pack of 4 documents."""
    lens, H, K, D = [1, 63, 65, 130], 2, 128, 64
    T = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0)
    gen = torch.Generator(device=device).manual_seed(0)
    f64 = dict(device=device, dtype=torch.float64)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen, **f64), dim=-1).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen, **f64), dim=-1).requires_grad_()
    v = torch.randn(1, T, H, K, generator=gen, **f64).requires_grad_()
    g = (-5 * torch.rand(1, T, H, K, generator=gen, **f64)).requires_grad_()
    beta = torch.rand(1, T, H, generator=gen, **f64).requires_grad_()
    t0 = time.perf_counter()
    o, final = reference.kda_chunked(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    (o.square().sum() + final.square().sum()).backward()
    o_rec, final_rec = reference.kda_recurrent(q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(),
                                               cu_seqlens=cu, output_final_state=True)
    x = torch.randn(1, T, D, generator=gen, **f64).requires_grad_()
    w = torch.randn(D, 4, generator=gen, **f64).requires_grad_()
    y = reference.conv1d_silu(x, w, cu_seqlens=cu)
    y.sum().backward()
    return {
        "pack": lens, "heads": H, "T": T,
        "chunked_vs_recurrent_rel_err": ((o.detach() - o_rec).abs().max() / o_rec.abs().max()).item(),
        "final_state_rel_err": ((final.detach() - final_rec).abs().max() / final_rec.abs().max()).item(),
        "grad_norms": {n: t.grad.norm().item() for n, t in (("q", q), ("k", k), ("v", v), ("g", g),
                                                              ("beta", beta), ("conv_x", x), ("conv_w", w))},
        "seconds": round(time.perf_counter() - t0, 3),
    }


def main() -> int:
    if not torch.cuda.is_available():
        print("kda_aot: no CUDA GPU on this machine; running the fp64 reference on a small pack (CPU).")
        print(json.dumps(reference_step("cpu"), indent=2))
        return 0
    print(f"kda_aot: GPU {torch.cuda.get_device_name()}")
    from .bench import conv, single
    from .bench.common import write_rows
    for suite, rows in (("single", single.run(packs=("Q1",), H=32, iters=10)), ("conv", conv.run(pack="Q1"))):
        for r in rows:
            print(json.dumps(r, sort_keys=True))
        print(f"rows written to {write_rows(rows, suite)}")
    print("reference KDA step (fp64, GPU):")
    print(json.dumps(reference_step("cuda"), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
