"""Where the state walks' step time goes: one full-width launch of kda_fwd_walk (with and without the
output stage, with and without the fp32 tape) and of kda_bwd_walk, over equal chains, for chain counts
and head counts that separate the per-CTA latency (few chains) from what the chains share (HBM, L2:
many chains) and from the [T, H, 128] layout (a chunk's rows of one head are H * 256 B apart).
Prints microseconds per chunk step (launch median / chunks per chain; every chain has its own SM).

  python bench/walk_sweep.py [--chunks 256]
"""
import argparse
import statistics

import torch

from bench.single import inputs
from kda_aot.schedule.kda import CHUNK, chunk_kda_prepare, chunk_kda_walk
from kda_aot.schedule.backward import chunk_kda_bwd_walk

# (documents, heads): chains = documents x heads, at most one full CTA per SM on 132 SMs
CONFIGS = ((1, 32), (8, 4), (32, 1), (4, 32), (64, 2), (128, 1))


def median_ms(fn, iters=12):
    times = []
    for i in range(iters + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=256, help="chunks per chain")
    args = ap.parse_args()
    n = args.chunks
    print(f"us per chunk step, {n}-chunk chains, full form, one launch")
    print("| docs | H | chains | fwd o | fwd o+tape | fwd tape (replay) | fwd bare (offset) | bwd dtape | bwd offset |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for docs, H in CONFIGS:
        q, k, v, g, beta, cu = inputs([CHUNK * n] * docs, H)
        prepared = chunk_kda_prepare(q, k, v, g, beta, cu_seqlens=cu, save_tape=True)
        h0 = torch.randn(docs, H, 128, 128, device="cuda")
        _, _, saved = chunk_kda_walk(prepared, initial_state=h0, save_tape=True, walk_form="full")
        dout = torch.randn_like(q)
        dht = torch.randn_like(h0)
        arms = {
            "fwd o": lambda: chunk_kda_walk(prepared, initial_state=h0, walk_form="full"),
            "fwd o+tape": lambda: chunk_kda_walk(prepared, initial_state=h0, save_tape=True, walk_form="full"),
            "fwd tape": lambda: chunk_kda_walk(prepared, initial_state=h0, save_tape=True, want_output=False,
                                               walk_form="full"),
            "fwd bare": lambda: chunk_kda_walk(prepared, initial_state=h0, output_final_state=True,
                                               want_output=False, walk_form="full"),
            "bwd dtape": lambda: chunk_kda_bwd_walk(saved, dout, dht, walk_form="full"),
            "bwd offset": lambda: chunk_kda_bwd_walk(saved, dout, dht, need_dtape=False, walk_form="full"),
        }
        us = {name: 1000 * median_ms(fn) / n for name, fn in arms.items()}
        print(f"| {docs} | {H} | {docs * H} | " + " | ".join(f"{x:.2f}" for x in us.values()) + " |", flush=True)
        del prepared, saved


if __name__ == "__main__":
    main()
