"""A B3 step (PackedKDA on the kernels, forward + replay backward) eager, under torch.compile(fullgraph=True)
and under mode="reduce-overhead" (CUDA graphs): bitwise equal, and timed side by side.

    python3 bench/compile_step.py [--pack Q1] [--heads 32] [--iters 10] [--out DIR]

Prints one line per arm and writes rows (suite "compile", boundary "B3", arm eager | compiled |
reduce-overhead) to DIR (default bench/results/). Arms are interleaved, medians of CUDA-event times.
"""
import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import commit as checkout_commit  # noqa: E402
from bench.packs import PACKS  # noqa: E402
from kda_aot.nn import PackedKDA  # noqa: E402


def step(m, xs, g, beta, cu, do):
    o, _ = m(*xs, g, beta, cu_seqlens=cu)
    return (o.float() * do).sum(), o


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", default="Q1", choices=sorted(PACKS))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    lens, H = PACKS[args.pack], args.heads
    T, D = sum(lens), H * 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.manual_seed(0)
    m = PackedKDA(H, 128, conv_bias=True).cuda()
    xs = [torch.randn(1, T, D, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(3)]
    g = (-5 * torch.rand(1, T, H, 128, device="cuda", generator=gen)).requires_grad_()
    beta = torch.rand(1, T, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    do = torch.randn(1, T, H, 128, device="cuda", generator=gen)
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    leaves = xs + [g, beta] + list(m.parameters())
    arms = {"eager": step, "compiled": torch.compile(step, fullgraph=True),
            "reduce-overhead": torch.compile(step, fullgraph=True, mode="reduce-overhead")}

    def run(fn):
        for t in leaves:
            t.grad = None
        loss, o = fn(m, xs, g, beta, cu, do)
        loss.backward()
        return o

    want = None
    for name, fn in arms.items():  # warm-up (compilation, graph capture) and the bitwise check
        for _ in range(3):
            o = run(fn)
        got = [o.detach().clone()] + [t.grad.clone() for t in leaves]
        if want is None:
            want = got
        bitwise = all(torch.equal(a, b) for a, b in zip(want, got))
        print(f"{name}: bitwise equal to eager: {bitwise}")
        if not bitwise:
            raise SystemExit(f"{name} differs from eager")
        del got
    times = {name: [] for name in arms}
    for i in range(args.iters):
        for name in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(arms[name])
            stop.record()
            stop.synchronize()
            times[name].append(start.elapsed_time(stop))
    commit = checkout_commit()
    date = datetime.date.today().isoformat()
    rows = [dict(suite="compile", pack=args.pack, heads=H, cp=1, layout="none", boundary="B3", mode="replay",
                 arm=name, walk_form="auto", ms=round(statistics.median(ts), 3), gpu=torch.cuda.get_device_name(),
                 commit=commit, date=date) for name, ts in times.items()]
    base = rows[0]["ms"]
    for r in rows:
        print(f"{r['arm']:>16}: {r['ms']:8.3f} ms  ({r['ms'] / base:.3f}x eager)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"compile-{date}-{commit}.jsonl"
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    print(f"rows: {path}")


if __name__ == "__main__":
    main()
