"""Where the chunk stage's cycles go: the test-only record kda_fwd_chunk/lean_prof (the shipped
`lean` with clock64 stamps at its phase ends, as thread 0 sees them) writes each CTA's cycles per
phase over gamma[c][h][0 .. 13]. Prints the mean and the 10th/90th percentiles over the CTAs of one
launch on the pack, and the launch time of `lean` beside it (CUDA events, median of 5).

  python bench/chunk_profile.py [pack] [heads]
"""
import sys

import torch

from bench.packs import PACKS
from bench.single import inputs
from kda_aot.schedule import kda

PHASES = ("load", "cumsum", "qg/kg out", "Akk/Aqk mma", "masks+bar", "diag 8x8 | Aqk out", "diag X",
          "diag M+bar", "inverse (tensor cores)", "T+bar", "K e^G+bar", "W mma", "U mma+bar", "W/U out")


def main():
    pack = sys.argv[1] if len(sys.argv) > 1 else "Q1"
    H = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    q, k, v, g, beta, cu = inputs(PACKS[pack], H)
    t = kda._chunk_stage_tensors(q, k, v, g, beta, cu.cpu(), None, None, True)
    ms = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kda._launch_chunk_stage(t, None)
        end.record()
        torch.cuda.synchronize()
        ms.append(start.elapsed_time(end))
    lean_ms = sorted(ms[1:])[2]
    ref = {name: t[name].clone() for name in ("w", "u", "qg", "kg", "aqk", "akk_inv")}
    kda._launch_chunk_stage(t, None, form="lean_prof")
    torch.cuda.synchronize()
    same = all(torch.equal(ref[name], t[name]) for name in ref)  # the stamps must not change the math
    cyc = t["gamma"][:, :, :len(PHASES)].reshape(-1, len(PHASES)).double()
    total = cyc.sum(1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = cyc.shape[0]
    print(f"{pack} H={H}: {ctas} CTAs, lean {lean_ms:.2f} ms; CTA cycles mean {total.mean():.0f} "
          f"(p10 {total.quantile(0.1):.0f}, p90 {total.quantile(0.9):.0f}); "
          f"{ctas / (2 * sms):.0f} waves of 2 CTAs/SM; profile build's outputs bitwise equal to lean: {same}")
    print("| phase | mean | p10 | p90 | share |")
    print("| --- | --- | --- | --- | --- |")
    for i, name in enumerate(PHASES):
        col = cyc[:, i]
        print(f"| {name} | {col.mean():.0f} | {col.quantile(0.1):.0f} | {col.quantile(0.9):.0f} | "
              f"{100 * col.mean() / total.mean():.1f} % |")


if __name__ == "__main__":
    main()
