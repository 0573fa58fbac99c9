"""Measure the fit rule's step costs (kda_aot/schedule/fit.py) on this GPU and write its table,
kda_aot/schedule/fit_params/<gpu>.json (the pipeline's costs there are kept)
(or --out). The quarter form (shipped, like split: codegen/catalog.py, build.json) is timed alone too
(rho_quarter_alone, chains = SM / 4) and in the table.

For each walk (kda_fwd_walk, kda_bwd_walk): rho = time of the split walk (two CTAs of 64 value
columns per chain) / time of the full walk (one CTA of 128 columns per chain) with chains = SM
count (two split CTAs share every SM), and rho_alone = the same ratio with chains = SM / 2 (one
split CTA per SM). Equal chain lengths, the walk kernel alone (CUDA events around the launch,
medians, random inputs). The shipped records are enough (split and quarter ship). Also prints the
per-walk table of issue 5 (full vs split over chain counts) with --table.
"""
import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch

from bench.single import inputs
from kda_aot.schedule import fit
from kda_aot._runtime import registry
from kda_aot._runtime.tensor import describe, stream_of
from kda_aot.schedule.kda import CHUNK, chunk_kda_fwd

WALKS = ("kda_fwd_walk", "kda_bwd_walk")


def launch_ms(program, form, desc, stream, iters=15):
    lib = registry.library(program, form)
    times = []
    for i in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        lib.launch(desc, 128 ** -0.5, stream)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def walk_times(docs, heads, chunks_per_chain):
    """{(program, form): ms} for one launch of `docs` x `heads` equal chains."""
    q, k, v, g, beta, cu = inputs([CHUNK * chunks_per_chain] * docs, heads)
    _, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, save_tape=True,
                                walk_form="full")
    tensors = {n: x for n, x in saved.items() if isinstance(x, torch.Tensor)}
    C, N = saved["chunks"].shape[0], docs
    bwd = {n: tensors[n] for n in ("chunks", "seg_chunks", "w", "qg", "kg", "aqk", "gamma")}
    bwd.update(dout=torch.randn_like(q), dtape=torch.empty(C, heads, 128, 128, device="cuda"),
               dinitial_state=torch.empty(N, heads, 128, 128, device="cuda"))
    descs = {"kda_fwd_walk": {n: describe(x, n) for n, x in tensors.items()},
             "kda_bwd_walk": {n: describe(x, n) for n, x in bwd.items()}}
    stream = stream_of(q)
    return {(p, f): launch_ms(p, f, descs[p], stream) for p in WALKS for f in forms_built()}


def forms_built():
    """full and split, and quarter when built for both walks (a build limited by KDA_AOT_PROGRAMS may lack it)."""
    quarter = all(registry.built_forms(p, ("quarter",)) for p in WALKS)
    return ("full", "split", "quarter") if quarter else ("full", "split")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=256, help="chunks per chain")
    ap.add_argument("--table", action="store_true", help="also time chain counts 1, 2, 8, 64, 512 x H")
    ap.add_argument("--out", default=None, help="write the JSON here instead of kda_aot/schedule/fit_params/<gpu>.json "
                    "(a run beside others that read the committed file)")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heads = 2
    shared = walk_times(sms // heads, heads, args.chunks)        # chains = SM count
    alone = walk_times(sms // (2 * heads), heads, args.chunks)   # chains = SM / 2
    progs = {}
    for p in WALKS:
        rho = shared[(p, "split")] / shared[(p, "full")]
        rho_alone = alone[(p, "split")] / alone[(p, "full")]
        print(f"{p}: {args.chunks} chunks per chain; {sms} chains: full {shared[(p, 'full')]:.3f} ms, split "
              f"{shared[(p, 'split')]:.3f} ms, rho {rho:.3f}; {sms // 2} chains: full {alone[(p, 'full')]:.3f} ms, "
              f"split {alone[(p, 'split')]:.3f} ms, rho_alone {rho_alone:.3f}")
        progs[p] = {"rho": round(rho, 4), "rho_alone": round(rho_alone, 4), "gpu": torch.cuda.get_device_name(),
                    "sm_count": sms, "date": datetime.date.today().isoformat(), "chunks_per_chain": args.chunks,
                    "full_ms": round(shared[(p, "full")], 4), "split_ms": round(shared[(p, "split")], 4),
                    "full_alone_ms": round(alone[(p, "full")], 4), "split_alone_ms": round(alone[(p, "split")], 4)}
    if "quarter" in forms_built():  # one quarter CTA per SM: chains = SM / 4
        quarter = walk_times(max(1, sms // (4 * heads)), heads, args.chunks)
        for p in WALKS:
            r = quarter[(p, "quarter")] / quarter[(p, "full")]
            print(f"{p}: {max(1, sms // (4 * heads)) * heads} chains: full {quarter[(p, 'full')]:.3f} ms, split {quarter[(p, 'split')]:.3f} ms, "
                  f"quarter {quarter[(p, 'quarter')]:.3f} ms, rho_quarter_alone {r:.3f}")
            progs[p]["rho_quarter_alone"] = round(r, 4)
    path = Path(args.out) if args.out else fit.params_file()
    gpu = torch.cuda.get_device_name()
    old = fit.params_file(gpu)
    doc = json.loads(old.read_text()) if old.is_file() else {
        "about": f"the fit rule's costs on the {gpu} (programs: bench/measure_rho.py)", "gpu": gpu}
    doc["programs"] = progs
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)  # atomic: a reader never sees a half-written file
    print(f"written {path}")
    if args.table:  # issue 5: per-walk kernel times, full vs split, over chain counts and H
        quarter = "quarter" in forms_built()
        extra = (" quarter ms | full / quarter |", " --- | --- |") if quarter else ("", "")
        print("| walk | chains | H | chunks per chain | full ms | split ms | full / split |" + extra[0])
        print("| --- | --- | --- | --- | --- | --- | --- |" + extra[1])
        for chains, H in ((1, 1), (2, 1), (2, 2), (8, 1), (8, 8), (32, 32), (64, 1), (64, 32), (512, 32)):
            n = 256 if chains <= 64 else 64
            t = walk_times(chains // H, H, n)
            for p in WALKS:
                f, sp = t[(p, "full")], t[(p, "split")]
                row = f"| {p} | {chains} | {H} | {n} | {f:.3f} | {sp:.3f} | {f / sp:.2f} |"
                if quarter:
                    qu = t[(p, "quarter")]
                    row += f" {qu:.3f} | {f / qu:.2f} |"
                print(row)

if __name__ == "__main__":
    main()
