"""One CP rank's pipelined forward on one GPU, without the other rank: when its exchange could go
(the senders' exit states and the summaries' inputs ready) and when its forward ends, for the
Options cp_exchange_beside and cp_piece_senders, arms interleaved.

  python bench/studies/cp_forward_local.py [Q2:contiguous:0,Q3:zigzag:1,..] [iters] [--replay]

A rank's local segments come from cp.make_plan (W = 2); inputs are random, H = 32; entering() is a
stand-in for the exchange (an event where the all_gather would be queued, random entering states for
the deferred segments). Prints, per rank layout and arm, the medians of `ready` (ms from the start to
that event) and `end` (ms to the forward's end). With two ranks the exchange goes at the later rank's
`ready`, and each rank's deferred walks follow it: this is the one-GPU part of that.
"""
import statistics
import sys
from types import SimpleNamespace

import torch

from bench.packs import HEAD_DIM, PACKS
from kda_aot import cp
from kda_aot import options
from kda_aot.cp.backends import CudaBackend

ARMS = {"old": (False, False), "beside": (True, False), "pieced": (False, True), "both": (True, True)}


def rank_inputs(pack, layout, rank, H, gen):
    lens = PACKS[pack]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    plan = cp.make_plan(cu, layout, world_size=2, rank=rank)
    T = plan.num_local_tokens
    q, k, v = (torch.randn(1, T, H, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    q, k = (x / x.float().norm(dim=-1, keepdim=True).to(x.dtype) for x in (q, k))
    g = -5 * torch.rand(1, T, H, HEAD_DIM, device="cuda", generator=gen)
    beta = torch.rand(1, T, H, device="cuda", generator=gen).to(torch.bfloat16)
    local = plan.local_fragments
    deferred = [f.segment for f in local if f.needs_state]
    senders = [f.segment for f in local if not f.needs_state and not f.is_last]
    summarised = [f.segment for f in local if f.needs_state and not f.is_last]  # as kda_aot.cp.collective
    known = torch.zeros(len(local), H, HEAD_DIM, HEAD_DIM, device="cuda")
    return (q, k, v, g, beta), list(plan.local_cu_seqlens), known, deferred, senders, summarised


def replay(which, iters, H, backend, gen):
    """--replay: the rank's CP replay (replay_pipelined: chunk stage and both walks), PIECE_SENDERS off / on
    (on: a rank's only chain in pieces too)."""
    for spec in which.split(","):
        pack, layout, rank = spec.split(":")
        xs, bounds, known, deferred, senders, summarised = rank_inputs(pack, layout, int(rank), H, gen)
        do = torch.randn_like(xs[2])
        dfinals = torch.randn_like(known) * 0.01
        times = {False: [], True: []}
        for i in range(iters + 2):
            for pieced in ((False, True) if i % 2 == 0 else (True, False)):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                with options.using(cp_piece_senders=pieced):
                    backend.replay_pipelined(*xs, bounds, HEAD_DIM ** -0.5, known, do, dfinals)
                end.record()
                torch.cuda.synchronize()
                if i >= 2:
                    times[pieced].append(start.elapsed_time(end))
        print(f"replay {pack} {layout} rank {rank}: segments {[b - a for a, b in zip(bounds, bounds[1:])]}: "
              f"cp_piece_senders off {statistics.median(times[False]):.2f} ms, on {statistics.median(times[True]):.2f} ms")


def main():
    args = [a for a in sys.argv[1:] if a != "--replay"]
    which = args[0] if args else "Q1:contiguous:0,Q1:contiguous:1,Q2:contiguous:0,Q3:zigzag:0,Q3:zigzag:1,Q6:contiguous:0"
    iters = int(args[1]) if len(args) > 1 else 10
    H, backend = 32, CudaBackend()
    gen = torch.Generator(device="cuda").manual_seed(11)
    if "--replay" in sys.argv:
        return replay(which, iters, H, backend, gen)
    for spec in which.split(","):
        pack, layout, rank = spec.split(":")
        xs, bounds, known, deferred, senders, summarised = rank_inputs(pack, layout, int(rank), H, gen)
        later = torch.randn(len(deferred), H, HEAD_DIM, HEAD_DIM, device="cuda", generator=gen) * 0.1
        times = {arm: ([], []) for arm in ARMS}
        for i in range(iters + 2):
            for arm, (beside, pieced) in (ARMS.items() if i % 2 == 0 else reversed(list(ARMS.items()))):
                arm_options = options.using(cp_exchange_beside=beside, cp_piece_senders=pieced)
                start, end, ready = (torch.cuda.Event(enable_timing=True) for _ in range(3))

                def entering(prepared, finals):
                    ready.record()  # on the stream the exchange would use, where it would be queued
                    return later
                torch.cuda.synchronize()
                start.record()
                with arm_options:
                    backend.forward_pipelined(*xs, bounds, HEAD_DIM ** -0.5, False, known, deferred,
                                              SimpleNamespace(run=entering),
                                              senders, summarised)
                end.record()
                torch.cuda.synchronize()
                if i >= 2:
                    times[arm][0].append(start.elapsed_time(ready))
                    times[arm][1].append(start.elapsed_time(end))
        print(f"{pack} {layout} rank {rank}: segments {[b - a for a, b in zip(bounds, bounds[1:])]} "
              f"senders {senders} deferred {deferred}")
        for arm, (r, e) in times.items():
            print(f"  {arm:7s} ready {statistics.median(r):6.2f}  end {statistics.median(e):6.2f} ms")


if __name__ == "__main__":
    main()
