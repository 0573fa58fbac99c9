"""Where a wgmma walk step's cycles go: the test-only record kda_fwd_tape/full_prof (the shipped
walk; --record full_vs_prof: the column-half split) sums clock64 per phase over the steps of CTA 0
and writes the means into the final state (warpgroup 0: elements 0-9, warpgroup 1: 16-25). One
launch per walk kind (output, output + tape, tape, bare), equal chains.

  python bench/walk_profile.py [--chunks 256] [--docs 4] [--heads 32] [--record full_prof]
"""
import argparse

import torch

from kda_aot import kda
from kda_aot.bench.single import inputs
from kda_aot.kda import CHUNK, chunk_kda_prepare, chunk_kda_walk

PHASES = ("issue", "S+tape", "stage wait", "bar1", "WS/QS", "V'", "bar2", "update+AqkV'", "O", "bar3")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--record", default="full_prof", help="full_prof (shipped walk) or full_vs_prof (column halves)")
    args = ap.parse_args()
    suffix = args.record.removeprefix("full")  # the walks below are planned full: `full` + suffix = the record
    kda._walk_suffix = lambda program: suffix if program == "kda_fwd_tape" else ""
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
            _, ht, _ = chunk_kda_walk(prepared, initial_state=h0, output_final_state=True, tape_form="full", **kw)
        torch.cuda.synchronize()
        row = ht[0, 0, 0].cpu()
        for wg in (0, 1):
            vals = row[16 * wg:16 * wg + 10].tolist()
            print(f"| {name} | {wg} | " + " | ".join(f"{x:.0f}" for x in vals) + f" | {sum(vals):.0f} |", flush=True)


if __name__ == "__main__":
    main()
