"""FLA's KimiDeltaAttention layer (flash-linear-attention 0.6.0, mode="chunk") on a pack, one training step
with FLA's own kernels against the same layer with kda_aot as FLA's chunk_kda backend (`import kda_aot.fla`,
switched per arm with FLA's FLA_KDA_AOT), side by side in one process.

    python -m bench.fla_layer [--pack Q1] [--hidden 4096] [--heads 32] [--iters 10] [--out DIR]

Rows (suite "fla_layer", arm "fla" / "kda_aot"): boundary "layer" (the whole layer's forward + backward)
and "kda" (the chunk_kda call inside it, forward + backward, on the inputs the layer gives it), medians of
interleaved CUDA-event timings; plus one row "agreement" with the relative RMS distance between the arms'
layer outputs and every parameter gradient. Needs flash-linear-attention and einops (carry their wheels in
.whl); FLA's layers package is imported without its __init__, which pulls in every layer (and transformers).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch

from bench.common import row, write_rows
from bench.packs import PACKS

ARMS = ("fla", "kda_aot")
_T0 = time.time()


def progress(what: str):
    print(f"[{time.time() - _T0:6.1f} s] {what}", file=sys.stderr, flush=True)


def kda_layer_class():
    """fla.layers.kda.KimiDeltaAttention, importing only the modules it needs."""
    import fla
    if "fla.layers" not in sys.modules:
        pkg = types.ModuleType("fla.layers")
        pkg.__path__ = [str(Path(fla.__file__).parent / "layers")]
        sys.modules["fla.layers"] = pkg
    from fla.layers.kda import KimiDeltaAttention
    return KimiDeltaAttention


def switch(arm: str):
    os.environ["FLA_KDA_AOT"] = "1" if arm == "kda_aot" else "0"


def rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def capture_kda_call(layer_module):
    """Wrap the layer module's chunk_kda to keep a call's arguments while seen["on"] (to time that call
    alone); off, it keeps nothing (the arguments would outlive the step)."""
    inner = layer_module.chunk_kda
    seen = {"on": False}

    def wrapped(*args, **kwargs):
        if seen["on"]:
            seen["args"], seen["kwargs"] = args, kwargs
        return inner(*args, **kwargs)
    layer_module.chunk_kda = wrapped
    return seen


def count_kda_aot_calls():
    """Count the calls FLA's dispatch hands to kda_aot (its backend calls kda_aot.fla.chunk_kda)."""
    import kda_aot.fla as backend
    inner, count = backend.chunk_kda, {"n": 0}

    def counted(*args, **kwargs):
        count["n"] += 1
        return inner(*args, **kwargs)
    backend.chunk_kda = counted
    return count


def timed(fn, iters):
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", default="Q1")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import kda_aot.fla  # noqa: F401  (registers the backend)
    import fla.layers.kda as layer_module
    KimiDeltaAttention = kda_layer_class()
    torch.manual_seed(0)
    layer = KimiDeltaAttention(hidden_size=a.hidden, head_dim=128, num_heads=a.heads, mode="chunk").cuda()
    layer = layer.to(torch.bfloat16)
    lens = PACKS[a.pack]
    T = sum(lens)
    cu = torch.tensor([0] + list(lens), device="cuda").cumsum(0)
    x = torch.randn(1, T, a.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, T, a.hidden, device="cuda", dtype=torch.bfloat16)
    seen = capture_kda_call(layer_module)
    dispatched = count_kda_aot_calls()

    def layer_step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = layer(x, cu_seqlens=cu)[0]
        y.backward(dy)
        return y

    # One step each: outputs and gradients (FLA's kept on the host while the other arm runs: a Q1
    # layer step alone peaks near 100 GB), and the dispatch checked both ways.
    fla_result, agreement, peaks = None, {}, {}
    for arm in ARMS:
        switch(arm)
        progress(f"first step, {arm} (FLA's autotuning)")
        before = dispatched["n"]
        seen["on"] = arm == "kda_aot"
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        y = layer_step()
        peaks[arm] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        seen["on"] = False
        went = dispatched["n"] - before
        if went != (1 if arm == "kda_aot" else 0):
            raise SystemExit(f"arm {arm}: FLA dispatched {went} chunk_kda calls to kda_aot")
        got = {"y": y.detach(), "dx": x.grad,
               **{n: p.grad.detach() for n, p in layer.named_parameters() if p.grad is not None}}
        if fla_result is None:
            fla_result = {n: t.cpu() for n, t in got.items()}
        else:
            agreement = {n: rel_rms(t, fla_result[n].cuda()) for n, t in got.items()}
        del y, got
    del fla_result
    # The layer's chunk_kda call alone, on the inputs it had in the kda_aot arm, for both arms.
    args, kwargs = seen.pop("args"), seen.pop("kwargs")
    kw = {k: (v.detach().clone().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point()
              and k in ("q", "k", "v", "g", "beta", "A_log", "dt_bias") else v) for k, v in kwargs.items()}
    layer.zero_grad(set_to_none=True)
    x.grad = None

    def kda_step(arm):
        def run():
            switch(arm)
            for t in kw.values():
                if isinstance(t, torch.Tensor):
                    t.grad = None
            o, _ = layer_module.chunk_kda(*args, **kw)
            o.backward(torch.ones_like(o))
        return run

    runs = {(arm, "layer"): (lambda arm=arm: (switch(arm), layer_step())) for arm in ARMS}
    runs.update({(arm, "kda"): kda_step(arm) for arm in ARMS})
    for key, fn in runs.items():  # warm-up (FLA's autotuning)
        progress(f"warm-up {key}")
        fn()
    progress("timing")
    times = {key: [] for key in runs}
    for i in range(a.iters):
        for key in (list(runs) if i % 2 == 0 else list(reversed(list(runs)))):
            times[key].append(timed(runs[key], 1))
    torch.cuda.synchronize()
    calls = dispatched["n"]
    if calls != 1 + 2 * a.iters + 2:  # first step, warm-ups and timed runs of the kda_aot arm (layer and call)
        raise SystemExit(f"FLA dispatched {calls} chunk_kda calls to kda_aot, expected {1 + 2 * a.iters + 2}")
    base = row("fla_layer", pack=a.pack, heads=a.heads, hidden=a.hidden)
    rows = [dict(base, arm=arm, boundary=boundary, ms=round(statistics.median(ts), 3))
            for (arm, boundary), ts in times.items()]
    for boundary in ("layer", "kda"):
        ms = {r["arm"]: r["ms"] for r in rows if r["boundary"] == boundary}
        rows.append(dict(base, arm="ratio_fla_over_kda_aot", boundary=boundary, ratio=round(ms["fla"] / ms["kda_aot"], 3)))
    rows.append(dict(base, arm="agreement", boundary="layer", rel_rms_kda_aot_vs_fla=agreement,
                     peak_gib=peaks))  # each arm's first step (the other arm's result on the host)
    for r in rows:
        print(r, flush=True)
    write_rows(rows, "fla_layer", a.out)


if __name__ == "__main__":
    main()
