"""Measure rho for the fit rule (kda_aot/fit.py) on this GPU and write kda_aot/fit_params.json.

rho = time per chunk step of the split walk (two CTAs of 64 value columns per chain, two resident
per SM) / time per chunk step of the full walk (one CTA of 128 columns per chain, one per SM),
with exactly one full CTA per SM (chains = SM count, equal lengths), the walk kernel alone
(CUDA events around the launch, medians, random inputs). Needs the split record built
(KDA_AOT_TEST_RECORDS=1).
"""
import datetime
import json
import statistics
import sys

import torch

from kda_aot import fit, registry
from kda_aot._tensor import describe, stream_of
from kda_aot.bench.single import inputs
from kda_aot.kda import chunk_kda_fwd


def walk_ms(saved, form, iters=20):
    lib = registry.library("kda_fwd_tape", form)
    desc = {n: describe(x, n) for n, x in saved.items() if isinstance(x, torch.Tensor)}
    times = []
    for i in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        lib.launch(desc, 128 ** -0.5, stream_of(saved["q"]))
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(chunks_per_chain: int = 256):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heads = 4
    docs = sms // heads  # chains = docs * heads = SM count (132 = 33 x 4 on the H200)
    q, k, v, g, beta, cu = inputs([64 * chunks_per_chain] * docs, heads)
    _, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, tape_form="full")
    full, split = walk_ms(saved, "full"), walk_ms(saved, "split")
    rho = split / full
    print(f"chains {docs * heads} x {chunks_per_chain} chunks: full {full:.3f} ms, split {split:.3f} ms, rho {rho:.3f}")
    doc = {"about": "rho of the fit rule, measured by bench/measure_rho.py", "programs": {
        "kda_fwd_tape": {"rho": round(rho, 4), "gpu": torch.cuda.get_device_name(),
                         "sm_count": sms, "date": datetime.date.today().isoformat(),
                         "full_ms": round(full, 4), "split_ms": round(split, 4)}}}
    fit.PARAMS_FILE.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(f"written {fit.PARAMS_FILE}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
