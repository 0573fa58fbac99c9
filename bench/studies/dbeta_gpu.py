"""Study (device): dbeta per token on the GPU (kda_aot, FLA 0.6.0 when installed) and in the emulation on the
same inputs (the device's CPUs), for the suite's dbeta cases and their draws (bench/numerics.py's seeds).

    python3 bench/studies/dbeta_gpu.py --out $OUT [--draws 8] [--procs 16]

$OUT/dbeta_gpu.pt: per (case, draw) the documents' bounds and dbeta [T, H] of the fp64 reference, the GPU's
arms and the emulated arms (fixed, fla); $OUT/inputs_<case>_<draw>.pt: the inputs of draw 0 (g left out when
constant), for term-by-term work on the CPU. Prints each draw's errors and how far the emulation is from the
GPU per token (||gpu - emu|| / ||ref||).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "studies")]

CASES = ("H4/const-8/beta2/noinit", "H4/const-8/beta2/init", "H4/unif-60/beta1/init")


def emulate(path):
    """The emulated arms' dbeta on one saved input (a worker: one thread)."""
    torch.set_num_threads(1)
    import kda_emulation as E
    x = torch.load(path)
    return {"emu_fixed": E.run_kda(x, E.FIXED)["dbeta"][0], "emu_fla": E.run_fla(x)["dbeta"][0]}


def rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--procs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=2101)
    a = ap.parse_args(argv)
    from bench import numerics as N
    out = Path(a.out)
    tmp = Path("/tmp/dbeta_gpu")
    tmp.mkdir(exist_ok=True)
    fla = N.fla_op()
    lens = N.pack(a.seed)
    index = {c[0]: (i, c) for i, c in enumerate(N.cases(False))}
    rows = []
    for name in CASES:
        i, (_, H, kind, beta_max, init) = index[name]
        for draw in range(a.draws if "const-8" in name else 1):
            x = N.make_case(lens, H, kind, beta_max, init, a.seed * 1000 + i + 100_000 * draw)
            ref = N.ref_chunked(x)["dbeta"][0].cpu()
            row = dict(case=name, draw=draw, cu=x["cu"].tolist(), ref=ref, gpu_kda=N.run_kda(x)["dbeta"][0].cpu())
            if fla is not None:
                row["gpu_fla"] = N.run_fla(fla, x)["dbeta"][0].cpu()
            xc = {n: (v.cpu() if torch.is_tensor(v) else v) for n, v in x.items()}
            xc["cu"] = x["cu"].tolist()
            row["input"] = str(tmp / f"x{len(rows)}.pt")
            torch.save(xc, row["input"])
            if draw == 0:
                if kind.startswith("const"):
                    xc = dict(xc, g=None, g_const=float(kind[5:]))
                torch.save(xc, out / f"inputs_{name.replace('/', '_')}_{draw}.pt")
            rows.append(row)
            print(f"{name} draw {draw}: gpu kda {rel(row['gpu_kda'], ref):.3e}"
                  + (f" fla {rel(row['gpu_fla'], ref):.3e}" if fla is not None else ""), flush=True)
    with mp.get_context("spawn").Pool(a.procs) as pool:
        for row, emu in zip(rows, pool.map(emulate, [r["input"] for r in rows])):
            row.update(emu)
    for row in rows:
        ref = row["ref"]
        last = torch.tensor([c - 1 for c in row["cu"][1:]])
        cells = [f"{k}={rel(row[k], ref):.3e}" for k in ("gpu_kda", "gpu_fla", "emu_fixed", "emu_fla") if k in row]
        gap = [f"|gpu_kda-emu_fixed|={rel(row['gpu_kda'].double() - row['emu_fixed'].double() + ref, ref):.2e}"]
        if "gpu_fla" in row:
            gap.append(f"|gpu_fla-emu_fla|={rel(row['gpu_fla'].double() - row['emu_fla'].double() + ref, ref):.2e}")
        err = row["gpu_kda"].double() - ref
        share = (err[last] ** 2).sum().item() / (err ** 2).sum().item()
        print(f"{row['case']} {row['draw']}: " + " ".join(cells + gap) + f" last-token share of err^2 {share:.3f}",
              flush=True)
        del row["input"]
    torch.save(rows, out / "dbeta_gpu.pt")


if __name__ == "__main__":
    main()
