"""A/B of kernel forms on one pack, interleaved (CUDA-event medians), the rest of the call the same:
  replay: an unpipelined replay training step (chunk_kda forward + backward, Options.pipeline off, as CP's
         replay) with the two walks side by side (default) and one after the other (Options.replay_overlap off);
  gate:  kda_bwd_gate forms (GATE_FORMS: split_staged (shipped), full) timing the whole chunk_kda_bwd;
  pipeline: the forward (chunk_kda_fwd, output and final state) and training steps (saved, replay)
         pipelined (a segment group's walks beside the later groups' chunk stage; two rules for the
         walks' SMs) and in the plain order;
    python bench/forms_ab.py [gate|replay|pipeline|all] [pack[,pack..]] [heads]
"""
import sys

import torch

from bench.common import interleaved, with_options
from kda_aot import options
from bench.packs import PACKS
from bench.single import inputs
from kda_aot._runtime import registry
from kda_aot.schedule.kda import GATE_FORMS, chunk_kda_fwd
from kda_aot.schedule.backward import chunk_kda_bwd


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    packs = sys.argv[2] if len(sys.argv) > 2 else "Q1"
    H = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    for pack in packs.split(","):
        ab(what, pack, H)
        torch.cuda.empty_cache()


def ab(what, pack, H):
    q, k, v, g, beta, cu = inputs(PACKS[pack], H)
    cu = cu.cpu()
    _, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, save_tape=True)
    do = torch.randn_like(q)
    if what in ("replay", "all"):
        replay_ab(q, k, v, g, beta, cu, pack, H)
    if what in ("pipeline", "all"):
        pipeline_ab(q, k, v, g, beta, cu, pack, H)
    if what in ("gate", "all"):
        forms = registry.built_forms("kda_bwd_gate", GATE_FORMS)
        ms = interleaved({f: (lambda f=f: chunk_kda_bwd(saved, do, gate_form=f)) for f in forms}, iters=7, warmup=1)
        print(f"{pack} H={H} chunk_kda_bwd: " + ", ".join(f"{f} {t:.2f} ms" for f, t in ms.items()))


def replay_ab(q, k, v, g, beta, cu, pack, H):
    from kda_aot import chunk_kda
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
    do = torch.randn_like(q)

    def step():
        for x in leaves:
            x.grad = None
        chunk_kda(*leaves, cu_seqlens=cu, backward="replay")[0].backward(do)
    ms = interleaved({"walks side by side": with_options(step, pipeline=False, replay_overlap=True),
                      "one after the other": with_options(step, pipeline=False, replay_overlap=False)},
                     iters=7, warmup=1)
    print(f"{pack} H={H} replay step: " + ", ".join(f"{f} {t:.2f} ms" for f, t in ms.items()))


def pipeline_ab(q, k, v, g, beta, cu, pack, H):
    """The pipelined order (the shipped plan, kda_aot.schedule.plan) against the plain order (variants that
    lost are in docs/fit_rule.md: every walk restricted to its chains' SMs, the last group on the SMs
    the others leave it, the replay's backward stages pipelined too)."""
    from kda_aot import chunk_kda
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
    do = torch.randn_like(q)
    arms = {"pipelined": True, "plain": False}

    def arm(name, mode):
        def run():
            with options.using(pipeline=arms[name]):
                if mode == "forward":
                    chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
                    return
                for x in leaves:
                    x.grad = None
                chunk_kda(*leaves, cu_seqlens=cu, backward=mode)[0].backward(do)
        return run
    for mode in ("forward", "saved", "replay"):
        ms = interleaved({name: arm(name, mode) for name in arms}, iters=9 if mode == "forward" else 7, warmup=1)
        print(f"{pack} H={H} {mode}{'' if mode == 'forward' else ' step'}: "
              + ", ".join(f"{f} {t:.2f} ms" for f, t in ms.items()))


if __name__ == "__main__":
    main()
