"""Study (CPU): where kda_aot's extra dh0 / dbeta error enters, by emulation (kda_emulation.py), per seed.

Inputs as the GPU numerics suite draws them (bench/numerics.py: documents of 1, 63, 64, 65, 1,000+ tokens and
two more in a seeded order, a final-state gradient always, h0 = 0.1 randn with --init), one pack and input
draw per seed. Every arm runs on the same inputs, so the arms' ratios are paired: the table gives each arm's
median error over the seeds, its median ratio to the first arm and to FLA (with the ratio's min..max over
seeds) and how many seeds it beat FLA on.

    python3 bench/studies/dh0_dbeta.py --gate unif-5 --init --seeds 8
    python3 bench/studies/dh0_dbeta.py --gate const-8 --beta-max 2 --outputs dbeta \\
        --arms fixed,fixed:w_beta=kv,fla
Arms: fixed (the kernels now), fla, or fixed:knob=value+knob=value (kda_emulation.py --list).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import kda_emulation as E  # noqa: E402

SUITE_H4 = [64, 1, 65, 63, 1519, 119, 130]  # bench/numerics.py pack(2101), the H = 4 cases' pack


def pack(seed: int) -> list:
    """bench/numerics.py pack(): documents of 1, 63, 64, 65 and 1,000+ tokens (and two more), seeded order."""
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 63, 64, 65, 1000 + int(torch.randint(0, 600, (1,), generator=gen)),
            int(torch.randint(2, 300, (1,), generator=gen)), 130]
    return [lens[i] for i in torch.randperm(len(lens), generator=gen).tolist()]


def arm_of(spec):
    if spec == "fla":
        return None
    base, _, over = spec.partition(":")
    kn = dict({"fixed": E.FIXED, "shipped": E.SHIPPED}[base])
    for item in filter(None, over.split("+")):
        key, val = item.split("=")
        if key not in kn:
            raise SystemExit(f"unknown knob {key}")
        kn[key] = None if val == "none" else float(val) if key == "gate_clamp" else val
    return kn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gate", default="unif-5")
    ap.add_argument("--beta-max", type=float, default=1.0)
    ap.add_argument("--init", action="store_true")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--pack", default="random", help="random (pack(seed) per seed) | suite (the H = 4 suite's) | "
                                                     "comma list of lengths")
    ap.add_argument("--outputs", default="dh0,dbeta")
    ap.add_argument("--arms", default="fixed,fla")
    ap.add_argument("--per-seed", action="store_true")
    ap.add_argument("--split-last", action="store_true",
                    help="also dbeta's error in the documents' last tokens alone (dbeta_last, relative to all of ||dbeta||)"
                         " and the share of ||dbeta_ref||^2 there")
    a = ap.parse_args(argv)
    specs = a.arms.split(",")
    arms = [(s, arm_of(s)) for s in specs]
    outs = a.outputs.split(",") + (["dbeta_last"] if a.split_last else [])
    share = []
    err = {s: {o: [] for o in outs} for s in specs}
    t0 = time.time()
    for i in range(a.seeds):
        seed = a.seed0 + i
        lens = (SUITE_H4 if a.pack == "suite" else pack(2101 + seed) if a.pack == "random"
                else [int(x) for x in a.pack.split(",")])
        x = E.make_inputs(lens, a.heads, a.gate, 1000 + seed, beta_max=a.beta_max, init=a.init)
        ref = E.truth(x)
        for s, kn in arms:
            res = E.run_fla(x) if kn is None else E.run_kda(x, kn)
            e = E.errors(res, ref)
            if a.split_last:
                last = torch.tensor([c - 1 for c in x["cu"][1:]])
                r = ref["dbeta"][0]
                e["dbeta_last"] = ((res["dbeta"][0].double() - r)[last].norm() / r.norm()).item()
                if s == specs[0]:
                    share.append(((r[last] ** 2).sum() / (r ** 2).sum()).item())
            for o in outs:
                err[s][o].append(e.get(o, float("nan")))
        if a.per_seed:
            print(f"seed {seed} lens {lens}: " + "  ".join(
                f"{s}: " + " ".join(f"{err[s][o][-1]:.3e}" for o in outs) for s in specs), flush=True)
    print(f"gate {a.gate} beta in [0, {a.beta_max}) init {a.init} H {a.heads} seeds {a.seeds} (from {a.seed0}) "
          f"pack {a.pack}  ({time.time() - t0:.0f} s)")
    med = statistics.median
    if share:
        print(f"  share of ||dbeta_ref||^2 in the documents' last tokens: median {med(share):.3f}")
    w = max(22, max(len(s) for s in specs))
    for o in outs:
        print(f"  {o}: {'arm':{w}s} {'median':>9s}  {'x first (min..max)':>22s}  {'x fla (min..max)':>22s}  <fla")
        base = err[specs[0]][o]
        fla = err["fla"][o] if "fla" in err else None
        for s in specs:
            v = err[s][o]
            r1 = [x / b for x, b in zip(v, base)]
            line = f"  {'':{len(o)}s}  {s:{w}s} {med(v):9.3e}  {med(r1):6.3f} ({min(r1):.3f}..{max(r1):.3f})"
            if fla is not None:
                rf = [x / b for x, b in zip(v, fla)]
                wins = sum(x < b for x, b in zip(v, fla))
                line += f"  {med(rf):6.3f} ({min(rf):.3f}..{max(rf):.3f})  {wins}/{len(v)}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
