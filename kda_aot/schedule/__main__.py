"""python -m kda_aot.schedule --explain PACK|LENGTHS HEADS [--sms N]: the launch plans of one training
step on a pack (a bench pack name such as Q1, in a checkout, or document lengths in tokens, comma
separated): the pipelined forward, the replay's walks, and the fit rule's walk forms for each launch."""
import argparse
import sys
from pathlib import Path

from .._runtime.packing import CHUNK
from . import fit
from .plan import forward_plan, replay_plan


def _lengths(text: str) -> list:
    if text.replace(",", "").strip().isdigit():
        return [int(x) for x in text.split(",") if x.strip()]
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "bench" / "packs.py").exists():
        raise SystemExit(f"{text!r}: not lengths, and no bench/packs.py beside this package (a checkout)")
    sys.path.insert(0, str(checkout))
    from bench.packs import PACKS
    if text not in PACKS:
        raise SystemExit(f"{text!r}: not a pack of bench/packs.py ({', '.join(sorted(PACKS))})")
    return list(PACKS[text])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kda_aot.schedule", description=__doc__)
    ap.add_argument("--explain", nargs=2, metavar=("PACK", "HEADS"), required=True)
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU (default: an H200's 132)")
    args = ap.parse_args(argv)
    lengths, heads = _lengths(args.explain[0]), int(args.explain[1])
    chains = [-(-n // CHUNK) for n in lengths if n > 0]
    print(f"pack: {len(lengths)} documents, {sum(lengths)} tokens, {sum(chains)} chunks; H = {heads}, "
          f"{args.sms} SMs")
    for plan, programs in ((forward_plan(chains, heads, args.sms), ("kda_fwd_walk",)),
                           (replay_plan(chains, heads, args.sms), ("kda_fwd_walk", "kda_bwd_walk"))):
        print(plan.explain())
        for g, (a, b) in enumerate(plan.groups):
            for prog in programs:
                forms = fit.plan_walk(prog, chains[a:b], heads, plan.sms_of(prog, g))
                print(f"      group {g} {prog}: " + ", ".join(f"{form} over segments [{a + x}, {a + y})"
                                                          for form, x, y in forms))


if __name__ == "__main__":
    main()
