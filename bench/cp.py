"""Context-parallel benchmark (issue 4): `torchrun --nproc-per-node W -m bench cp` (from the checkout root).

B1 = PackedKDA forward (conv halo exchange, conv1d + SiLU on q, k, v, KDA state passing and
recurrence, communication included); B3 = forward + checkpoint replay + backward, the input
gradients dropped before each step (accumulated across steps they would add one full-size add per
input and arm: docs/cp.md). Packs of
bench/packs.py, H = 32, layouts contiguous / zigzag / doc_zigzag. Latency = median over steady
iterations of the slowest rank (each iteration's time is all-reduced with MAX), arms interleaved.
flash-linear-attention's CP (build_cp_context, contiguous and zigzag) runs side by side for its
KDA part (chunk_kda with cp_context; its conv is not part of that arm). With one process the
contiguous layout also times the module without a CP plan (arm kda_aot/no_plan): the single-device
baseline of the scaling bar (CP2 B3 <= 0.6 x it).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from kda_aot import cp
from kda_aot.cp.exchange import gather_json
from kda_aot.nn import PackedKDA
from kda_aot import options
from .common import round_order, row, with_options, with_walk_form, write_rows
from .packs import HEAD_DIM, HEADS_DEFAULT, PACKS

LAYOUTS = ("contiguous", "zigzag", "doc_zigzag")
PER_FRAGMENT_ARM = "kda_aot/per_fragment"  # cp_batched_summaries off: one summary (two walk launches) per fragment
PLAIN_ORDER_ARM = "kda_aot/plain_order"  # cp_pipeline off: prepare, summaries, exchange, then the walks
NO_PLAN_ARM = "kda_aot/no_plan"  # one GPU, no CP plan (cu_seqlens): CP1's rows carry it as the single-device baseline


def slowest_rank_ms(fn, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        t = torch.tensor([a.elapsed_time(b)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def _phases_by_rank(step, iters: int) -> list:
    """Per rank, the mean ms per step of each CP phase (summary walks, exchange incl. waiting for
    the other ranks, local forward/backward, replay) over `iters` steps of `step`."""
    with options.using(debug_timing=True):
        cp.phase_times()
        for _ in range(iters):
            step()
        mine = {name: round(sum(ms) / iters, 3) for name, ms in cp.phase_times().items()}
    return gather_json(mine, dist.get_world_size(), dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()))


def fla_kda():
    try:
        from fla.ops.cp import build_cp_context
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return build_cp_context, chunk_kda


def run(packs=tuple(PACKS), H: int = HEADS_DEFAULT, iters: int = 10, out_dir=None, walk_forms=("auto",),
        layouts=LAYOUTS, with_fla=True, per_fragment=False, plain_order=False, ab=()) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    rows, t_start = [], time.monotonic()
    fla = fla_kda() if with_fla else None
    torch.manual_seed(1234)  # the same module weights on every rank
    module = PackedKDA(H, HEAD_DIM, backend="cuda", backward="replay").to(dev)
    for pack in packs:
        lens = PACKS[pack]
        T = sum(lens)
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        gen = torch.Generator(device=dev).manual_seed(4321)  # the same global inputs on every rank
        D = H * HEAD_DIM
        xs = [torch.randn(1, T, D, device=dev, generator=gen).to(torch.bfloat16) for _ in range(3)]
        g = -5 * torch.rand(1, T, H, HEAD_DIM, device=dev, generator=gen)
        beta = torch.rand(1, T, H, device=dev, generator=gen).to(torch.bfloat16)
        for layout in layouts:
            plan = cp.make_plan(cu, layout, group=dist.group.WORLD)
            q, k, v = (plan.shard(x).contiguous() for x in xs)
            gl, bl = plan.shard(g).contiguous(), plan.shard(beta).contiguous()
            do = torch.randn(1, q.shape[1], H, HEAD_DIM, device=dev, generator=gen).to(torch.bfloat16)
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]

            def b1():
                with torch.no_grad():
                    module(q, k, v, gl, bl, plan=plan)

            def fresh(xs):  # a training step's input gradients start empty (as in bench single)
                for x in xs:
                    x.grad = None
                return xs

            def b3():
                o, _ = module(*fresh(leaves), gl, bl, plan=plan)
                o.backward(do)

            arms = {}
            for wf in walk_forms:  # issue 5: the fit rule (auto) against forced forms, interleaved
                name = "kda_aot" if wf == "auto" else f"kda_aot@{wf}"
                arms[(name, "B1")], arms[(name, "B3")] = with_walk_form(wf, b1), with_walk_form(wf, b3)
            if world == 1 and layout == "contiguous":  # the scaling bar's baseline: the module without a CP plan
                def single_b1():
                    with torch.no_grad():
                        module(q, k, v, gl, bl, cu_seqlens=cu)

                def single_b3():
                    o, _ = module(*fresh(leaves), gl, bl, cu_seqlens=cu)
                    o.backward(do)
                arms[(NO_PLAN_ARM, "B1")], arms[(NO_PLAN_ARM, "B3")] = single_b1, single_b3
            if per_fragment:  # one summary per fragment against the batched summaries (the default)
                arms[(PER_FRAGMENT_ARM, "B1")], arms[(PER_FRAGMENT_ARM, "B3")] = (
                    with_options(b1, cp_batched_summaries=False), with_options(b3, cp_batched_summaries=False))
            if plain_order:  # the CP path's plain order against the pipelined one (the default)
                arms[(PLAIN_ORDER_ARM, "B1")] = with_options(b1, cp_pipeline=False)
                arms[(PLAIN_ORDER_ARM, "B3")] = with_options(b3, cp_pipeline=False)
            for text, changes in ab:  # other Options, as an arm of their own
                arms[("kda_aot/" + text, "B1")] = with_options(b1, **changes)
                arms[("kda_aot/" + text, "B3")] = with_options(b3, **changes)
            if fla is not None and layout in ("contiguous", "zigzag"):
                build_cp_context, fla_chunk_kda = fla
                ctx = build_cp_context(cu.to(dev).long(), dist.group.WORLD, layout=layout, cu_seqlens_cpu=cu.long())
                qh, kh, vh = (x.view(1, -1, H, HEAD_DIM) for x in (q, k, v))
                fl = [x.clone().requires_grad_() for x in (qh, kh, vh)]

                def fla_b1():
                    with torch.no_grad():
                        fla_chunk_kda(qh, kh, vh, gl, bl, use_qk_l2norm_in_kernel=True, cp_context=ctx)

                def fla_b3():
                    o, _ = fla_chunk_kda(*fresh(fl), gl, bl, use_qk_l2norm_in_kernel=True, cp_context=ctx)
                    o.backward(do)

                arms[("fla_kda_only", "B1")] = fla_b1
                arms[("fla_kda_only", "B3")] = fla_b3
            times = {key: [] for key in arms}
            for i in range(iters):  # interleaved: each round times every arm once, every other round reversed
                for key in round_order(arms, i):
                    fn = arms[key]
                    first = not times[key]
                    t_arm = time.monotonic()
                    times[key].append(slowest_rank_ms(fn, 1, warmup=2 if first else 0))
                    if first and rank == 0:  # warm-ups included: FLA's autotuning shows here
                        print(f"[{time.monotonic() - t_start:.0f} s] {pack} {layout} {key[0]} {key[1]}: first call "
                              f"{time.monotonic() - t_arm:.1f} s", file=sys.stderr, flush=True)
            phases = {"kda_aot": _phases_by_rank(b3, iters=3)}
            if per_fragment:
                phases[PER_FRAGMENT_ARM] = _phases_by_rank(with_options(b3, cp_batched_summaries=False), iters=3)
            if plain_order:
                phases[PLAIN_ORDER_ARM] = _phases_by_rank(with_options(b3, cp_pipeline=False), iters=3)
            new = []
            for (arm, boundary), ts in times.items():
                extra = {"phases_ms_by_rank": phases[arm]} if boundary == "B3" and arm in phases else {}
                form = (arm.partition("@")[2] or "auto") if arm.startswith("kda_aot") else None
                new.append(row("cp", pack=pack, heads=H, cp=world, layout=layout, boundary=boundary,
                               mode="replay", arm=arm, walk_form=form, ms=round(statistics.median(ts), 3),
                               **extra))
            if rank == 0:  # written layout by layout: a run cut short keeps what it measured
                write_rows(new, f"cp{world}", out_dir)
                print(f"[{time.monotonic() - t_start:.0f} s] {pack} {layout}: {len(new)} rows", file=sys.stderr, flush=True)
            rows += new
            del q, k, v, gl, bl, do, leaves
        del xs, g, beta
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    import argparse
    import json
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node W -m bench cp")
    p.add_argument("--pack", default=",".join(PACKS), help="Q1[,Q2..] or all (the default: Q1-Q6)")
    p.add_argument("--heads", type=int, default=HEADS_DEFAULT)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--walk-forms", default="auto", help="walk form per kda_aot arm (auto: the fit rule), e.g. auto,full")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="a subset of " + ",".join(LAYOUTS))
    p.add_argument("--no-fla", action="store_true", help="leave out flash-linear-attention's CP arm")
    p.add_argument("--per-fragment-summaries", action="store_true",
                   help=f"add the arm {PER_FRAGMENT_ARM} (cp_batched_summaries=0: one summary per fragment instead of "
                        "every fragment's at once, in pieces)")
    p.add_argument("--plain-order", action="store_true",
                   help=f"add the arm {PLAIN_ORDER_ARM} (cp_pipeline=0: the CP path's plain order instead of the "
                        "chunk stage pipelined with the walks)")
    p.add_argument("--ab", action="append", default=[], metavar="OPTION=VALUE[,OPTION=VALUE]",
                   help="add the arm kda_aot/OPTION=VALUE[,..]: kda_aot.options.Options changed so during its "
                        "calls (repeatable; e.g. cp_batched_summaries=0)")
    args = p.parse_args(argv)
    ab = []
    for text in args.ab:
        try:
            parsed = options.parse(text)
        except ValueError as e:
            p.error(f"--ab: {e}")
        ab.append((text, {name: getattr(parsed, name) for name in (kv.split("=", 1)[0].strip() for kv in text.split(","))}))
    layouts = tuple(args.layouts.split(","))
    if set(layouts) - set(LAYOUTS):
        p.error(f"--layouts: expected a subset of {LAYOUTS}, got {args.layouts}")
    if os.environ.get("KDA_AOT_DUMP_AFTER"):  # a stuck run prints every rank's Python stack and goes on
        import faulthandler  # (no exit: the first rank to exit would get the others killed before their dump)
        faulthandler.dump_traceback_later(float(os.environ["KDA_AOT_DUMP_AFTER"]), exit=False)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    try:
        rows = run(packs=list(PACKS) if args.pack == "all" else args.pack.split(","), H=args.heads, iters=args.iters, out_dir=args.out,
                   walk_forms=tuple(args.walk_forms.split(",")), layouts=layouts, with_fla=not args.no_fla,
                   per_fragment=args.per_fragment_summaries, plain_order=args.plain_order, ab=ab)
        if dist.get_rank() == 0:
            for r in rows:
                print(json.dumps(r, sort_keys=True))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
