"""Kernel timeline of one PackedKDA B3 step under CP, per rank (torch.profiler's CUPTI trace; no Nsight
Systems on the device): what each rank's GPU runs when, the stretches when it runs nothing, and which
host-side calls those stretches fall in (a host sync, a collective's wait, Python between launches).
Where the CP step's span goes beyond the sum of its kernels.

  torchrun --nproc-per-node W bench/timeline_cp.py [pack] [layout] [arm] [--out DIR]
  arm: pipelined (the default order) | plain (Options.cp_pipeline off) | no_plan (W = 1: the module with cu_seqlens)
Writes DIR/timeline_<arm>_<layout>_rank<r>.json (kernels, host ops >= 0.2 ms - >= 20 us before the first
KDA kernel -, idle stretches) and
prints rank 0's summary.
"""
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from timeline_kda import idle_stretches, short  # noqa: E402

from bench.packs import HEAD_DIM, PACKS  # noqa: E402
from kda_aot import cp, options  # noqa: E402
from kda_aot.cp.exchange import gather_json  # noqa: E402
from kda_aot.nn import PackedKDA  # noqa: E402

FAMILIES = ("kda_fwd_chunk", "kda_fwd_walk", "kda_bwd_walk", "kda_bwd_chunk", "kda_bwd_gate", "kcp_transfer",
            "conv1d", "l2norm", "nccl")


def family(name: str) -> str:
    if "nccl" in name.lower():
        return "nccl"
    return short(name)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "."
    args = [a for a in args if a != out_dir]
    pack, layout, arm = (args + ["Q1", "contiguous", "pipelined"][len(args):])[:3]
    with options.using(cp_pipeline=arm != "plain"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        rank, dev = dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
        H = 32
        lens = PACKS[pack]
        T, D = sum(lens), H * HEAD_DIM
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        torch.manual_seed(1234)
        module = PackedKDA(H, HEAD_DIM, backend="cuda", backward="replay").to(dev)
        gen = torch.Generator(device=dev).manual_seed(4321)
        xs = [torch.randn(1, T, D, device=dev, generator=gen).to(torch.bfloat16) for _ in range(3)]
        g = -5 * torch.rand(1, T, H, HEAD_DIM, device=dev, generator=gen)
        beta = torch.rand(1, T, H, device=dev, generator=gen).to(torch.bfloat16)
        if arm == "no_plan":
            q, k, v, gl, bl = xs[0], xs[1], xs[2], g, beta
            kw = {"cu_seqlens": cu}
        else:
            plan = cp.make_plan(cu, layout, group=dist.group.WORLD)
            q, k, v = (plan.shard(x).contiguous() for x in xs)
            gl, bl = plan.shard(g).contiguous(), plan.shard(beta).contiguous()
            kw = {"plan": plan}
        do = torch.randn(1, q.shape[1], H, HEAD_DIM, device=dev, generator=gen).to(torch.bfloat16)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]

        def step():
            for x in leaves:
                x.grad = None
            o, _ = module(*leaves, gl, bl, **kw)
            o.backward(do)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        ks = [e for e in events if e.get("cat") == "kernel" and "ts" in e and "dur" in e]
        t0 = min(e["ts"] for e in ks)
        kernels = sorted(({"stream": e.get("args", {}).get("stream", -1), "start_ms": (e["ts"] - t0) / 1e3,
                           "end_ms": (e["ts"] + e["dur"] - t0) / 1e3, "ms": e["dur"] / 1e3,
                           "kernel": family(e["name"])} for e in ks), key=lambda k: k["start_ms"])
        # host calls of 0.2 ms and more; before the first KDA kernel (the step's prelude, where the GPU waits
        # for the host) every call of 20 us and more
        first_kda = min((e["ts"] for e in ks if short(e["name"]).startswith("kda_")), default=float("inf"))
        host = sorted(({"start_ms": (e["ts"] - t0) / 1e3, "ms": e["dur"] / 1e3, "name": e["name"][:60],
                        "cat": e.get("cat")} for e in events
                       if e.get("cat") in ("cpu_op", "cuda_runtime", "python_function", "user_annotation")
                       and (e.get("dur", 0) >= 200 or (e.get("dur", 0) >= 20 and e.get("ts", 0) < first_kda))),
                      key=lambda h: h["start_ms"])
        idle = idle_stretches(kernels)
        span = max(k["end_ms"] for k in kernels)
        busy = {}
        for k in kernels:
            busy[k["kernel"]] = busy.get(k["kernel"], 0.0) + k["ms"]
        result = {"pack": pack, "layout": layout, "arm": arm, "rank": rank, "span_ms": span, "busy_ms": busy,
                  "idle": idle, "kernels": kernels, "host": host}
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"timeline_{arm}_{layout}_rank{rank}.json"), "w") as f:
            json.dump(result, f)
        lines = [f"rank {rank} {pack} {layout} {arm}: span {span:.2f} ms, {len(kernels)} kernels, "
                 f"idle {sum(b - a for a, b in idle):.2f} ms in {len(idle)} stretches",
                 "  busy: " + ", ".join(f"{n} {t:.2f}" for n, t in sorted(busy.items(), key=lambda x: -x[1])[:14])]
        for a, b in sorted(idle, key=lambda s: s[0] - s[1])[:8]:
            inside = [h for h in host if h["start_ms"] <= a and h["start_ms"] + h["ms"] >= b and h["cat"] != "python_function"]
            lines.append(f"  idle [{a:.2f}, {b:.2f}] {b - a:.2f} ms inside: "
                         + "; ".join(f"{h['name']} ({h['ms']:.2f})" for h in inside[-3:]))
        everyone = gather_json("\n".join(lines), dist.get_world_size(), dist.group.WORLD,
                               torch.device("cuda", torch.cuda.current_device()))
        if rank == 0:
            print("\n".join(everyone))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
