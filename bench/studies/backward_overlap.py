"""Do kda_bwd_chunk, kda_bwd_gate and l2norm_bwd overlap when issued on separate streams (docs/backward.md,
"Tried and did not pay")? Interleaved CUDA-event medians of each alone, pairs one after the other and side by
side, and chunk-range pipelines (kda_bwd_chunk of range i + 1 beside the gate of range i, the norms' backward of
range i behind it). Timing only: the side-by-side arms read another arm's outputs.

    python3 bench/studies/backward_overlap.py [Q1] [iters]
"""
import sys
import torch
from bench.common import interleaved
from bench.packs import PACKS
from bench.single import inputs
from kda_aot.ops.norm import l2norm_backward
from kda_aot.schedule import backward as B
from kda_aot.schedule.kda import chunk_kda_fwd

pack = sys.argv[1] if len(sys.argv) > 1 else "Q1"
H = 32
q, k, v, g, beta, cu = inputs(PACKS[pack], H)
cu = cu.cpu()
_, _, saved = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, save_tape=True)
do = torch.randn_like(v)
dtape, _ = B.chunk_kda_bwd_walk(saved, do)
t1 = B.bwd_chunk_tensors(saved, do, dtape)
B.launch_bwd_chunk(t1)
parts = {n: t1[n] for n in B._BWD_CHUNK_OUTPUTS}
tg = B._gate_tensors(saved, parts, "split_staged")
t2 = B.bwd_chunk_tensors(saved, do, dtape)   # outputs of its own: chunk beside the gate reading t1's
C = saved["chunks"].shape[0]
T = v.shape[1]
xs = [torch.randn_like(q) for _ in range(2)]
rs = [torch.rand(1, T, H, device="cuda") + 0.5 for _ in range(2)]
dys = [torch.randn_like(q) for _ in range(2)]
dxs = [torch.empty_like(q) for _ in range(2)]
s1, s2, s3 = (torch.cuda.Stream() for _ in range(3))


def chunk(t=t2, a=0, b=None):
    B.launch_bwd_chunk(t, a, b)


def gate(a=0, b=None):
    if a == 0 and b is None:
        B._launch_gate(tg, "split_staged")
        return
    from kda_aot.schedule import kda
    part = kda._chunk_range(tg, a, b)
    desc = {n: kda.describe(x, n) for n, x in part.items()}
    kda.launch_gated(B.registry.library("kda_bwd_gate", "split_staged"), desc, tg["scale"], kda.stream_of(tg["q"]),
                     None, tg["beta_kind"])


def norms(a=0, b=None):
    for i in range(2):
        sl = slice(a, b)
        l2norm_backward(xs[i][:, sl], rs[i][:, sl], dys[i][:, sl], out=dxs[i][:, sl])


def together(*fns):
    def run():
        main = torch.cuda.current_stream()
        ss = (s1, s2, s3)[:len(fns)]
        for s, fn in zip(ss, fns):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                fn()
        for s in ss:
            main.wait_stream(s)
    return run


def seq(*fns):
    def run():
        for fn in fns:
            fn()
    return run


def pipeline(n, with_norms):
    """chunk(R0); then chunk(Ri+1) on s1 beside gate(Ri) on s2 (after chunk(Ri)), norms(Ri) on s3 after gate(Ri)."""
    cb = [C * i // n for i in range(n + 1)]
    tb = [T * i // n for i in range(n + 1)]

    def run():
        main = torch.cuda.current_stream()
        for s in (s1, s2, s3):
            s.wait_stream(main)
        ev_c, ev_g = [], []
        for i in range(n):
            with torch.cuda.stream(s1):
                chunk(t1, cb[i], cb[i + 1])
                e = torch.cuda.Event(); e.record(s1); ev_c.append(e)
            s2.wait_event(ev_c[i])
            with torch.cuda.stream(s2):
                gate(cb[i], cb[i + 1])
                e = torch.cuda.Event(); e.record(s2); ev_g.append(e)
            if with_norms:
                s3.wait_event(ev_g[i])
                with torch.cuda.stream(s3):
                    norms(tb[i], tb[i + 1])
        for s in (s1, s2, s3):
            main.wait_stream(s)
    return run


arms = {
    "chunk": seq(chunk), "gate": seq(gate), "norms": seq(norms),
    "chunk+gate seq": seq(chunk, gate), "chunk||gate": together(chunk, gate),
    "chunk+norms seq": seq(chunk, norms), "chunk||norms": together(chunk, norms),
    "gate||norms": together(gate, norms),
    "chunk+gate+norms seq": seq(chunk, gate, norms),
    "pipe4": pipeline(4, False), "pipe4+norms": pipeline(4, True), "pipe8+norms": pipeline(8, True),
}
ms = interleaved(arms, iters=int(sys.argv[2]) if len(sys.argv) > 2 else 7, warmup=1)
for name, t in ms.items():
    print(f"{pack} {name:24s} {t:8.2f} ms")
