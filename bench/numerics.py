"""Side-by-side numerics check (issue 21): kda_aot and flash-linear-attention 0.6.0 (when installed) on the
same fresh inputs, every output and gradient against the fp64 reference (kda_aot.reference).

    python3 bench/numerics.py [--out DIR] [--quick] [--timing [--only-timing]] [--no-fla]
        [--init-only] [--cases const-8/beta2,unif-60] [--draws 8]   (a subset; fresh draws of each case)

Cases: random packs at H = 4 and H = 32 with documents of 1, 63, 64, 65 and 1,000+ tokens; g uniform in
[-5, 0] (the ordinary range), constant -5, -8, -12, -30, -1e4, uniform in [-20, 0] and [-60, 0], some
channels -inf (resets), g = 0, and mild gates (uniform in [-0.5, 0] and [-0.05, 0]); beta in [0, 1) and [0, 2); with and without an initial state. Each row
(suite "numerics") holds the relative RMS error ||x - ref|| / ||ref|| of o, dq, dk, dv, dg, dbeta,
final_state (and dh0 with an initial state), or null where the output is not finite (and "finite": false);
arm "floor/output-dtype" is the fp64 reference rounded to the dtype kda_aot returns each output in (bf16 o, dq,
dk, dv): the error no implementation returning that dtype avoids;
where ||ref|| is 0 the error is the absolute norm ("abs": [names]). kda_aot rows also say whether replay
and saved mode gave bitwise the same gradients and two replays bitwise the same (strong-gate cases).

Reference: the chunked fp64 form (reference.kda_chunked_fwd_saved / kda_chunked_bwd), on the GPU (exact
for g = -inf too: reference.G_FLOOR); the H = 4 reset cases also run the fp64 recurrence under autograd
and report its difference from the chunked reference as arm "reference/recurrent".

--timing: Q1 (bench packs, 249,856 tokens), H = 32, g in [-5, 0]: the forward and the replay step
(forward + backward) of kda_aot and FLA, interleaved medians (suite "numerics_timing").
Rows go to DIR/numerics.jsonl (default $OUT, else the current directory).
Standalone: imports only kda_aot, torch and (optionally) fla.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if not __package__:  # run as a script (python3 bench/numerics.py): the checkout, for bench and kda_aot
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import commit  # noqa: E402
from bench.packs import PACKS  # noqa: E402
from kda_aot import chunk_kda, reference  # noqa: E402

D = 128
OUTPUTS = ("o", "dq", "dk", "dv", "dg", "dbeta", "final_state", "dh0")
Q1 = PACKS["Q1"]


def pack(seed: int) -> list:
    """Documents of 1, 63, 64, 65 and 1,000+ tokens (and two more), in a seeded random order."""
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 63, 64, 65, 1000 + int(torch.randint(0, 600, (1,), generator=gen)),
            int(torch.randint(2, 300, (1,), generator=gen)), 130]
    return [lens[i] for i in torch.randperm(len(lens), generator=gen).tolist()]


def gate(kind: str, shape, gen, reset_rate: float = 0.03, dtype=torch.float32) -> torch.Tensor:
    """Issue 21's gates on gen's device: zero, const-C, unif-C (C * uniform [0, 1)), ninf (g in [-5, 0] with a
    quarter of the channels reset, g = -inf, at reset_rate of the tokens). The GPU tests and the CP tests
    draw theirs here too."""
    dev = dict(device=gen.device, dtype=dtype)
    u = torch.rand(shape, generator=gen, **dev)
    if kind == "zero":
        return torch.zeros(shape, **dev)
    if kind.startswith("const"):
        return torch.full(shape, float(kind[5:]), **dev)
    if kind.startswith("unif"):
        return float(kind[4:]) * u
    if kind == "ninf":
        g = -5.0 * u
        hit = torch.rand(shape[:-1] + (shape[-1] // 4,), generator=gen, **dev) < reset_rate
        g[..., ::4] = torch.where(hit, torch.full_like(g[..., ::4], float("-inf")), g[..., ::4])
        return g
    raise ValueError(kind)


def make_case(lens, H, kind, beta_max, init, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    q = F.normalize(torch.randn(1, T, H, D, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
    k = F.normalize(torch.randn(1, T, H, D, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, T, H, D, device="cuda", generator=gen).to(torch.bfloat16)
    g = gate(kind, (1, T, H, D), gen)
    beta = (beta_max * torch.rand(1, T, H, device="cuda", generator=gen)).to(torch.bfloat16)
    N = len(lens)
    h0 = 0.1 * torch.randn(N, H, D, D, device="cuda", generator=gen) if init else None
    do = torch.randn(1, T, H, D, device="cuda", generator=gen).to(torch.bfloat16)
    dht = torch.randn(N, H, D, D, device="cuda", generator=gen)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, do=do, dht=dht, cu=cu)


def ref_chunked(x):
    """fp64 chunked reference on the GPU: o, final state, every gradient."""
    d = {n: x[n].double() for n in ("q", "k", "v", "g", "beta")}
    h0 = None if x["h0"] is None else x["h0"].double()
    cu = x["cu"].tolist()
    sv = reference.kda_chunked_fwd_saved(d["q"], d["k"], d["v"], d["g"], d["beta"], cu_seqlens=cu, initial_state=h0)
    dq, dk, dv, dg, dbeta, dh0 = reference.kda_chunked_bwd(sv, x["do"].double(), x["dht"].double(), **d)
    return dict(o=sv["o"], final_state=sv["final_state"], dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta,
                dh0=dh0 if x["h0"] is not None else None)


def ref_recurrent(x):
    """fp64 token-by-token recurrence under autograd (exact for g = -inf; small cases only)."""
    leaves = {n: x[n].double().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    h0 = None if x["h0"] is None else x["h0"].double().requires_grad_()
    o, ht = reference.kda_recurrent(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), cu_seqlens=x["cu"].tolist(),
                                    initial_state=h0, output_final_state=True)
    ((o * x["do"].double()).sum() + (ht * x["dht"].double()).sum()).backward()
    out = dict(o=o.detach(), final_state=ht.detach(), **{f"d{n}": leaves[n].grad for n in ("q", "k", "v", "g", "beta")})
    out["dh0"] = None if h0 is None else h0.grad
    return out


def run_kda(x, mode="replay"):
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    h0 = None if x["h0"] is None else x["h0"].detach().clone().requires_grad_()
    o, ht = chunk_kda(*leaves, cu_seqlens=x["cu"].cpu(), initial_state=h0, output_final_state=True, backward=mode)
    torch.autograd.backward((o, ht), (x["do"], x["dht"]))
    out = dict(o=o.detach(), final_state=ht.detach(), **dict(zip(("dq", "dk", "dv", "dg", "dbeta"),
                                                                  (t.grad for t in leaves))))
    out["dh0"] = None if h0 is None else h0.grad
    return out


def fla_op():
    try:
        from fla.ops.kda import chunk_kda as fla
    except ImportError:
        return None
    return fla


def run_fla(fla, x):
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    h0 = None if x["h0"] is None else x["h0"].detach().clone().requires_grad_()
    o, ht = fla(*leaves, initial_state=h0, output_final_state=True, cu_seqlens=x["cu"].long())
    torch.autograd.backward((o, ht), (x["do"], x["dht"]))
    out = dict(o=o.detach(), final_state=ht.detach(), **dict(zip(("dq", "dk", "dv", "dg", "dbeta"),
                                                                  (t.grad for t in leaves))))
    out["dh0"] = None if h0 is None else h0.grad
    return out


def errors(res, ref) -> dict:
    """name -> relative RMS error (None where not finite); 'abs': names measured absolutely (||ref|| = 0)."""
    e, absolute = {}, []
    for n in OUTPUTS:
        if res.get(n) is None or ref.get(n) is None:
            continue
        x = res[n].double().reshape(ref[n].shape)
        if not torch.isfinite(x).all():
            e[n] = None
            continue
        den = ref[n].norm().item()
        num = (x - ref[n]).norm().item()
        if den == 0:
            absolute.append(n)
            e[n] = num
        else:
            e[n] = num / den
    if absolute:
        e["abs"] = absolute
    return e


def verdict(rows: list) -> tuple:
    """(kda_aot above FLA: "case[#draw]:output ours > theirs (output rounding alone ...)", cases where kda_aot is
    not finite), each (case, draw) compared on its own, where FLA is finite."""
    worse, nonfinite = [], []
    by_case = {}
    for r in rows:
        if r["suite"] == "numerics":
            by_case.setdefault((r["case"], r.get("draw")), {})[r["arm"]] = r
    for (case, draw), arms in by_case.items():
        label = case if draw is None else f"{case}#{draw}"
        ours, theirs, floor = arms.get("kda_aot"), arms.get("fla"), arms.get("floor/output-dtype", {})
        if ours is None or not ours.get("finite"):
            nonfinite.append(label)
            continue
        if theirs is None or not theirs.get("finite"):
            continue
        for n in OUTPUTS:
            if isinstance(ours.get(n), float) and isinstance(theirs.get(n), float) and ours[n] > theirs[n]:
                at_floor = f" (output rounding alone {floor[n]:.2e})" if isinstance(floor.get(n), float) else ""
                worse.append(f"{label}:{n} {ours[n]:.4e} > {theirs[n]:.4e}{at_floor}")
    return worse, nonfinite


def floor_row(res, ref) -> dict:
    """errors() of the fp64 reference rounded to the dtype of each of res's outputs (the output-rounding floor)."""
    rounded = {n: ref[n].to(res[n].dtype) for n in OUTPUTS
               if res.get(n) is not None and ref.get(n) is not None}
    return errors(rounded, ref)


def cases(quick: bool) -> list:
    """(name, H, gate, beta_max, init)."""
    # issue 21's gates, and mild ones (unif-0.5, unif-0.05: a trained layer's -exp(A_log) softplus(x + dt_bias)
    # mostly lies in [-1, 0], where the Gram operands' factors sit near 1)
    gates = ["unif-5", "const-5", "const-8", "const-12", "const-30", "const-10000", "unif-20", "unif-60", "ninf", "zero",
             "unif-0.5", "unif-0.05"]
    out = []
    for g in gates:
        for beta_max in ((1.0,) if quick else (1.0, 2.0)):
            for init in ((False,) if quick else (False, True)):
                out.append((f"H4/{g}/beta{beta_max:g}/{'init' if init else 'noinit'}", 4, g, beta_max, init))
    for g in gates:
        out.append((f"H32/{g}/beta1/noinit", 32, g, 1.0, False))
    out.append(("H32/unif-5/beta2/init", 32, "unif-5", 2.0, True))
    return out


def g_min(x):
    m = x["g"].min().item()
    return "-inf" if m == -math.inf else m


def bitwise(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a if a[n] is not None)


def timing_rows(fla, base: dict, iters: int = 10) -> list:
    """Q1, H = 32: forward and replay step of kda_aot and FLA, interleaved medians (ms)."""
    from kda_aot.schedule.kda import chunk_kda_fwd
    x = make_case(Q1, 32, "unif-5", 1.0, False, 7)
    cu_cpu = x["cu"].cpu()
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]

    def ours_fwd():
        with torch.no_grad():
            chunk_kda_fwd(*(x[n] for n in ("q", "k", "v", "g", "beta")), cu_seqlens=x["cu"])

    def ours_step():
        for t in leaves:
            t.grad = None
        o, _ = chunk_kda(*leaves, cu_seqlens=cu_cpu, backward="replay")
        o.backward(x["do"])
    arms = {"kda_aot/fwd": ours_fwd, "kda_aot/fwdbwd": ours_step}
    if fla is not None:
        def fla_fwd():
            with torch.no_grad():
                fla(*(x[n] for n in ("q", "k", "v", "g", "beta")), cu_seqlens=x["cu"].long())

        def fla_step():
            for t in leaves:
                t.grad = None
            o, _ = fla(*leaves, cu_seqlens=x["cu"].long())
            o.backward(x["do"])
        arms.update({"fla/fwd": fla_fwd, "fla/fwdbwd": fla_step})
    for fn in arms.values():  # warm-up (FLA's autotuning included)
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    times = {n: [] for n in arms}
    for i in range(iters):
        for n in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            arms[n]()
            end.record()
            torch.cuda.synchronize()
            times[n].append(start.elapsed_time(end))
    rows = []
    for n, ts in times.items():
        arm, boundary = n.split("/")
        rows.append(dict(base, suite="numerics_timing", pack="Q1", heads=32, cp=1, layout="none", arm=arm,
                         boundary=boundary, mode="replay" if boundary == "fwdbwd" else "none",
                         ms=round(sorted(ts)[len(ts) // 2], 3)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="H = 4 cases with beta in [0, 1) and no initial state only")
    ap.add_argument("--init-only", action="store_true", help="the cases with an initial state only (dh0)")
    ap.add_argument("--cases", default="", help="comma-separated substrings: only the cases whose name holds one")
    ap.add_argument("--draws", type=int, default=1, help="inputs per case: fresh draws of the same case (row field draw)")
    ap.add_argument("--timing", action="store_true")
    ap.add_argument("--only-timing", action="store_true", help="the timings alone (no cases)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--seed", type=int, default=2101)
    ap.add_argument("--heads", type=int, nargs="*", default=[32, 4], help="which H's cases, in this order")
    a = ap.parse_args(argv)
    fla = None if a.no_fla else fla_op()
    base = dict(gpu=torch.cuda.get_device_name(), commit=commit(), date=datetime.date.today().isoformat())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "numerics.jsonl"
    rows = []
    t_start = time.time()
    lens_by_h = {4: pack(a.seed), 32: pack(a.seed + 1)}
    print(f"fla: {'yes' if fla is not None else 'not installed'}; packs {lens_by_h}", flush=True)
    print(f"{'case':34s} {'arm':20s} " + " ".join(f"{n:>9s}" for n in OUTPUTS), flush=True)
    wanted = [w for w in a.cases.split(",") if w]
    todo = [] if a.only_timing else [(draw, c) for h in a.heads for c in enumerate(cases(a.quick))
                                     if c[1][1] == h and (c[1][4] or not a.init_only)
                                     and (not wanted or any(w in c[1][0] for w in wanted))
                                     for draw in range(a.draws)]
    for draw, (i, (name, H, kind, beta_max, init)) in todo:
        t_case = time.time()
        x = make_case(lens_by_h[H], H, kind, beta_max, init, a.seed * 1000 + i + 100_000 * draw)
        finite_g = bool(torch.isfinite(x["g"]).all())
        ref = ref_chunked(x)
        common = dict(base, suite="numerics", case=name, heads=H, lens=lens_by_h[H], gate=kind, beta_max=beta_max,
                      init=init, g_min=g_min(x), **({"draw": draw} if a.draws > 1 else {}))
        arms = [("kda_aot", lambda: run_kda(x))]
        if fla is not None:
            arms.append(("fla", lambda: run_fla(fla, x)))
        if not finite_g and H == 4:
            arms.append(("reference/recurrent", lambda: ref_recurrent(x)))
        floor = None
        for arm, fn in arms:
            try:
                res = fn()
                if arm == "kda_aot":
                    floor = floor_row(res, ref)
                err = errors(res, ref)
                row = dict(common, arm=arm, finite=all(v is not None for k_, v in err.items() if k_ != "abs"), **err)
                if arm == "kda_aot" and kind in ("const-12", "const-30", "const-10000", "ninf", "unif-60"):
                    row["bitwise_saved_replay"] = bitwise(res, run_kda(x, "saved"))
                    row["bitwise_run_to_run"] = bitwise(res, run_kda(x))
            except Exception as e:  # an arm that fails is a row, not the end of the check
                row = dict(common, arm=arm, finite=False, error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            with path.open("a") as f:  # row by row: a run cut at its time limit keeps what it measured
                f.write(json.dumps(row, sort_keys=True) + "\n")
            cells = " ".join(f"{row[n]:9.2e}" if isinstance(row.get(n), float) else f"{str(row.get(n, '-')):>9s}"
                             for n in OUTPUTS)
            print(f"{name:34s} {arm:20s} {cells}", flush=True)
        if floor is not None:
            row = dict(common, arm="floor/output-dtype", finite=True, **floor)
            rows.append(row)
            with path.open("a") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        print(f"  ({time.time() - t_case:.1f} s)", flush=True)
        del x, ref
        torch.cuda.empty_cache()
    if a.timing:
        timed = timing_rows(fla, base)
        rows += timed
        with path.open("a") as f:
            for r in timed:
                f.write(json.dumps(r, sort_keys=True) + "\n")
        for r in rows[-4:]:
            if r["suite"] == "numerics_timing":
                print(f"timing {r['arm']} {r['boundary']}: {r['ms']} ms", flush=True)
    worse, nonfinite = verdict(rows)
    print(f"{len(rows)} rows -> {path} ({time.time() - t_start:.0f} s)")
    print(f"kda_aot non-finite: {nonfinite or 'none'}")
    print(f"kda_aot above FLA: {len(worse)}" + "".join(f"\n  {w}" for w in worse))


if __name__ == "__main__":
    main()
