"""The replay backward's head groups at H = 64 (docs/backward.md, "Head groups").

ab: the shipped rule (one pass over every head when it fits without a group's input copies) against groups of
    `max_heads` value heads (Options.max_heads), which copy their inputs and gradients, and against runs of whole
    segments of at most half the pack's tokens (Options.max_tokens), which read views and write their rows of the
    whole gradients.
    Interleaved CUDA-event medians of the single suite's replay step (bench/step_time.py), each arm's peak
    memory and its groups.
tight: the one pass with a ballast tensor that leaves just what the rule asks for (the estimate over the 15 %
    margin, plus 0.1 %), so the rule still picks one pass: it must run without running out of memory. Prints
    the estimate against what the backward allocated above its start.

    python3 bench/studies/replay_groups_ab.py ab|tight [Q1] [heads 64] [max_heads 32] [iters 4]
"""
import sys

import torch

from bench.common import interleaved, peak_gib
from bench.packs import PACKS
from bench.step_time import step_of
from kda_aot.options import using
from kda_aot.schedule import backward

GiB = 2 ** 30


def ab(pack, H, cap, iters):
    step = step_of("replay", pack, H)

    def arm(**groups):
        def run():
            with using(**groups):
                step()
        return run
    T = sum(PACKS[pack])
    arms = {"shipped": arm(), f"heads {cap}": arm(max_heads=cap), f"tokens {T // 2}": arm(max_tokens=T // 2)}
    for name, fn in arms.items():
        peak = peak_gib(fn)
        print(pack, H, name, f"peak {peak:.1f} GiB groups {list(backward._LAST_TILES.values())[-1]}", flush=True)
    ms = interleaved(arms, iters=iters, warmup=1)
    print(pack, H, " ".join(f"{name} {t:.2f} ms" for name, t in ms.items()), flush=True)


def tight(pack, H):
    step = step_of("replay", pack, H)
    seen = {}
    rule = backward.replay_tiles

    def recording(bounds, lengths, H, G, available, gradient_bytes, *limits):
        seen.update(allocated=torch.cuda.memory_allocated(), available=available, T=bounds[-1], chunks=sum(lengths),
                    segments=len(lengths))
        return rule(bounds, lengths, H, G, available, gradient_bytes, *limits)
    backward.replay_tiles = recording
    try:
        step()
        torch.cuda.synchronize()
        estimate = H * backward.replay_bytes_per_head(seen["T"], seen["chunks"], seen["segments"], grouped=False)
        spare = seen["available"] / 0.85 - estimate / 0.85 * 1.001
        print(f"{pack} H {H}: estimate {estimate / GiB:.2f} GiB, available {seen['available'] / GiB:.2f} GiB; "
              f"ballast {spare / GiB:.2f} GiB", flush=True)
        torch.cuda.empty_cache()
        ballast = torch.empty(int(spare), dtype=torch.uint8, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        above = torch.cuda.max_memory_allocated() - seen["allocated"]
        print(f"{pack} H {H} tight: tiles {list(backward._LAST_TILES.values())[-1]}, available "
              f"{seen['available'] / GiB:.2f} GiB, the backward's peak above its start {above / GiB:.2f} GiB "
              f"({above / estimate:.3f} of the estimate), device peak {torch.cuda.max_memory_allocated() / GiB:.1f}"
              f" GiB", flush=True)
        del ballast
    finally:
        backward.replay_tiles = rule


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "ab"
    pack = sys.argv[2] if len(sys.argv) > 2 else "Q1"
    H = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    if what == "tight":
        tight(pack, H)
    else:
        ab(pack, H, int(sys.argv[4]) if len(sys.argv) > 4 else 32, int(sys.argv[5]) if len(sys.argv) > 5 else 4)


if __name__ == "__main__":
    main()
