"""Wall time and peak memory of one KDA training step on kda_aot alone, per pack, for an A/B of a schedule or
kernel change between two trees (bench/patch_ab.sh's `cmd` step reads the `timing` lines):

    replay     chunk_kda on the log decay and beta given, backward="replay" (the single suite's step)
    gate       the same step with the raw bf16 gate (A_log, dt_bias) and beta's logits activated in the kernels
    fla_layer  the call FLA's KimiDeltaAttention layer makes: the raw bf16 gate with A_log and dt_bias and beta's
               logits activated in the kernels, q and k L2-normalised in the call (its replay backward)

CUDA events around the forward + backward from an idle GPU (what bench/fla_layer.py times as the layer's call),
medians of --iters, fresh random inputs each run; prints `timing PACK CALL MS PEAK_GIB`. --busy-start adds a row
`busy_start PACK CALL MS`: the same step with the GPU kept busy while the host issues it (the difference is the
host time an idle GPU waits for).

    python3 bench/step_time.py [--pack Q1,Q2 | all] [--calls replay,gate,fla_layer] [--iters 10] [--heads 32] [--busy-start]
"""
import argparse

import torch

from bench.common import interleaved, peak_gib
from bench.packs import PACKS
from bench.single import inputs, training_call
from kda_aot import chunk_kda

CALLS = ("replay", "gate", "fla_layer")


def step_of(call: str, pack: str, H: int):
    """A training step's callable (forward, then backward of o against a fixed random do)."""
    q, k, v, g, beta, cu = inputs(PACKS[pack], H)
    cu_host = cu.cpu()
    leaves, kw = training_call(q, k, v, g, beta, "log_decay" if call == "replay" else call)
    do = torch.randn_like(v)

    def step():
        for x in leaves:
            x.grad = None
        chunk_kda(*leaves[:5], cu_seqlens=cu_host, **kw)[0].backward(do)
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", default="Q1", help="Q1[,Q2..] or all")
    ap.add_argument("--calls", default=",".join(CALLS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--busy-start", action="store_true", help="also time each step issued beside a 60 ms sleep kernel")
    a = ap.parse_args(argv)
    packs = sorted(PACKS) if a.pack == "all" else a.pack.split(",")
    calls = a.calls.split(",")
    for name in calls:
        if name not in CALLS:
            ap.error(f"--calls: expected some of {CALLS}, got {name!r}")
    if not torch.cuda.is_available():
        raise SystemExit("bench/step_time.py times the kernels: it needs a CUDA GPU")
    for pack in packs:
        for call in calls:
            step = step_of(call, pack, a.heads)
            peak = peak_gib(step)
            ms = interleaved({call: step}, iters=a.iters, warmup=2)[call]
            print(f"timing {pack} {call} {ms:.3f} {peak:.1f}", flush=True)
            if a.busy_start:
                busy = interleaved({call: step}, iters=a.iters, warmup=1, busy_start_ms=60)[call]
                print(f"busy_start {pack} {call} {busy:.3f}", flush=True)
            del step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
