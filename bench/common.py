"""Timing and result rows shared by the benchmarks.

Latency = median of CUDA-event times over steady iterations; arms are interleaved (each
iteration runs every arm once, in turn, the order reversed every other iteration) so that clock and
thermal drift, and whatever an arm leaves behind for the next (caches, allocator state), hit all
arms alike.
Rows are row()'s (the schema below) and go to bench/results/<suite>-<date>-<commit>.jsonl.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
from pathlib import Path

import torch

from kda_aot import options

REPO = Path(__file__).resolve().parents[1]  # the checkout: bench is not part of the installed package
RESULTS = REPO / "bench" / "results"


def commit() -> str:
    """The checkout's commit (KDA_AOT_COMMIT where the tree travelled without .git)."""
    if os.environ.get("KDA_AOT_COMMIT"):
        return os.environ["KDA_AOT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def round_order(names, round_index: int) -> list:
    """The arms' order in interleaved round `round_index`: as given in even rounds, reversed in odd
    ones, so that no arm always follows the same other arm: an arm's place in the order can move a row
    by a few percent either way (docs/method.md)."""
    names = list(names)
    return names if round_index % 2 == 0 else names[::-1]


_SLEEP_CYCLES_PER_S = 2.0e9  # torch.cuda._sleep counts SM clocks (~1.98 GHz on the H200): about the time asked


def interleaved(arms: dict, iters: int = 20, warmup: int = 3, busy_start_ms: float = 0.0) -> dict:
    """{name: callable} -> {name: median ms}; every iteration times each arm once (round_order).
    busy_start_ms: a sleep kernel that long queued before each start event, so that the host issues the arm's
    launches while the GPU is still busy: the time then leaves out whatever host time an idle GPU would wait for."""
    for _ in range(warmup):
        for fn in arms.values():
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in arms}
    for i in range(iters):
        for name in round_order(arms, i):
            fn = arms[name]
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if busy_start_ms:
                torch.cuda._sleep(int(busy_start_ms * 1e-3 * _SLEEP_CYCLES_PER_S))
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times[name].append(start.elapsed_time(stop))
    return {name: statistics.median(ts) for name, ts in times.items()}


def peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2 ** 30


def copy_ceiling_tbps(gib: float = 4.0, iters: int = 10) -> float:
    """Device-to-device copy bandwidth, bytes read + written, on a buffer far larger than L2."""
    n = int(gib * 2 ** 30) // 4
    a = torch.randn(n, device="cuda")
    b = torch.empty_like(a)
    ms = interleaved({"copy": lambda: b.copy_(a)}, iters=iters)["copy"]
    del a, b
    return 2 * n * 4 / (ms * 1e-3) / 1e12


def row(suite: str, **fields) -> dict:
    base = {
        "suite": suite, "cp": 1, "layout": "none", "gpu": torch.cuda.get_device_name(),
        "commit": commit(), "date": datetime.date.today().isoformat(),
    }
    base.update(fields)
    return base


def write_rows(rows: list[dict], suite: str, out_dir: Path | None = None) -> Path:
    out_dir = Path(out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{suite}-{datetime.date.today().isoformat()}-{commit()}.jsonl"
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    return path


def with_options(fn, **changes):
    """fn run with kda_aot's Options changed so during the call (an A/B arm)."""
    def call():
        with options.using(**changes):
            return fn()
    return call


def with_walk_form(form, fn):
    """fn with every state walk forced to `form` during the call (auto: the fit rule decides)."""
    return with_options(fn, walk_form=form)
