"""`python -m kda_aot`: what this install is, and the fp64 reference KDA + conv training step on a
small pack (on the GPU when there is one, else on the CPU). The benchmarks live in the checkout's
`bench` package (`python -m bench`; `bash scripts/main.sh` runs them with a GPU).
"""
from __future__ import annotations

import json
import sys
import time

import torch

from . import __version__, reference
from ._lib import ARCH


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


def main(argv=None) -> int:
    import argparse
    argparse.ArgumentParser(prog="python -m kda_aot", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    built = "nothing built yet" if ARCH == "source" else f"kernels for {ARCH}"
    print(f"kda_aot {__version__} ({built}), torch {torch.__version__}")
    if torch.cuda.is_available():
        device = "cuda"
        print(f"kda_aot: GPU {torch.cuda.get_device_name()}")
    else:
        device = "cpu"
        print("kda_aot: no CUDA GPU on this machine; running the fp64 reference on the CPU.")
    print(f"reference KDA + conv training step (fp64, {device}), pack of 4 documents:")
    print(json.dumps(reference_step(device), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
