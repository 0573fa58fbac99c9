"""python -m bench conv|single [--pack Q1[,Q2..]] [--heads 32] [--boundary fwd,fwdbwd,gate]
    [--walk-forms auto,full] [--no-fla] [--iters N] [--out DIR]
torchrun --nproc-per-node W -m bench cp [--pack ...] [--heads 32] [--iters N] [--out DIR]"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from .common import write_rows
from .packs import PACKS


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cp"]:  # context parallel: its own launcher (torchrun) and arguments
        from . import cp
        return cp.main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench", epilog="context parallel: torchrun --nproc-per-node W -m bench "
                                "cp --help (its own launcher and arguments)")
    p.add_argument("suite", choices=("conv", "single"))
    p.add_argument("--pack", default="Q1", help="Q1[,Q2..] or all (Q1-Q6)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--boundary", default="fwd,fwdbwd", help="single: fwd, fwdbwd, gate (FLA's layer call: the gate in chunk_kda)")
    p.add_argument("--no-fla", action="store_true", help="single: leave out the flash-linear-attention arm")
    p.add_argument("--walk-forms", default="auto", help="single: walk form per kda_aot arm (auto: the fit rule), e.g. auto,full")
    p.add_argument("--out", default=None, help="directory for the result rows (default bench/results)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: the benchmarks need one", file=sys.stderr)
        return 2
    if args.suite == "conv":
        from . import conv
        rows = conv.run(pack=args.pack, iters=args.iters)
        path = write_rows(rows, args.suite, args.out)
        for r in rows:
            print(json.dumps(r, sort_keys=True))
    else:
        from . import single
        packs = list(PACKS) if args.pack == "all" else args.pack.split(",")
        path = None

        def on_rows(rows):  # written as measured: a run cut short keeps what it measured
            nonlocal path
            path = write_rows(rows, args.suite, args.out)
            for r in rows:
                print(json.dumps(r, sort_keys=True), flush=True)
        single.run(packs=packs, H=args.heads, iters=args.iters, boundaries=tuple(args.boundary.split(",")),
                   with_fla=not args.no_fla, walk_forms=tuple(args.walk_forms.split(",")), on_rows=on_rows)
    print(f"rows written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
