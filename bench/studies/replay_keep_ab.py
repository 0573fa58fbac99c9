"""A/B of what the replay's forward keeps (docs/backward.md, "Replay: what the forward keeps"): the shipped op,
whose forward keeps tril(Aqk) and inv_pack for the replay's chunk stage, against the same op called without
`keep` (the replay then forms Akk, Aqk and the inverse again).
Interleaved CUDA-event medians of a training step and each arm's peak memory, per pack and call
(bench/step_time.py's steps: `fla_layer` is FLA's layer call, `replay` the single suite's step).

    python3 bench/studies/replay_keep_ab.py [Q1,Q6] [iters]
"""
import sys

import torch

import kda_aot.ops.chunk_kda as op_layer
from bench.common import interleaved, peak_gib
from bench.step_time import step_of

shipped = op_layer.chunk_kda_fwd_op


def without_keep(*args, keep=False, **kw):
    return shipped(*args, **kw)


def main():
    packs = sys.argv[1] if len(sys.argv) > 1 else "Q1,Q6"
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    try:
        for pack in packs.split(","):
            for call in ("fla_layer", "replay"):
                step = step_of(call, pack, 32)

                def arm(fwd_op):
                    def run():
                        op_layer.chunk_kda_fwd_op = fwd_op
                        step()
                    return run
                arms = {"keep": arm(shipped), "recompute": arm(without_keep)}
                peaks = {name: peak_gib(fn) for name, fn in arms.items()}
                ms = interleaved(arms, iters=iters, warmup=1)
                print(pack, call, " ".join(f"{name} {t:.2f} ms ({peaks[name]:.1f} GiB)" for name, t in ms.items()),
                      flush=True)
                del step
                torch.cuda.empty_cache()
    finally:
        op_layer.chunk_kda_fwd_op = shipped


if __name__ == "__main__":
    main()
