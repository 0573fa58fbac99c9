"""Kernel timeline of one KDA call (no Nsight Systems on the device: torch.profiler's CUPTI trace):
every kernel's stream, start, end and duration relative to the first kernel, the busy time of each
stream, the span, and the stretches when no kernel runs. Shows where a pipelined forward or a
training step spends its span (chunk stage vs walks vs idle), which per-kernel sums cannot.

  python bench/timeline_kda.py [pack] [heads] [forward|saved|replay|fla_layer] [--json PATH]

fla_layer: a replay step as FLA's layer calls chunk_kda (raw gate, A_log, dt_bias and beta's logits activated
in the kernels, q and k L2-normalised in the call).
"""
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from bench.packs import PACKS
from bench.single import inputs, training_call
from kda_aot import chunk_kda
from kda_aot.schedule.kda import chunk_kda_fwd


def short(name: str) -> str:
    """A kernel's family: the kda_aot kernel name (the part before its argument list), else 40 chars."""
    for key in ("kda_fwd_chunk", "kda_fwd_walk", "kda_bwd_walk", "kda_bwd_chunk", "kda_bwd_gate", "kcp_transfer",
                "conv1d", "l2norm"):
        if key in name:
            return key
    return name[:40]


def kernels_of(trace_path: str) -> list:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ks = [e for e in events if e.get("cat") == "kernel" and "ts" in e and "dur" in e]
    t0 = min(e["ts"] for e in ks)
    return sorted(({"stream": e.get("args", {}).get("stream", -1), "start_ms": (e["ts"] - t0) / 1e3,
                    "end_ms": (e["ts"] + e["dur"] - t0) / 1e3, "ms": e["dur"] / 1e3, "kernel": short(e["name"])}
                   for e in ks), key=lambda k: k["start_ms"])


def idle_stretches(ks: list, min_ms: float = 0.05) -> list:
    """(start, end) of the stretches longer than min_ms when no kernel runs on any stream."""
    out, covered = [], 0.0
    for k in ks:
        if k["start_ms"] - covered > min_ms:
            out.append((covered, k["start_ms"]))
        covered = max(covered, k["end_ms"])
    return out


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    pack = args[0] if args else "Q1"
    H = int(args[1]) if len(args) > 1 else 32
    mode = args[2] if len(args) > 2 else "forward"
    out_json = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    q, k, v, g, beta, cu = inputs(PACKS[pack], H)
    cu = cu.cpu()
    leaves, kw = training_call(q, k, v, g, beta, "fla_layer" if mode == "fla_layer" else "log_decay",
                               mode if mode in ("saved", "replay") else "replay")
    do = torch.randn_like(q)

    def step():
        if mode == "forward":
            chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
            return
        for x in leaves:
            x.grad = None
        chunk_kda(*leaves[:5], cu_seqlens=cu, **kw)[0].backward(do)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        ks = kernels_of(path)
    span = max(k["end_ms"] for k in ks)
    print(f"{pack} H={H} {mode}: {len(ks)} kernels, span {span:.2f} ms")
    print("| start ms | end ms | ms | stream | kernel |")
    print("| --- | --- | --- | --- | --- |")
    for k in ks:
        if k["ms"] >= 0.05:  # the small torch kernels (fills, casts) are in the sums below only
            print(f"| {k['start_ms']:.2f} | {k['end_ms']:.2f} | {k['ms']:.2f} | {k['stream']} | {k['kernel']} |")
    busy = {}
    for k in ks:
        key = (k["stream"], k["kernel"])
        busy[key] = busy.get(key, 0.0) + k["ms"]
    print("busy ms by (stream, kernel): " + ", ".join(f"{s}/{n} {t:.2f}" for (s, n), t in sorted(busy.items())))
    idle = idle_stretches(ks)
    print(f"no kernel running: {sum(b - a for a, b in idle):.2f} ms in {len(idle)} stretches"
          + "".join(f" [{a:.2f}, {b:.2f}]" for a, b in idle[:12]))
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"pack": pack, "heads": H, "mode": mode, "span_ms": span, "kernels": ks}, f)


if __name__ == "__main__":
    main()
