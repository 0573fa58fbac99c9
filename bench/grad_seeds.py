"""The backward's relative errors against the fp64 reference over many seeds, ours and FLA's on the
same inputs: how wide each gradient's error spreads with the inputs, so a test bound is set from a
distribution, not from one seed (device call: `python3 bench/grad_seeds.py [seeds] [pack] [gates]`).

The cases are tests/test_kda_bwd_gpu.py's (`make`: unit-norm q and k, h0, a final-state gradient).
FLA's chunk_kda (with --fla) runs its own forward and backward on the same bf16
inputs; its error is what the problem's bf16 conditioning costs a second, independent implementation.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from reftools import rel_rms  # noqa: E402
from test_kda_fwd_gpu import PACKS, make  # noqa: E402

from kda_aot import reference  # noqa: E402
from kda_aot.schedule.kda import chunk_kda_fwd  # noqa: E402
from kda_aot.schedule.backward import chunk_kda_bwd

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def fla_grads(fla, q, k, v, g, beta, cu, h0, dout, dht):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = fla(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu.long())
    torch.autograd.backward([o, ht], [dout, dht])
    return [x.grad for x in leaves]


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    seeds = int(args[0]) if args else 100
    pack = args[1] if len(args) > 1 else "one"
    gates = args[2].split(",") if len(args) > 2 else ["neg5", "rand"]
    fla = None
    if "--fla" in sys.argv:  # its Triton autotuning of fresh shapes takes minutes on a fresh machine
        from fla.ops.kda import chunk_kda as fla
    lens, H = PACKS[pack], 2
    for gate in gates:
        ours, theirs = {n: [] for n in NAMES}, {n: [] for n in NAMES}
        for s in range(seeds):
            gen = torch.Generator(device="cuda").manual_seed(1000 + s)
            q, k, v, g, beta, cu, h0 = make(lens, H, gate, gen, True)
            T, N = q.shape[1], len(lens)
            dout = torch.randn(1, T, H, 128, device="cuda", generator=gen).to(torch.bfloat16)
            dht = torch.randn(N, H, 128, 128, device="cuda", generator=gen)
            _, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, save_tape=True)
            got = chunk_kda_bwd(saved, dout, dht)
            cpu = [x.cpu() for x in (q, k, v, g, beta)]
            rs = reference.kda_chunked_fwd_saved(*cpu, cu_seqlens=cu.cpu(), initial_state=h0.cpu())
            want = reference.kda_chunked_bwd(rs, dout.cpu(), dht.cpu(), q=cpu[0], k=cpu[1], v=cpu[2],
                                             g=cpu[3], beta=cpu[4])
            for n, x, ref in zip(NAMES, got, want):
                ours[n].append(rel_rms(x.cpu(), ref))
            if fla is not None:
                for n, x, ref in zip(NAMES, fla_grads(fla, q, k, v, g, beta, cu, h0, dout, dht), want):
                    theirs[n].append(rel_rms(x.cpu(), ref.reshape(x.shape)))
        print(f"{pack} {gate}, {seeds} seeds: relative RMS error, median / p99 / max (ours | FLA)")
        for n in NAMES:
            a = torch.tensor(ours[n])
            line = f"  {n:6s} {a.median():.2e} / {a.quantile(0.99):.2e} / {a.max():.2e}"
            if theirs[n]:
                b = torch.tensor(theirs[n])
                line += f"  |  {b.median():.2e} / {b.quantile(0.99):.2e} / {b.max():.2e}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
