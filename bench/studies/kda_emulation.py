"""Study (CPU): the KDA kernels' roundings emulated in torch, against the fp64 reference.

Emulates the shipped forward (kda_fwd_chunk/lean, kda_fwd_walk) and backward (kda_bwd_walk,
kda_bwd_chunk, kda_bwd_gate/split_staged) at their rounding points: what is rounded to bf16
where, what is accumulated in fp32, which operands are bf16 hi + lo, which exps are ex2.approx.ftz
(fp32 exp2 with subnormal results flushed), with the kernels' anchors (so strong gates overflow here
where they overflow on the GPU). Tensor-core products are fp32 matmuls of the rounded operands; the
3xTF32 inverse is an fp32 solve. The same rounding points can be switched to fp32 one at a time
(`knobs`), and flash-linear-attention 0.6.0's rounding points (read from fla/ops/kda) are emulated in
the same frame (`--arm fla`), so each source of error can be compared with what FLA does there.

    python3 bench/studies/kda_emulation.py                 # attribution table, g uniform in [-5, 0]
    python3 bench/studies/kda_emulation.py --gate const-12 --arms shipped,fixed,fla
    python3 bench/studies/kda_emulation.py --list          # the knobs

The emulation lives in bench/studies/kda_emu/ (rounding model, knobs, inputs, forward, backward, FLA);
this file is its command line.

Error: relative RMS ||x - ref|| / ||ref|| of o, dq, dk, dv, dg, dbeta, final state, dh0 against the
fp64 chunked reference (kda_aot.reference).
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
# re-exported for the other studies (dh0_dbeta.py imports this module as E)
from kda_emu.backward import run_kda  # noqa: E402,F401
from kda_emu.fla import run_fla  # noqa: E402,F401
from kda_emu.inputs import make_inputs, truth  # noqa: E402,F401
from kda_emu.knobs import FIXED, KNOB_DOC, SHIPPED  # noqa: E402,F401


# ----------------------------------------------------------------------------- report

OUTPUTS = ("o", "dq", "dk", "dv", "dg", "dbeta", "final_state", "dh0")


def rel_rms(x, ref):
    x = x.double()
    if not torch.isfinite(x).all():
        return float("nan")
    den = ref.norm()
    return ((x - ref).norm() / den).item() if den > 0 else (x - ref).norm().item()


def errors(res, ref):
    return {n: rel_rms(res[n], ref[n]) for n in OUTPUTS if res.get(n) is not None and ref.get(n) is not None}


def fmt(e):
    return " ".join(f"{e.get(n, float('nan')):9.2e}" for n in OUTPUTS)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", default="700,333", help="document lengths")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--gate", default="unif-5", help="comma list of unif-5 | unif-20 | unif-60 | const-8 | const-12 | "
                                                     "const-30 | zero | mild | ninf")
    ap.add_argument("--beta-max", type=float, default=1.0)
    ap.add_argument("--init", action="store_true", help="with an initial state")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--range", action="store_true", help="also the min and max over seeds (for test bounds)")
    ap.add_argument("--arms", default="attribution",
                    help="attribution (from shipped) | attribution-fixed (from the kernels now) | comma list of "
                         "shipped, fixed, fla, all-fp32, or knob overrides [base:]knob=value+knob=value (base: "
                         "shipped or fixed)")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args(argv)
    if a.list:
        for kname, doc in KNOB_DOC.items():
            print(f"{kname:12s} {str(SHIPPED[kname]):6s} {doc}")
        return
    lens = [int(s) for s in a.lens.split(",")]
    arms = []
    if a.arms == "attribution":
        arms = [("shipped", SHIPPED)]
        arms += [(f"{n}=fp32", dict(SHIPPED, **{n: "fp32"})) for n in KNOB_DOC]
        for a_, b_ in (("bf16", "bf16"), ("tf32", "tf32"), ("lean", "hilo"), ("bf16", "hilo"), ("fp32", "fp32")):
            arms.append((f"gram {a_}/{b_}", dict(SHIPPED, gram_a=a_, gram_b=b_)))
        arms += [("all fp32", dict(SHIPPED, **{n: "fp32" for n in KNOB_DOC})), ("fla", None)]
    elif a.arms == "attribution-fixed":
        arms = [("fixed", FIXED)]
        arms += [(f"{n}=fp32", dict(FIXED, **{n: "fp32"})) for n in KNOB_DOC if FIXED[n] != "fp32"]
        arms += [(f"{n}={v}", dict(FIXED, **{n: v})) for n, v in (("gram_exact", "aqk"), ("gram_exact", "akk"),
                                                                   ("gram_exact", "both"), ("gamma", "fp64"))]
        arms += [("all fp32", dict(FIXED, **{n: "fp32" for n in KNOB_DOC})), ("fla", None)]
    else:
        table = {"shipped": SHIPPED, "fixed": FIXED, "fla": None,
                 "all-fp32": dict(SHIPPED, **{n: "fp32" for n in KNOB_DOC})}
        for spec in a.arms.split(","):
            base, _, over = spec.rpartition(":") if ":" in spec else ("shipped", "", spec)
            if "=" not in over:
                arms.append((spec, table[spec]))
                continue
            kn = dict(table[base])
            for item in over.split("+"):
                key, val = item.split("=")
                if key not in kn:
                    raise SystemExit(f"unknown knob {key} (see --list)")
                kn[key] = None if val == "none" else float(val) if key == "gate_clamp" else val
            arms.append((spec, kn))
    width = max(18, max(len(n) for n, _ in arms))
    for gate in a.gate.split(","):
        sums = {n: {} for n, _ in arms}
        for s in range(a.seeds):
            x = make_inputs(lens, a.heads, gate, 1000 + s, beta_max=a.beta_max, init=a.init)
            ref = truth(x)
            for name, kn in arms:
                res = run_fla(x) if kn is None else run_kda(x, kn)
                for o, e in errors(res, ref).items():
                    sums[name].setdefault(o, []).append(e)
        print(f"lens {lens} H {a.heads} gate {gate} beta in [0, {a.beta_max}) init {a.init} seeds {a.seeds}: "
              f"relative RMS error vs fp64 (mean over seeds)")
        print(f"{'arm':{width}s} " + " ".join(f"{n:>9s}" for n in OUTPUTS))
        for name, _ in arms:
            e = {o: sum(v) / len(v) for o, v in sums[name].items()}
            print(f"{name:{width}s} {fmt(e)}", flush=True)
            if a.range:
                for label, pick in (("min", min), ("max", max)):
                    print(f"{'  ' + label:{width}s} {fmt({o: pick(v) for o, v in sums[name].items()})}", flush=True)


if __name__ == "__main__":
    main()
