"""Causal conv1d + SiLU benchmark: kda_aot against flash-linear-attention's causal_conv1d, same run.

Pack Q1 with D = 3 * 32 * 128 (q, k and v of 32 heads). Bytes moved (bf16): forward reads x and
writes y; backward reads x and dy and writes dx. Bandwidth = bytes / median time, against the
device copy ceiling measured in the same run.
"""
from __future__ import annotations

import torch

from kda_aot._runtime import registry
from kda_aot.ops.conv import causal_conv1d_silu, conv1d_silu_backward, conv1d_silu_forward
from .common import copy_ceiling_tbps, interleaved, row
from .packs import HEAD_DIM, HEADS_DEFAULT, PACKS


def fla_conv():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        return None
    return causal_conv1d


def built_forms(program: str) -> list[str]:
    """Forms of `program` whose libraries are built here (test-only variants when built with them;
    short_tiles exists to check edges, not to be timed)."""
    return [f for f in registry.built_forms(program) if not f.endswith("short_tiles")]


def run(pack: str = "Q1", D: int = 3 * HEADS_DEFAULT * HEAD_DIM, iters: int = 20) -> list[dict]:
    lens = PACKS[pack]
    T = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2 ** 63)
    x = torch.randn(1, T, D, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(D, 4, device="cuda", generator=gen) * 0.5).to(torch.bfloat16).requires_grad_()
    b = (torch.randn(D, device="cuda", generator=gen) * 0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(1, T, D, device="cuda", generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    w32, b32 = w.detach().float(), b.detach().float()
    xd = x.detach()

    def ours_fwd():
        with torch.no_grad():
            causal_conv1d_silu(x, w, b, cu_seqlens=cu)

    def ours_fwdbwd():
        y = causal_conv1d_silu(x, w, b, cu_seqlens=cu)
        torch.autograd.grad(y, (x, w, b), dy)

    arms = {"kda_aot/fwd": ours_fwd, "kda_aot/fwdbwd": ours_fwdbwd}
    for form in built_forms("conv1d_silu_fwd"):
        arm = "kda_aot" if form == "default" else f"kda_aot:{form}"
        arms[f"{arm}/fwd_kernel"] = lambda form=form: conv1d_silu_forward(xd, w32, b32, cu, form=form)
    for form in built_forms("conv1d_silu_bwd"):
        arm = "kda_aot" if form == "default" else f"kda_aot:{form}"
        arms[f"{arm}/bwd_kernel"] = lambda form=form: conv1d_silu_backward(xd, w32, b32, cu, dy, form=form)
    fla = fla_conv()
    if fla is not None:
        def fla_fwd():
            with torch.no_grad():
                fla(x, w, b, activation="silu", cu_seqlens=cu)

        def fla_fwdbwd():
            y, _ = fla(x, w, b, activation="silu", cu_seqlens=cu)
            torch.autograd.grad(y, (x, w, b), dy)

        arms.update({"fla/fwd": fla_fwd, "fla/fwdbwd": fla_fwdbwd})
    ms = interleaved(arms, iters=iters)
    ceiling = copy_ceiling_tbps()

    elem = T * D * 2
    bytes_moved = {"fwd": 2 * elem, "fwdbwd": 5 * elem, "fwd_kernel": 2 * elem, "bwd_kernel": 3 * elem}
    rows = []
    for name, t in ms.items():
        arm, boundary = name.split("/")
        tbps = bytes_moved[boundary] / (t * 1e-3) / 1e12
        rows.append(row("conv", pack=pack, heads=HEADS_DEFAULT, D=D, T=T, boundary=boundary, mode="none",
                        arm=arm, ms=round(t, 4), gbytes=round(bytes_moved[boundary] / 1e9, 3),
                        tbps=round(tbps, 3), copy_ceiling_tbps=round(ceiling, 3),
                        pct_copy_ceiling=round(100 * tbps / ceiling, 1)))
    for boundary in ("fwd", "fwdbwd"):
        if f"fla/{boundary}" in ms:
            rows.append(row("conv", pack=pack, heads=HEADS_DEFAULT, D=D, T=T, boundary=boundary, mode="none",
                            arm="ratio_fla_over_kda_aot",
                            ratio=round(ms[f"fla/{boundary}"] / ms[f"kda_aot/{boundary}"], 3)))
    return rows
