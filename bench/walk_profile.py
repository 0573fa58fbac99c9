"""Where a walk step's cycles go: the test-only record kda_fwd_walk/full_prof (the shipped full form)
sums clock64 per phase over the steps of CTA 0 and writes the means into the final state
(warpgroup 0: elements 0-9, warpgroup 1: 16-25). One launch per walk kind (output, output + tape,
tape, bare), equal chains, planned full.

  python bench/walk_profile.py [--chunks 256] [--docs 4] [--heads 32]
"""
import argparse

import torch

from bench.single import inputs
from kda_aot._runtime import registry
from kda_aot.schedule.kda import CHUNK, chunk_kda_prepare, chunk_kda_walk

PHASES = ("issue", "S+tape", "stage wait", "bar1", "WS/QS", "V'", "bar2", "update+AqkV'", "O", "bar3")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    args = ap.parse_args()
    library = registry.library  # the walks below are planned full: kda_fwd_walk/full -> full_prof
    registry.library = lambda program, form="default", device=None: library(
        program, "full_prof" if (program, form) == ("kda_fwd_walk", "full") else form, device)
    q, k, v, g, beta, cu = inputs([CHUNK * args.chunks] * args.docs, args.heads)
    prepared = chunk_kda_prepare(q, k, v, g, beta, cu_seqlens=cu, save_tape=True)
    h0 = torch.randn(args.docs, args.heads, 128, 128, device="cuda")
    kinds = {"o": dict(), "o+tape": dict(save_tape=True), "tape": dict(save_tape=True, want_output=False),
             "bare": dict(want_output=False)}
    print(f"cycles per step (clock64, CTA 0), {args.docs} x {args.heads} chains of {args.chunks} chunks")
    print("| walk | warpgroup | " + " | ".join(PHASES) + " | sum |")
    print("| --- | --- | " + " | ".join("---" for _ in PHASES) + " | --- |")
    for name, kw in kinds.items():
        for _ in range(2):  # the second launch is the one read
            _, ht, _ = chunk_kda_walk(prepared, initial_state=h0, output_final_state=True, walk_form="full", **kw)
        torch.cuda.synchronize()
        row = ht[0, 0, 0].cpu()
        for wg in (0, 1):
            vals = row[16 * wg:16 * wg + 10].tolist()
            print(f"| {name} | {wg} | " + " | ".join(f"{x:.0f}" for x in vals) + f" | {sum(vals):.0f} |", flush=True)


if __name__ == "__main__":
    main()
