"""Single-device KDA benchmark: kda_aot against flash-linear-attention's chunk_kda, same run.

Packs of DESIGN.md §5, H = 32 by default; inputs random (q, k L2-normalised, g in [-5, 0],
beta in (0, 1)). For now the forward only (the backward kernels are the next stage of issue 3).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import registry
from ..kda import chunk_kda_fwd
from .common import interleaved, peak_gib, row
from .packs import HEAD_DIM, PACKS


def fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


def inputs(lens, H, seed=None):
    T = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(seed if seed is not None else torch.seed() % 2 ** 63)
    q = F.normalize(torch.randn(1, T, H, HEAD_DIM, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
    k = F.normalize(torch.randn(1, T, H, HEAD_DIM, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, T, H, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16)
    g = -5 * torch.rand(1, T, H, HEAD_DIM, device="cuda", generator=gen)
    beta = torch.rand(1, T, H, device="cuda", generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    return q, k, v, g, beta, cu


def run(packs=("Q1",), H: int = 32, iters: int = 10) -> list[dict]:
    rows = []
    fla = fla_chunk_kda()
    for pack in packs:
        q, k, v, g, beta, cu = inputs(PACKS[pack], H)
        arms = {"kda_aot": lambda: chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)}
        try:  # the split walk form, when built (test-only until the fit rule ships it)
            registry.library("kda_fwd_tape", "split")
            arms["kda_aot:split"] = lambda: chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True,
                                                          tape_form="split")
        except registry.RecordError:
            pass
        if fla is not None:
            cu64 = cu.long()
            arms["fla"] = lambda: fla(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu64)
        peaks = {name: peak_gib(fn) for name, fn in arms.items()}
        ms = interleaved(arms, iters=iters, warmup=2)
        for name, t in ms.items():
            rows.append(row("single", pack=pack, heads=H, boundary="fwd", mode="none", arm=name,
                            walk_form={"kda_aot": "full", "kda_aot:split": "split"}.get(name), ms=round(t, 3),
                            peak_gib=round(peaks[name], 2)))
        if "fla" in ms:
            rows.append(row("single", pack=pack, heads=H, boundary="fwd", mode="none",
                            arm="ratio_fla_over_kda_aot", ratio=round(ms["fla"] / ms["kda_aot"], 3)))
        del q, k, v, g, beta, cu, arms
        torch.cuda.empty_cache()
    return rows
