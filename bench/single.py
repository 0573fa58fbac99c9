"""Single-device KDA benchmark: kda_aot against flash-linear-attention's chunk_kda, same run.

Packs of bench/packs.py, H = 32 by default; inputs random (q, k L2-normalised, g in [-5, 0],
beta in (0, 1)). Boundaries: `fwd` (forward only, no graph) and `fwdbwd` (forward + backward of
o against a random dO, through autograd, leaves' grads reset each step) in both backward modes.
Peak memory = torch's max allocated over one call, inputs included (the same for every arm).
An arm that runs out of memory gets a row with "oom": true instead of a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kda_aot import chunk_kda
from kda_aot.schedule.kda import chunk_kda_fwd
from .common import interleaved, peak_gib, row, with_walk_form
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


def _fwdbwd(fn, leaves, do):
    """One training step of an arm: forward, backward of o against do, grads dropped first."""
    def step():
        for x in leaves:
            x.grad = None
        o = fn()
        o.backward(do)
    return step


def _measure(arms: dict, iters: int) -> tuple[dict, dict]:
    """Peak memory of each arm alone, then interleaved medians of the arms that fit."""
    peaks, fits = {}, {}
    for name, fn in arms.items():
        try:
            peaks[name] = peak_gib(fn)
            fits[name] = fn
        except torch.cuda.OutOfMemoryError:
            peaks[name] = None
        torch.cuda.empty_cache()
    return peaks, interleaved(fits, iters=iters, warmup=2)


def _rows(pack, H, boundary, mode, peaks, ms, base="kda_aot"):
    out = []
    for name, peak in peaks.items():
        fields = dict(pack=pack, heads=H, boundary=boundary, mode=mode, arm=name,
                      walk_form=(name.partition("@")[2] or "auto") if name.startswith("kda_aot") else None)
        if peak is None:
            out.append(row("single", **fields, oom=True))
        else:
            out.append(row("single", **fields, ms=round(ms[name], 3), peak_gib=round(peak, 2)))
    if "fla" in ms and base in ms:
        out.append(row("single", pack=pack, heads=H, boundary=boundary, mode=mode,
                       arm="ratio_fla_over_kda_aot", ratio=round(ms["fla"] / ms[base], 3)))
    return out


def fla_gate_inputs(T: int, H: int) -> tuple:
    """FLA's layer's raw inputs to chunk_kda's activations, fresh: the raw gate [1, T, H, 128] and beta's
    logits [1, T, H] in bf16 (as its projections give them), A_log [H] in FLA's init range, dt_bias [H * 128]."""
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2 ** 63)
    raw = torch.randn(1, T, H, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16)
    a_log = torch.log(torch.rand(H, device="cuda", generator=gen) * 15 + 1)
    dt_bias = 0.1 * torch.randn(H * HEAD_DIM, device="cuda", generator=gen)
    logits = torch.randn(1, T, H, device="cuda", generator=gen).to(torch.bfloat16)
    return raw, a_log, dt_bias, logits


def training_call(q, k, v, g, beta, call: str, backward: str = "replay") -> tuple[list, dict]:
    """(leaves, keywords) of a training step's chunk_kda call, `chunk_kda(*leaves[:5], cu_seqlens=.., **keywords)`,
    the leaves fresh copies that require grad: "log_decay" (g the log decay and beta given, `backward` mode) or
    "fla_layer" (the call FLA's layer makes: a fresh raw bf16 gate with A_log and dt_bias and beta's logits
    activated in the kernels, q and k L2-normalised in the call, the replay backward) or "gate" (the same
    activations in the kernels and the replay backward, q and k as given). The log_decay call's g is uniform in
    [-5, 0], the activated gate is not: per-kernel times of the two calls differ by the gate's values too."""
    kw = dict(backward=backward)
    if call in ("fla_layer", "gate"):
        g, a_log, dt_bias, beta = fla_gate_inputs(q.shape[1], v.shape[2])
        kw = dict(backward="replay", use_qk_l2norm_in_kernel=call == "fla_layer", use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True)
    elif call != "log_decay":
        raise ValueError(f"call: expected log_decay, gate or fla_layer, got {call!r}")
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
    if call in ("fla_layer", "gate"):
        leaves += [a_log.requires_grad_(), dt_bias.requires_grad_()]
        kw.update(A_log=leaves[5], dt_bias=leaves[6])
    return leaves, kw


def _gate_rows(pack, H, q, k, v, beta, cu_host, cu64, fla, iters) -> list:
    """Boundary "gate": a replay training step as FLA's layer calls it - the raw gate (bf16, as its f_proj
    gives it) with A_log and dt_bias, activated by chunk_kda (use_gate_in_kernel), beta as logits
    (use_beta_sigmoid_in_kernel) - against the same step on the activated gate and beta given (arm
    kda_aot, the step of the rows above, the activations not timed) and on the activations run as torch
    operations inside the step (arm kda_aot/torch-gate, what a caller without the flags runs) and by FLA's
    fused_kda_gate kernels (arm kda_aot/fla-gate, beta given as in the precomputed arm); both FLA arms, that one
    and FLA's same call, only when FLA is installed and not left out (--no-fla). Rows: boundary "gate", arms
    kda_aot (precomputed), kda_aot/gate, kda_aot/torch-gate, kda_aot/fla-gate, fla/gate."""
    raw, a_log, dt_bias, logits = (x.requires_grad_() for x in fla_gate_inputs(q.shape[1], H))
    with torch.no_grad():
        g_act = -a_log.exp()[:, None] * F.softplus(raw.float() + dt_bias.view(H, HEAD_DIM))
        b_act = torch.sigmoid(logits.float()).to(torch.bfloat16)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    pre = [g_act.requires_grad_(), b_act.requires_grad_()]
    gated = [raw, a_log, dt_bias, logits]
    do = torch.randn_like(v)
    flags = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)

    def torch_gate():
        g = -a_log.exp()[:, None] * F.softplus(raw.float() + dt_bias.view(H, HEAD_DIM))
        return chunk_kda(*leaves, g, torch.sigmoid(logits.float()).to(torch.bfloat16), cu_seqlens=cu_host)[0]
    arms = {"kda_aot": _fwdbwd(lambda: chunk_kda(*leaves, *pre, cu_seqlens=cu_host)[0], leaves + pre, do),
            "kda_aot/torch-gate": _fwdbwd(torch_gate, leaves + gated, do),
            "kda_aot/gate": _fwdbwd(lambda: chunk_kda(*leaves, raw, logits, A_log=a_log, dt_bias=dt_bias,
                                                      cu_seqlens=cu_host, **flags)[0], leaves + gated, do)}
    if fla is not None:
        from fla.ops.kda.gate import fused_kda_gate  # FLA's own gate kernels (Triton, forward and backward)

        def fla_gate():  # the precomputed-g path at its fastest: FLA's gate kernel, then the step on its fp32 g
            return chunk_kda(*leaves, fused_kda_gate(raw, a_log, dt_bias), pre[1], cu_seqlens=cu_host)[0]
        arms["kda_aot/fla-gate"] = _fwdbwd(fla_gate, leaves + gated + pre[1:], do)
        arms["fla/gate"] = _fwdbwd(lambda: fla(*leaves, raw, logits, A_log=a_log, dt_bias=dt_bias, cu_seqlens=cu64,
                                               **flags)[0], leaves + gated, do)
    rows = _rows(pack, H, "gate", "replay", *_measure(arms, iters))
    ms = {r["arm"]: r["ms"] for r in rows if "ms" in r}
    if "fla/gate" in ms:
        rows.append(row("single", pack=pack, heads=H, boundary="gate", mode="replay",
                        arm="ratio_fla_over_kda_aot", ratio=round(ms["fla/gate"] / ms["kda_aot/gate"], 3)))
    return rows


def run(packs=("Q1",), H: int = 32, iters: int = 10, boundaries=("fwd", "fwdbwd"), with_fla=True,
        walk_forms=("auto",), on_rows=None) -> list[dict]:
    """walk_forms: one kda_aot arm per walk form ("kda_aot" = auto, "kda_aot@full", ...),
    interleaved with each other and with FLA (issue 5: auto vs forced full). on_rows(rows) is called
    after each (pack, boundary, mode), so a run cut short keeps what it measured."""
    rows = []

    def emit(new):
        if on_rows is not None:
            on_rows(new)
        return new

    fla = fla_chunk_kda() if with_fla else None
    names = {wf: "kda_aot" if wf == "auto" else f"kda_aot@{wf}" for wf in walk_forms}
    for pack in packs:
        q, k, v, g, beta, cu = inputs(PACKS[pack], H)
        cu_host, cu64 = cu.cpu(), cu.long()  # ours: CPU boundaries (no host sync); FLA's: its own
        if "fwd" in boundaries:
            arms = {names[wf]: with_walk_form(wf, lambda: chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu_host,
                                                                    output_final_state=True))
                    for wf in walk_forms}
            if fla is not None:
                arms["fla"] = lambda: fla(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu64)
            rows += emit(_rows(pack, H, "fwd", "none", *_measure(arms, iters)))
        if "fwdbwd" in boundaries:
            leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]  # no copies: H = 64 is tight
            do = torch.randn_like(v)
            for mode in ("replay", "saved"):
                arms = {names[wf]: with_walk_form(wf, _fwdbwd(lambda m=mode: chunk_kda(*leaves, cu_seqlens=cu_host,
                                                                                    backward=m)[0], leaves, do))
                        for wf in walk_forms}
                if fla is not None:
                    arms["fla"] = _fwdbwd(lambda: fla(*leaves, cu_seqlens=cu64)[0], leaves, do)
                rows += emit(_rows(pack, H, "fwdbwd", mode, *_measure(arms, iters)))
            del leaves, do
        if "gate" in boundaries:
            rows += emit(_gate_rows(pack, H, q, k, v, beta, cu_host, cu64, fla, iters))
        del q, k, v, g, beta, cu, cu64
        torch.cuda.empty_cache()
    return rows
