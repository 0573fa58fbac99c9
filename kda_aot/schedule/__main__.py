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
from .kda import MAX_HEADS
from .plan import forward_plan, replay_plan


def _lengths(text: str) -> list:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if parts and all(x.lstrip("+-").isdigit() for x in parts):  # numbers: document lengths, each >= 0
        lengths = [int(x) for x in parts]
        if any(n < 0 for n in lengths):
            raise SystemExit(f"{text!r}: document lengths must be >= 0")
        return lengths
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "bench" / "packs.py").exists():
        raise SystemExit(f"{text!r}: neither document lengths (comma-separated token counts, e.g. 100,2000,30) nor a "
                         "pack name (pack names such as Q1 need a checkout's bench/packs.py)")
    sys.path.insert(0, str(checkout))
    from bench.packs import PACKS
    if text not in PACKS:
        raise SystemExit(f"{text!r}: not a pack of bench/packs.py ({', '.join(sorted(PACKS))})")
    return list(PACKS[text])


def _indices(ap, text: str, n: int) -> tuple:
    try:
        picked = () if text.strip() == "-" else tuple(sorted(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        ap.error(f"--cp: expected comma-separated segment indices or '-', got {text!r}")
    if any(not 0 <= s < n for s in picked):
        ap.error(f"--cp: segment indices must lie in [0, {n}), got {text!r}")
    return picked


LEGEND = """
SMs: the budget a group's walks are planned on; the fit rule's forms run one CTA per (segment, head) (full),
two (split) or four (quarter). The replay runs each group's forward and backward walks at the same time, on
half the SMs each. Groups are the launch groups of consecutive segments, numbered in launch order (the longest
walks first; under CP the senders' segments before them)."""


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kda_aot.schedule", description=__doc__)
    ap.add_argument("--explain", nargs=2, metavar=("PACK", "HEADS"), required=True)
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU (default: an H200's 132)")
    ap.add_argument("--cp", nargs=2, metavar=("SENDERS", "DEFERRED"), help="one CP rank's plans")
    ap.add_argument("--beside", action="store_true", help="with --cp: the exchange on a stream of its own")
    args = ap.parse_args(argv)
    if args.beside and not args.cp:
        ap.error("--beside: only with --cp (the exchange is a context-parallel node)")
    try:
        heads = int(args.explain[1])
    except ValueError:
        ap.error(f"HEADS: expected an integer, got {args.explain[1]!r}")
    if not 1 <= heads <= MAX_HEADS:
        ap.error(f"HEADS: chunk_kda takes 1 .. {MAX_HEADS} heads, got {heads}")
    if args.sms < 1:
        ap.error(f"--sms: expected a positive count, got {args.sms}")
    lengths = _lengths(args.explain[0])
    if not any(lengths):
        ap.error(f"PACK: no tokens in {args.explain[0]!r}")
    chains = [-(-n // CHUNK) for n in lengths if n > 0]
    print(f"pack: {len(lengths)} documents, {sum(lengths)} tokens, {sum(chains)} chunks; H = {heads}, "
          f"{args.sms} SMs")
    if args.cp:
        senders, deferred = (_indices(ap, x, len(chains)) for x in args.cp)
        plans = (forward_plan(chains, heads, args.sms, first=senders, deferred=deferred, cp=True,
                              exchange_beside=args.beside),
                 replay_plan(chains, heads, args.sms, pieced=True))
    else:
        plans = forward_plan(chains, heads, args.sms), replay_plan(chains, heads, args.sms)
    for plan in plans:
        programs = [program for program, _ in plan.walk_sms]
        print(plan.explain())
        for g, (a, b) in enumerate(plan.groups):
            if all(s in plan.deferred for s in range(a, b)):
                continue  # walked after the exchange, on the device's SMs
            for prog in programs:
                forms = fit.plan_walk(prog, chains[a:b], heads, plan.sms_of(prog, g))
                print(f"      group {g} {prog}: " + ", ".join(f"{form} over segments [{a + x}, {a + y})"
                                                          for form, x, y in forms))
    print(LEGEND.strip("\n") + (" The CP replay's plan takes no SENDERS / DEFERRED: the same on every rank."
                                 if args.cp else ""))


if __name__ == "__main__":
    main()
