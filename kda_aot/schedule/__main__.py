"""python -m kda_aot.schedule --explain PACK|LENGTHS HEADS [--sms N] [--cp SENDERS DEFERRED [--beside]]: the
launch plans of one training step on a pack (a bench pack name such as Q1, in a checkout, or document lengths
in tokens, comma separated): the pipelined forward, the replay's walks, and the fit rule's walk forms for each
launch. --cp: the pack as one rank's local segments under context parallelism, SENDERS the segments whose exit
state others wait for and DEFERRED those that wait for the exchange (comma-separated indices, "-" for none):
the CP forward's plan with its exchange node (--beside: on a stream of its own) and the pieced CP replay."""
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


def _indices(text: str, n: int) -> tuple:
    picked = () if text.strip() == "-" else tuple(sorted(int(x) for x in text.split(",") if x.strip()))
    if any(not 0 <= s < n for s in picked):
        raise SystemExit(f"--cp: segment indices must lie in [0, {n}), got {text!r}")
    return picked


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kda_aot.schedule", description=__doc__)
    ap.add_argument("--explain", nargs=2, metavar=("PACK", "HEADS"), required=True)
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU (default: an H200's 132)")
    ap.add_argument("--cp", nargs=2, metavar=("SENDERS", "DEFERRED"), help="one CP rank's plans")
    ap.add_argument("--beside", action="store_true", help="with --cp: the exchange on a stream of its own")
    args = ap.parse_args(argv)
    lengths, heads = _lengths(args.explain[0]), int(args.explain[1])
    chains = [-(-n // CHUNK) for n in lengths if n > 0]
    print(f"pack: {len(lengths)} documents, {sum(lengths)} tokens, {sum(chains)} chunks; H = {heads}, "
          f"{args.sms} SMs")
    if args.cp:
        senders, deferred = (_indices(x, len(chains)) for x in args.cp)
        plans = (forward_plan(chains, heads, args.sms, first=senders, deferred=deferred, cp=True,
                              exchange_beside=args.beside),
                 replay_plan(chains, heads, args.sms, pieced=True))
    else:
        plans = forward_plan(chains, heads, args.sms), replay_plan(chains, heads, args.sms)
    for plan, programs in zip(plans, (("kda_fwd_walk",), ("kda_fwd_walk", "kda_bwd_walk"))):
        print(plan.explain())
        for g, (a, b) in enumerate(plan.groups):
            if all(s in plan.deferred for s in range(a, b)):
                continue  # walked after the exchange, on the device's SMs
            for prog in programs:
                forms = fit.plan_walk(prog, chains[a:b], heads, plan.sms_of(prog, g))
                print(f"      group {g} {prog}: " + ", ".join(f"{form} over segments [{a + x}, {a + y})"
                                                          for form, x, y in forms))


if __name__ == "__main__":
    main()
