"""Study (GPU): the gate activated inside the kernels against the same call with the gate activated in
torch before the op, both against FLA's formulas in fp64 (tests/test_fla_signature.expected), on the
inputs of tests/test_fla_signature_gpu.py. Per case and arm: the relative RMS error of o, the final state
and every gradient; then dA_log per head (fp64, each arm) and the share of fp64 dA_log carried by tokens
whose activated gate is below the kernels' floor.

    python3 bench/studies/gate_in_kernel.py
"""
from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
import kda_aot  # noqa: E402
from kda_aot.reference import kda_gate  # noqa: E402
from test_fla_signature import expected  # noqa: E402
from reftools import rel_rms  # noqa: E402
from test_fla_signature_gpu import cuda_inputs, on_cpu_f64  # noqa: E402

NAMES = ("q", "k", "v", "g", "b", "h0", "A_log", "dt_bias")
CASES = {"layer": (4, 4, None, False, False), "gva2-neg-vfirst": (4, 8, None, True, True),
         "gva4-safe-vfirst": (2, 8, -5.0, False, True), "safe-neg": (4, 4, -2.0, True, False)}


def call(x, arm, lower_bound, neg, v_first):
    leaves = {n: x[n].clone().requires_grad_() for n in NAMES}
    kw = dict(lower_bound=lower_bound, safe_gate=lower_bound is not None, allow_neg_eigval=neg,
              state_v_first=v_first, cu_seqlens=x["cu"])
    if arm == "kernel":
        o, s = kda_aot.chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["b"], None, leaves["h0"],
                                 True, True, True, True, A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], **kw)
    else:
        g = kda_gate(leaves["g"], leaves["A_log"], leaves["dt_bias"], lower_bound)
        kw.pop("safe_gate"), kw.pop("lower_bound")
        o, s = kda_aot.chunk_kda(leaves["q"], leaves["k"], leaves["v"], g, leaves["b"], None, leaves["h0"],
                                 True, True, False, True, **kw)
    torch.autograd.backward((o, s), (x["do"].to(torch.bfloat16), x["dht"]))
    return o, s, {n: leaves[n].grad for n in NAMES}


def main():
    for case, (H, HV, lower_bound, neg, v_first) in CASES.items():
        x = cuda_inputs(H, HV, ("gpu", HV, lower_bound, neg))
        cpu = on_cpu_f64(x)
        cpu["q"], cpu["k"], cpu["v"] = (x[n].cpu() for n in ("q", "k", "v"))
        eo, es, egrads = expected(cpu, lower_bound=lower_bound, neg=neg, v_first=v_first)
        g_act = kda_gate(cpu["g"], cpu["A_log"], cpu["dt_bias"], lower_bound)
        below = (g_act < -20).double().mean().item()
        print(f"{case}: g_act min {g_act.min().item():.1f}, below -20: {below:.3%}")
        runs = {}
        for arm in ("kernel", "torch"):
            o, s, grads = call(x, arm, lower_bound, neg, v_first)
            runs[arm] = grads
            errs = [f"o {rel_rms(o.cpu(), eo):.2e}", f"s {rel_rms(s.cpu(), es):.2e}"]
            errs += [f"d{n} {rel_rms(grads[n].cpu(), egrads[n]):.2e}" for n in NAMES]
            print(f"  {arm:6s} " + "  ".join(errs))
        print("  dA_log fp64  ", [f"{v:.4e}" for v in egrads["A_log"].tolist()])
        for arm, grads in runs.items():
            print(f"  dA_log {arm:6s}", [f"{v:.4e}" for v in grads["A_log"].cpu().tolist()])
        print("  kernel vs torch: dA_log", f"{rel_rms(runs['kernel']['A_log'].cpu(), runs['torch']['A_log'].cpu()):.2e}",
              " dg", f"{rel_rms(runs['kernel']['g'].cpu(), runs['torch']['g'].cpu()):.2e}",
              " ddt_bias", f"{rel_rms(runs['kernel']['dt_bias'].cpu(), runs['torch']['dt_bias'].cpu()):.2e}")


if __name__ == "__main__":
    main()
