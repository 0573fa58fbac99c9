"""FLA's KimiDeltaAttention layer (flash-linear-attention 0.6.0, mode="chunk") on a pack, one training step
with FLA's own kernels against the same layer with kda_aot as FLA's backend (`import kda_aot.fla`: chunk_kda
and the short convolutions' causal conv1d), side by side in one process. Arms, switched with FLA's switches:
"fla" (FLA_KDA_AOT=0), "kda_aot_no_conv" (chunk_kda alone, FLA_KDA_AOT_CONV=0), "kda_aot" (both on kda_aot).

    python -m bench.fla_layer [--pack Q1] [--hidden 4096] [--heads 32] [--iters 10] [--out DIR]

Rows (suite "fla_layer"): boundary "layer" (the whole layer's forward + backward, every arm) and "kda" (the
chunk_kda call inside it, forward + backward, on the inputs the layer gives it; "fla" and "kda_aot"), medians
of interleaved CUDA-event timings; plus one row "agreement" with the relative RMS distance between each kda_aot
arm's layer output and parameter gradients and FLA's. Needs flash-linear-attention and einops (carry their wheels in
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

# kda_aot last: its first step keeps the chunk_kda call's arguments (to time the call alone), which would sit in
# a later arm's peak
ARMS = ("fla", "kda_aot_no_conv", "kda_aot")
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
    """FLA's switches for the arm."""
    os.environ["FLA_KDA_AOT"] = "0" if arm == "fla" else "1"
    os.environ["FLA_KDA_AOT_CONV"] = "1" if arm == "kda_aot" else "0"


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


def count_kda_aot_calls(set_attr=setattr):
    """Count the calls FLA's dispatch hands to kda_aot: chunk_kda (its backend calls kda_aot.fla.chunk_kda) and
    the conv's forward and backward (kda_aot.fla's conv1d_silu_fwd_op, _bwd_op). set_attr installs the counting
    wrappers (a test passes monkeypatch.setattr, which takes them out after it)."""
    import kda_aot.fla as backend
    count = {}
    for name in ("chunk_kda", "conv1d_silu_fwd_op", "conv1d_silu_bwd_op"):
        count[name] = 0

        def counted(*args, inner=getattr(backend, name), name=name, **kwargs):
            count[name] += 1
            return inner(*args, **kwargs)
        set_attr(backend, name, counted)
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
    expected = {"fla": (0, 0, 0), "kda_aot": (1, 3, 3), "kda_aot_no_conv": (1, 0, 0)}  # a step's calls to kda_aot
    for arm in ARMS:
        switch(arm)
        progress(f"first step, {arm} (FLA's autotuning)")
        before = dict(dispatched)
        seen["on"] = arm == "kda_aot"
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        y = layer_step()
        peaks[arm] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        seen["on"] = False
        went = tuple(dispatched[n] - before[n] for n in dispatched)
        if went != expected[arm]:
            raise SystemExit(f"arm {arm}: FLA dispatched (chunk_kda, conv forward, conv backward) {went} calls to "
                             f"kda_aot, expected {expected[arm]}")
        got = {"y": y.detach(), "dx": x.grad,
               **{n: p.grad.detach() for n, p in layer.named_parameters() if p.grad is not None}}
        if fla_result is None:
            fla_result = {n: t.cpu() for n, t in got.items()}
        else:
            agreement[arm] = {n: rel_rms(t, fla_result[n].cuda()) for n, t in got.items()}
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
    runs.update({(arm, "kda"): kda_step(arm) for arm in ("fla", "kda_aot")})
    for key, fn in runs.items():  # warm-up (FLA's autotuning)
        progress(f"warm-up {key}")
        fn()
    progress("timing")
    times = {key: [] for key in runs}
    for i in range(a.iters):
        for key in (list(runs) if i % 2 == 0 else list(reversed(list(runs)))):
            times[key].append(timed(runs[key], 1))
    torch.cuda.synchronize()
    # each kda_aot layer arm: first step, warm-up and timed steps; the kda_aot call: warm-up and timed runs
    want = 2 * (2 + a.iters) + 1 + a.iters
    convs = 3 * (2 + a.iters)  # the kda_aot arm's three convs, forward and backward, a step
    if (dispatched["chunk_kda"], dispatched["conv1d_silu_fwd_op"], dispatched["conv1d_silu_bwd_op"]) != \
            (want, convs, convs):
        raise SystemExit(f"FLA dispatched {dispatched} calls to kda_aot, expected {want} chunk_kda and {convs} conv "
                         f"forward and backward")
    base = row("fla_layer", pack=a.pack, heads=a.heads, hidden=a.hidden)
    rows = [dict(base, arm=arm, boundary=boundary, ms=round(statistics.median(ts), 3))
            for (arm, boundary), ts in times.items()]
    timed_ms = {(r["arm"], r["boundary"]): r["ms"] for r in rows}
    for boundary, arm in (("layer", "kda_aot"), ("kda", "kda_aot"), ("layer", "kda_aot_no_conv")):
        ms = {name: t for (name, b), t in timed_ms.items() if b == boundary}
        rows.append(dict(base, arm=f"ratio_fla_over_{arm}", boundary=boundary, ratio=round(ms["fla"] / ms[arm], 3)))
    rows.append(dict(base, arm="agreement", boundary="layer", rel_rms_kda_aot_vs_fla=agreement,
                     peak_gib=peaks))  # each arm's first step (the other arm's result on the host)
    for r in rows:
        print(r, flush=True)
    write_rows(rows, "fla_layer", a.out)


if __name__ == "__main__":
    main()
