"""Study (CPU): dbeta's heavy tail - how much of its error sits in the documents' last tokens, and how far each
arm is from the correctly rounded truth bf16(ref), the floor of any kernel that returns dbeta in bf16.

No bf16 value is nearer ref than bf16(ref), so per element |arm - ref| >= |bf16(ref) - ref|: an arm that
returns bf16(ref) on the tokens that hold ||dbeta|| cannot be beaten there by any bf16 output.

    python3 bench/studies/dbeta_tail.py --gate const-8 --beta-max 2 [--init] --seeds 8 \\
        --arms fixed,fixed:tape_dvp=hilo,fla

Per seed and arm: the error, its part in the last tokens (relative to all of ||ref||), the floor
||bf16(ref) - ref|| / ||ref||, the distance to bf16(ref), and the share of the last tokens' values equal to
bf16(ref); dv's and dg's error, and the share of ||dg error||^2 in its 4 largest elements. Inputs: the
suite's H = 4 pack (bench/numerics.py pack(2101)) unless --lens, one draw per seed.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import kda_emulation as E  # noqa: E402
from dh0_dbeta import SUITE_H4, arm_of  # noqa: E402


def tail_stats(got, ref, last):
    """got, ref: [T, H] dbeta; last: the documents' last token indices."""
    got, ref = got.double(), ref.double()
    floor = ref.to(torch.bfloat16).double()
    den = ref.norm()
    return dict(err=((got - ref).norm() / den).item(), last=((got - ref)[last].norm() / den).item(),
                floor=((floor - ref).norm() / den).item(), to_floor=((got - floor).norm() / den).item(),
                exact_last=(got[last] == floor[last]).double().mean().item())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gate", default="const-8")
    ap.add_argument("--beta-max", type=float, default=2.0)
    ap.add_argument("--init", action="store_true")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lens", default=",".join(map(str, SUITE_H4)), help="document lengths (default: the suite's)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--arms", default="fixed,fixed:tape_dvp=hilo,fla")
    a = ap.parse_args(argv)
    specs = a.arms.split(",")
    keys = ("err", "last", "floor", "to_floor", "exact_last", "dv", "dg", "dg_top4")
    agg = {s: {k: [] for k in keys} for s in specs}
    shares = []
    for i in range(a.seeds):
        seed = a.seed0 + i
        lens = [int(n) for n in a.lens.split(",")]
        x = E.make_inputs(lens, a.heads, a.gate, 1000 + seed, beta_max=a.beta_max, init=a.init)
        truth = E.truth(x)
        ref = truth["dbeta"][0]
        last = torch.tensor([c - 1 for c in x["cu"][1:]])
        shares.append(((ref[last] ** 2).sum() / (ref ** 2).sum()).item())
        for s in specs:
            kn = arm_of(s)
            res = E.run_fla(x) if kn is None else E.run_kda(x, kn)
            dg_err = (res["dg"].double() - truth["dg"]).flatten() ** 2
            st = dict(tail_stats(res["dbeta"][0], ref, last), dv=E.rel_rms(res["dv"], truth["dv"]),
                      dg=E.rel_rms(res["dg"], truth["dg"]), dg_top4=(dg_err.topk(4).values.sum() / dg_err.sum()).item())
            for k in keys:
                agg[s][k].append(st[k])
            print(f"seed {seed} {s:24s} " + " ".join(f"{k} {st[k]:.3e}" for k in keys), flush=True)
    med = statistics.median
    print(f"gate {a.gate} beta in [0, {a.beta_max}) init {a.init} H {a.heads} seeds {a.seeds} (from {a.seed0}); "
          f"share of ||ref||^2 in the last tokens: median {med(shares):.3f} (min {min(shares):.3f})")
    print(f"{'arm':24s} " + " ".join(f"{k + ' median (min..max)':>28s}" for k in keys))
    for s in specs:
        v = agg[s]
        print(f"{s:24s} " + " ".join(f"{med(v[k]):8.3e} ({min(v[k]):.2e}..{max(v[k]):.2e})" for k in keys))


if __name__ == "__main__":
    main()
