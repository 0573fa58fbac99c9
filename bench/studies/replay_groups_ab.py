"""A/B of the replay backward's head groups at H = 64 (docs/backward.md, "Head groups"): the shipped rule, one
pass over every head when it fits without a group's input copies, against groups of `max_heads` value heads
(Options.max_heads), which copy their inputs and gradients. Interleaved CUDA-event medians of the single suite's
replay step (bench/step_time.py), each arm's peak memory and the groups it ran.

    python3 bench/studies/replay_groups_ab.py [Q1] [heads 64] [max_heads 32] [iters 4]
"""
import sys

import torch

from bench.common import interleaved, peak_gib
from bench.step_time import step_of
from kda_aot.options import using
from kda_aot.schedule import backward


def main():
    pack = sys.argv[1] if len(sys.argv) > 1 else "Q1"
    H = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    cap = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    iters = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    step = step_of("replay", pack, H)

    def arm(max_heads):
        def run():
            with using(max_heads=max_heads):
                step()
        return run
    arms = {"shipped": arm(0), f"groups of {cap}": arm(cap)}
    for name, fn in arms.items():
        peak = peak_gib(fn)
        print(pack, H, name, f"peak {peak:.1f} GiB groups {list(backward._LAST_GROUPS.values())[-1]}", flush=True)
    ms = interleaved(arms, iters=iters, warmup=1)
    print(pack, H, " ".join(f"{name} {t:.2f} ms" for name, t in ms.items()), flush=True)


if __name__ == "__main__":
    main()
