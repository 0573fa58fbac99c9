"""Single-device chunked KDA on packed documents (docs/math.md): the kernel calls and their order.

Shapes: v [1, T, H, 128] bf16, g [1, T, H, 128] fp32 (log decay per channel), beta [1, T, H]
bf16; q, k [1, T, H / G, 128] bf16 (grouped value heads: value head h reads q, k head h // G inside the
kernels; G = 1 without grouping; dq, dk come back summed over each group), cu_seqlens [N + 1] (or its kda_aot._runtime.packing.PackTables), initial/final state [N, H, 128, 128]
fp32, one row per segment (a non-empty document). The forward runs two programs: kda_fwd_chunk
(chunk-parallel W, U, Aqk, ...) and kda_fwd_walk (the sequential state walk with the output stage
fused; it also writes the fp32 state at every chunk start and V' when the saved-context backward
needs them). The backward runs kda_bwd_walk (the state-gradient walk), kda_bwd_chunk (plain
products) and kda_bwd_gate (gated products). The public op over both is kda_aot.ops.chunk_kda.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import execute, fit
from .plan import forward_plan
from .. import options
from .._runtime import registry
from .._runtime.tensor import check_kda_shapes, describe, out_or, stream_of
from .._runtime.packing import CHUNK, HEAD_DIM, PackTables, pack_tables

MAX_HEADS = 64
GATE_FLOOR = -20.0  # every program sums max(g, GATE_FLOOR) (templates/common/kda.h: -kGateFloor)


def entering_decay(g_first: torch.Tensor, floor: float = GATE_FLOOR) -> torch.Tensor:
    """e^(g - max(g, floor)) of each document's first token, [..., K] -> [..., K, 1] fp32: the part of
    its decay that a program flooring g at `floor` leaves out. An initial state multiplied by it
    enters the programs exactly (S_1 = (I - b k k^T) e^g h0 for any g), and its gradient is the
    programs' times it: dh0 is then as accurate below the floor as above (it is e^g-small there, so
    the floor alone made its relative error e^(floor - g))."""
    return torch.exp(torch.clamp(g_first.float() - floor, max=0.0)).unsqueeze(-1)


GATE_RAW, GATE_SOFTPLUS, GATE_SIGMOID = 0, 1, 2  # templates/common/kda.h GateKind


@dataclass(frozen=True)
class GateActivation:
    """The gate's activation inside kda_fwd_chunk and kda_bwd_gate (templates/common/kda.h KdaGate): with it
    g is the raw gate x, and the log decay is -exp(A_log) softplus(x + dt_bias) (GATE_SOFTPLUS) or
    lower_bound sigmoid(exp(A_log) (x + dt_bias)) (GATE_SIGMOID); the backward's dg is then x's gradient,
    and it gives A_log's and dt_bias's (kda_aot.reference.kda_gate is the same formula in torch)."""
    kind: int
    a_log: Optional[torch.Tensor]    # [H] fp32, contiguous (None: exp(A_log) = 1, GATE_SIGMOID only)
    dt_bias: Optional[torch.Tensor]  # [H, 128] fp32, contiguous, or None
    lower_bound: float = 0.0

    def heads(self, a: int, b: int) -> "GateActivation":
        """The activation of heads [a, b) (the replay's head groups)."""
        part = lambda x: None if x is None else x[a:b].contiguous()  # noqa: E731
        return GateActivation(self.kind, part(self.a_log), part(self.dt_bias), self.lower_bound)

    def descriptors(self) -> dict:
        return {name: describe(x, name) for name, x in (("gate_a_log", self.a_log), ("gate_dt_bias", self.dt_bias))
                if x is not None}


# beta's activation inside kda_fwd_chunk, kda_bwd_chunk and kda_bwd_gate (templates/common/kda.h BetaKind): with
# BETA_SIGMOID / BETA_SIGMOID_2 the beta tensor holds the logits b (bf16, or fp32) and each program forms sigmoid(b)
# (2 sigmoid(b)) in fp32 on load; the backward's dbeta is then b's gradient (beta_logits_grad).
BETA_PLAIN, BETA_SIGMOID, BETA_SIGMOID_2 = 0, 1, 2
BETA_KINDS = (BETA_PLAIN, BETA_SIGMOID, BETA_SIGMOID_2)


def beta_logits_grad(dbeta: torch.Tensor, logits: torch.Tensor, kind: int) -> torch.Tensor:
    """b's gradient from beta's (fp32): dbeta scale sigma(b) (1 - sigma(b)) with sigma in fp32, in the order of
    FLA's fused_beta_sigmoid_bwd (scale 2 for BETA_SIGMOID_2)."""
    s = torch.sigmoid(logits.float())
    return dbeta * (2.0 if kind == BETA_SIGMOID_2 else 1.0) * s * (1.0 - s)


def beta_launch_args(kind: int) -> dict:
    """The keyword a launch of a program that reads beta takes for beta's activation (none without it)."""
    return {} if kind == BETA_PLAIN else {"beta_kind": kind}


def launch_gated(library, desc: dict, scale: float, stream, gate: Optional[GateActivation],
                 beta_kind: int = BETA_PLAIN):
    """A launch of kda_fwd_chunk or kda_bwd_gate (the programs that read g and beta) with the gate's activation
    where given (positional: gate_kind, lower_bound) and beta's (beta_launch_args: a keyword, only with it)."""
    args = ()
    if gate is not None:
        desc = {**desc, **gate.descriptors()}
        args = (gate.kind, gate.lower_bound)
    library.launch(desc, scale, stream, *args, **beta_launch_args(beta_kind))


def first_tokens(g: torch.Tensor, tables: PackTables) -> torch.Tensor:
    """g [1, T, H, K] at each segment's first token: [n_segments, H, K]."""
    return g[0].index_select(0, tables.cu[:-1])


def check_shapes(q, k, v, g, beta, initial_state=None, packed=True) -> int:
    """The KDA tensors as the kernels take them (check_kda_shapes at head dim 128, at most MAX_HEADS heads), for
    the public op (packed=False: B sequences) and the programs' callers (packed: B = 1), with the initial state's
    type and device. Returns HV. (Dtypes and the states' rows are the callers'.)"""
    HV = check_kda_shapes(q, k, v, g, beta, packed=packed, head_dim=HEAD_DIM, max_heads=MAX_HEADS)
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state: expected a torch.Tensor, got {type(initial_state).__name__}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state: on {initial_state.device} but q is on {q.device}")
    return HV


def _check(q, k, v, g, beta, cu_seqlens, initial_state) -> PackTables:
    H = check_shapes(q, k, v, g, beta, initial_state)
    tables = tables_of(cu_seqlens, q.shape[1], q.device)
    N = tables.n_segments
    if initial_state is not None and tuple(initial_state.shape) != (N, H, HEAD_DIM, HEAD_DIM):
        rows = "" if N == tables.n_docs else " (one row per non-empty document: kda_aot.chunk_kda maps documents)"
        raise ValueError(f"initial_state: expected shape [{N}, {H}, 128, 128]{rows}, got {list(initial_state.shape)}")
    return tables


def tables_of(cu_seqlens, T: int, device) -> PackTables:
    """The pack's tables: cu_seqlens (a tensor, validated and cached by value) or its PackTables."""
    return cu_seqlens if isinstance(cu_seqlens, PackTables) else pack_tables(cu_seqlens, T, device)


@functools.lru_cache(maxsize=None)
def device_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


_SIDE_STREAMS: dict = {}


def _side_streams(device: torch.device, n: int, pool: str) -> list:
    """n streams of `device` for concurrent launches, one pool per user (each walk program, the
    replay's forward walk), taken once from PyTorch's high-priority pool (the default-priority pool
    is the one NCCL and most users draw from)."""
    have = _SIDE_STREAMS.setdefault((device, pool), [])
    while len(have) < n:
        have.append(torch.cuda.Stream(device, priority=-1))
    return have[:n]


@contextlib.contextmanager
def forked(device: torch.device, n: int, pool: str):
    """n side streams (_side_streams) that start after the work queued so far on the current stream, and that the
    current stream waits for on exit - also when a launch raises, since queued work may still read the caller's
    tensors. The one fork and join of the launches planned outside a PipelinePlan (execute.run joins its own)."""
    main = torch.cuda.current_stream(device)
    streams = _side_streams(device, n, pool)
    for st in streams:
        st.wait_stream(main)
    try:
        yield streams
    finally:
        for st in streams:
            main.wait_stream(st)


# Descriptor entries with one row per segment: a launch over segments [a, b) gets rows [a, b).
_PER_SEGMENT = ("initial_state", "final_state", "dfinal_state", "dinitial_state", "u_lo_end")
# Chunk-indexed tensors of the chunk-parallel programs: a launch over chunks [first, end) gets them
# narrowed; the token-indexed ones stay whole (each chunk reads and writes its own tokens).
_PER_CHUNK = ("chunks", "gamma", "tape", "dtape", "dgam_s", "end_segment")


def _chunk_range(t: dict, first: int = 0, end: int | None = None) -> dict:
    """The tensors of t (None and non-tensors left out) for a launch over chunks [first, end)."""
    part = {name: x for name, x in t.items() if isinstance(x, torch.Tensor)}
    if first != 0 or end is not None:
        part.update({name: part[name][first:end] for name in _PER_CHUNK if name in part})
    return part


def _launch_walk(program: str, t: dict, chain_lengths, H: int, scale: float, device, walk_form, sm_count=None,
                 pool=None) -> tuple:
    """Launch a state walk (kda_fwd_walk, kda_bwd_walk) over the tensors `t` as the fit rule plans it:
    one launch per run of segments of one form; several runs go on side streams that fork from and
    join the current stream, so they overlap. Split runs are launched first: the fit rule assumes
    their CTAs get SMs of their own and the full runs take the SMs left over. pool: the side-stream
    pool (default: the program's; walks that run at the same time need pools of their own).
    Returns the plan."""
    plan = fit.plan_walk(program, chain_lengths, H, sm_count or device_sms(device), walk_form)
    tensors = {name: x for name, x in t.items() if isinstance(x, torch.Tensor)}
    if len(plan) == 1:
        desc = {name: describe(x, name) for name, x in tensors.items()}
        registry.library(program, plan[0][0], device).launch(desc, scale, stream_of(tensors["seg_chunks"]))
        return plan
    with forked(device, len(plan), pool or program) as streams:
        for (form, a, b), st in zip(sorted(plan, key=lambda run: run[0] != "split"), streams):
            part = dict(tensors, seg_chunks=tensors["seg_chunks"][a:b + 1])
            part.update({name: tensors[name][a:b] for name in _PER_SEGMENT if name in tensors})
            desc = {name: describe(x, name) for name, x in part.items()}
            registry.library(program, form, device).launch(desc, scale, st.cuda_stream)
    return plan


# What the forward of a replay call keeps beside its inputs for the replay's chunk stage (_chunk_stage_tensors).
REPLAY_KEPT = ("aqk", "inv_pack")
CHUNK_FORM = "lean"  # kda_fwd_chunk (`replay`: the replay's stage, _chunk_stage_tensors; lean_prof: bench/chunk_profile.py)
GATE_FORMS = ("split_staged", "full")  # kda_bwd_gate: the shipped form first, then the test-only check of its split


def _pick_form(what: str, form, forms: tuple) -> str:
    """The argument, else the current Options' `what`, else the shipped form; checked."""
    form = form or getattr(options.current(), what) or forms[0]
    if form not in forms:
        raise ValueError(f"{what}: expected one of {forms}, got {form!r}")
    return form


def chunk_kda_prepare(q, k, v, g, beta, *, cu_seqlens, scale=None, initial_state=None, save_tape=False, gate=None,
                      beta_kind=BETA_PLAIN, keep=False, kept=None, final_state=False, final_segments=None):
    """The chunk-parallel forward stage alone (kda_fwd_chunk): returns the saved-context dict with
    W, U, Q e^Gamma, K e^(gamma - Gamma), Aqk, gamma (and (I + L)^-1 with save_tape), ready for
    chunk_kda_walk. It needs no entering state, so context parallelism runs it before the exchange.
    beta_kind: one of BETA_KINDS; keep, kept, final_state, final_segments: as _chunk_stage_tensors' (with
    final_state the walk's final states are chunk_kda_fwd's; without, its end states are those the CP summaries
    take)."""
    t = _chunk_stage_tensors(q, k, v, g, beta, cu_seqlens, scale, initial_state, save_tape, gate=gate,
                             beta_kind=beta_kind, keep=keep, kept=kept, final_state=final_state,
                             final_segments=final_segments)
    _launch_chunk_stage(t, initial_state)
    return t


def _chunk_stage_tensors(q, k, v, g, beta, cu_seqlens, scale, initial_state, save_tape, out=None,
                         gate: Optional[GateActivation] = None, beta_kind: int = BETA_PLAIN, *, keep: bool = False,
                         kept: Optional[dict] = None, final_state: bool = False,
                         final_segments: Optional[Sequence[int]] = None) -> dict:
    """Checked inputs and the chunk stage's outputs, allocated (nothing launched); `out` may hold a
    preallocated gamma; gate: the gate's activation (g the raw gate), beta_kind: beta's activation (beta the
    logits), both kept for the backward.
    keep (the forward of a replay training call): the stage also writes inv_pack, which the replay reads with
    tril(Aqk) (the forward's aqk) instead of forming both again. kept (REPLAY_KEPT's tensors of such a forward;
    with save_tape): the replay's chunk stage, form `replay`, reading them; it writes (I + L)^-1 for kda_bwd_chunk
    and neither aqk nor aqk_diag_lo (only the forward walk's output stage reads the last).
    final_state (a forward that returns the final states): the stage also writes U's rounding error over each
    segment's last chunk (u_lo_end, where end_segment says), which the walk adds to the final state;
    final_segments: those segments only (context parallelism: the fragments that end their document here; a
    sender's end state is what another rank continues from)."""
    if beta_kind not in BETA_KINDS:
        raise ValueError(f"beta_kind: expected 0, 1 (sigmoid) or 2 (2 sigmoid), got {beta_kind}")
    if (keep and save_tape) or (kept is not None and not save_tape):
        raise ValueError("keep: the replay's forward (no tape); kept: the replay's chunk stage (save_tape)")
    tables = _check(q, k, v, g, beta, cu_seqlens, initial_state)
    T, H = v.shape[1], v.shape[2]
    C = tables.chunks.shape[0]
    bf16 = dict(device=q.device, dtype=torch.bfloat16)
    f32 = dict(device=q.device, dtype=torch.float32)
    if kept is not None:  # (their shapes and dtypes: the binding's checks, at the stage's first launch)
        extra = {**{name: kept[name] for name in REPLAY_KEPT}, "aqk_diag_lo": None, "chunk_form": "replay"}
    else:
        extra = {"aqk": torch.empty(1, T, H, CHUNK, **bf16), "aqk_diag_lo": torch.empty(1, T, H, **f32),
                 "inv_pack": torch.empty(1, T, H, CHUNK, **bf16) if keep else None}
    return {
        "q": q, "k": k, "v": v, "g": g, "beta": beta,
        "chunks": tables.chunks, "seg_chunks": tables.seg_chunks,
        "w": torch.empty(1, T, H, HEAD_DIM, **bf16), "u": torch.empty(1, T, H, HEAD_DIM, **bf16),
        "qg": torch.empty(1, T, H, HEAD_DIM, **bf16), "kg": torch.empty(1, T, H, HEAD_DIM, **bf16),
        **extra,
        "gamma": out_or(out or {}, "gamma", lambda: torch.empty(C, H, HEAD_DIM, **f32)),
        "akk_inv": torch.empty(1, T, H, CHUNK, **bf16) if save_tape else None,
        **({"u_lo_end": torch.empty(tables.n_segments, CHUNK, H, HEAD_DIM, **bf16),
            "end_segment": tables.end_segment if final_segments is None else tables.end_segment_of(
                tuple(final_segments))} if final_state and kept is None else {}),
        "scale": HEAD_DIM ** -0.5 if scale is None else float(scale),  # the backward reads it from here
        "chain_lengths": tables.chain_lengths,  # the walks' fit rule
        "gate": gate,
        "beta_kind": beta_kind,
    }


def _launch_chunk_stage(t: dict, initial_state, first: int = 0, end: int | None = None, form: str = ""):
    """kda_fwd_chunk over chunks [first, end) (all by default): the per-chunk tensors (chunks,
    gamma) narrowed to them, the token-indexed ones whole (each chunk writes its own tokens). form: the
    argument, else t's (the replay's chunk stage: `replay`), else CHUNK_FORM."""
    form = form or t.get("chunk_form") or CHUNK_FORM
    part = _chunk_range(t, first, end)
    desc = {name: describe(x, name) for name, x in part.items()}
    if initial_state is not None:  # checked (dtype, shape, device) with everything else, before any launch
        desc["initial_state"] = describe(initial_state, "initial_state")
    launch_gated(registry.library("kda_fwd_chunk", form, t["q"].device), desc, t["scale"], stream_of(t["q"]), t["gate"],
                 t["beta_kind"])


def _walk_outputs(v, N: int, C: int, out, *, save_tape: bool, want_output: bool, output_final_state: bool) -> dict:
    """The forward walk's outputs (tape, vnew, o, final_state; None where not asked for; H: v's heads), taken
    from `out` where the caller preallocated them, else allocated on the current stream."""
    out = out or {}
    T, H = v.shape[1], v.shape[2]
    bf16 = dict(device=v.device, dtype=torch.bfloat16)
    f32 = dict(device=v.device, dtype=torch.float32)
    return {
        "tape": out_or(out, "tape", lambda: torch.empty(C, H, HEAD_DIM, HEAD_DIM, **f32)) if save_tape else None,
        "vnew": out_or(out, "vnew", lambda: torch.empty(1, T, H, HEAD_DIM, **bf16)) if save_tape else None,
        "o": out_or(out, "o", lambda: torch.empty(1, T, H, HEAD_DIM, **bf16)) if want_output else None,
        "final_state": (out_or(out, "final_state", lambda: torch.empty(N, H, HEAD_DIM, HEAD_DIM, **f32))
                        if output_final_state else None),
    }


def chunk_kda_walk(prepared: dict, *, initial_state=None, output_final_state=False, save_tape=False, out=None,
                   walk_form=None, want_output=True, sm_count=None, pool=None):
    """The forward walk (kda_fwd_walk) over chunk_kda_prepare's result, output stage fused: returns
    (o or None, final_state or None, saved) with saved = prepared plus the tape and V' (save_tape).
    `out` may hold preallocated o, final_state, tape, vnew. sm_count: the SMs the fit rule plans
    for (default: the device's; the replay plans each of its two concurrent walks on half); pool: the
    side-stream pool of a mixed plan (walks running at the same time need pools of their own)."""
    v = prepared["v"]
    H = v.shape[2]
    N, C = prepared["seg_chunks"].numel() - 1, prepared["chunks"].shape[0]
    if save_tape and prepared.get("akk_inv") is None:
        raise ValueError("save_tape: prepare the chunk stage with save_tape=True too (the backward reads (I + L)^-1)")
    t = dict(prepared, initial_state=initial_state,
             **_walk_outputs(v, N, C, out, save_tape=save_tape, want_output=want_output,
                             output_final_state=output_final_state))
    if not save_tape:
        t["akk_inv"] = None
    if not output_final_state:
        t.pop("u_lo_end", None)
    _launch_walk("kda_fwd_walk", t, prepared["chain_lengths"], H, t["scale"], v.device, walk_form, sm_count, pool)
    return t["o"], t["final_state"], _without_forward_only(t)


def _without_forward_only(saved: dict) -> dict:
    """A forward's saved context without what its walk alone reads (the last chunks' U rounding error)."""
    for name in ("u_lo_end", "end_segment"):
        saved.pop(name, None)
    return saved


def chunk_kda_fwd(q, k, v, g, beta, *, cu_seqlens, scale=None, initial_state=None, output_final_state=False,
                  save_tape=False, out=None, walk_form=None, want_output=True, pipeline=None, gate=None,
                  beta_kind=BETA_PLAIN, keep=False):
    """Forward kernels (chunk_kda_prepare, then chunk_kda_walk): returns (o or None, final_state or None,
    saved), saved = the chunk intermediates, plus the fp32 state tape, V' and (I + L)^-1 when
    `save_tape` (what the backward needs). `out` may hold preallocated o, final_state, tape, vnew,
    gamma (tests poison them). walk_form: auto | full | split | quarter (default: Options.walk_form,
    auto = the fit rule). want_output=False: the walk skips the output stage (the replay
    backward and the CP summaries need the tape and states only; bitwise the same).
    pipeline: run the chunk stage a segment group at a time, each group's walk beside the chunk
    stage of the groups after it (grouping.plan_pipeline; bitwise the same). Default: Options.pipeline.
    gate: a GateActivation (g the raw gate; the chunk stage forms the log decay). beta_kind: one of BETA_KINDS
    (beta the logits with BETA_SIGMOID, BETA_SIGMOID_2). keep: saved also holds what the replay backward reads
    from the forward (aqk, inv_pack: _chunk_stage_tensors)."""
    prepared = _chunk_stage_tensors(q, k, v, g, beta, cu_seqlens, scale, initial_state, save_tape, out, gate,
                                    beta_kind, keep=keep, final_state=output_final_state)
    walk_args = dict(initial_state=initial_state, output_final_state=output_final_state, save_tape=save_tape,
                     walk_form=walk_form, want_output=want_output)
    # Tensors off the GPU take the plain order: its first launch refuses them with the binding's message.
    if not _pipeline_on(pipeline) or len(prepared["chain_lengths"]) < 2 or not _on_gpu(q):
        _launch_chunk_stage(prepared, initial_state)
        return chunk_kda_walk(prepared, out=out, **walk_args)
    return _fwd_pipelined(prepared, out, **walk_args)


def _on_gpu(x) -> bool:
    """Whether the pipelined order can run (side streams): tensors on the GPU."""
    return x.is_cuda


def _pipeline_on(pipeline=None) -> bool:
    """The pipelined order (chunk_kda_fwd, the replay): the argument, else Options.pipeline (the plain
    order gives bitwise the same results)."""
    return options.current().pipeline if pipeline is None else bool(pipeline)


def _fwd_pipelined(prepared: dict, out, *, initial_state, output_final_state, save_tape,
                   walk_form, want_output, deferred=(), exchange=None, senders=(), exchange_beside=False,
                   summarised=None):
    """chunk_kda_fwd in the pipelined order (plan.forward_plan, run by execute.run): each group's walk on a
    side stream beside the later groups' chunk stage. Same kernels on the same data per chunk and per chain
    as the plain order: bitwise the same. The outputs are allocated before, on the current stream.
    deferred, exchange, senders (context parallelism, chunk_kda_fwd_deferred): the `senders` segments go
    first (their walks' final states are what other ranks wait for); the walks of the `deferred` segments
    are left out of the groups; the plan's exchange node (plan.RunExchange) runs once the whole chunk stage
    is queued: exchange.run(prepared, final_state), after the senders' walks, gives the deferred segments'
    entering states (in `deferred`'s order, sorted), and they are walked from them beside the other walks:
    on the current stream after the whole chunk stage, or (exchange_beside) on a stream of its own that waits
    for what came before this forward, the senders' walks and the chunk stage of the `summarised` segments
    (the deferred ones whose summaries the exchange computes; default: all) only, the deferred walks then for
    their own chunk stage - not for the rest of the chunk stage, which the walks beside it may slow: the
    exchange goes as soon as the ranks' senders are done."""
    v = prepared["v"]
    H = v.shape[2]
    N, C = len(prepared["chain_lengths"]), prepared["chunks"].shape[0]
    full = _walk_outputs(v, N, C, out, save_tape=save_tape, want_output=want_output,
                         output_final_state=output_final_state)
    plan = forward_plan(prepared["chain_lengths"], H, device_sms(v.device), first=senders, deferred=deferred,
                        cp=exchange is not None, summarised=summarised, exchange_beside=exchange_beside)
    piece_chunks, handoff = execute.piece_buffers(plan, H, v.device, ("handoff",))
    buffers = {"initial_state": initial_state, "final_state": full["final_state"], **handoff}
    execute.run(plan, execute.Call(prepared, buffers, full, save_tape=save_tape, want_output=want_output,
                                   walk_form=walk_form, piece_chunks=piece_chunks, exchange=exchange))
    saved = _without_forward_only(dict(prepared, initial_state=initial_state, **full))
    if not save_tape:
        saved["akk_inv"] = None
    return full["o"], full["final_state"], saved


def chunk_kda_fwd_deferred(q, k, v, g, beta, *, cu_seqlens, scale, initial_state, deferred, exchange, save_tape,
                           senders=(), exchange_beside=False, summarised=None, keep=False, final_segments=()):
    """The pipelined forward (output and final states) for context parallelism: the chunk stage a
    segment group at a time, the walks of the segments whose entering state is known here
    (initial_state's rows; the `deferred` rows are not read) beside it, the `senders` segments first;
    once the chunk stage is queued and the senders' walks are done, exchange.run(prepared, final_state) -
    the summaries that read the chunk stage, the senders' final states, the exchange - returns the
    deferred segments' entering states [len(deferred), H, 128, 128] (sorted order; used as fp32), and their
    walks run beside the others. The exchange runs on every call (it is collective).
    exchange_beside, summarised: see _fwd_pipelined (the tensors the exchange makes are then made on that
    stream; summarised: the deferred segments it reads the chunk stage of, default all).
    Returns (o, final_state [N, H, 128, 128], saved); every segment's walk is the plain one: bitwise.
    keep: saved also holds what the replay reads back (_chunk_stage_tensors). final_segments: the segments whose
    final state is an output (they carry their last chunk's U rounding error: _chunk_stage_tensors)."""
    prepared = _chunk_stage_tensors(q, k, v, g, beta, cu_seqlens, scale, initial_state, save_tape, keep=keep,
                                    final_state=bool(final_segments), final_segments=tuple(final_segments))
    o, final, saved = _fwd_pipelined(prepared, None, initial_state=initial_state, output_final_state=True,
                                     save_tape=save_tape, walk_form=None, want_output=True, deferred=deferred,
                                     exchange=exchange, senders=senders, exchange_beside=exchange_beside,
                                     summarised=summarised)
    saved["initial_state"] = None  # its deferred rows were placeholders (the backward reads the tape)
    return o, final, saved


def segments_view(prepared: dict, first: int, end: int) -> dict:
    """`prepared` seen as a pack of its segments [first, end) (seg_chunks narrowed to them; every
    other tensor shared): the walks and the transfer walk then run on those segments alone."""
    t = dict(prepared)
    t["seg_chunks"] = prepared["seg_chunks"][first:end + 1]
    t["chain_lengths"] = prepared["chain_lengths"][first:end]
    if t.get("u_lo_end") is not None:
        t["u_lo_end"] = t["u_lo_end"][first:end]
    return t


def piece_view(prepared: dict, segment: int, chunks: torch.Tensor, bounds, p: int) -> dict:
    """`prepared` seen as piece p of its one segment `segment`, cut at chunk `bounds` (grouping.pieced_group;
    `chunks`: the same bounds on the device, int32): a walk over it starts from the piece before's end
    state."""
    t = dict(segments_view(prepared, segment, segment + 1), seg_chunks=chunks[p:p + 2],
             chain_lengths=(bounds[p + 1] - bounds[p],))
    if p + 2 < len(bounds):  # its end is no segment's (end_segment -1 there), and the chunk stage of the
        t.pop("u_lo_end", None)  # pieces after it, beside which it runs, writes the segment's row
    return t


def segment_view(prepared: dict, segment: int) -> dict:
    """`prepared` seen as a pack of its one segment `segment`."""
    return segments_view(prepared, segment, segment + 1)


def chunk_kda_transfer(saved: dict):
    """M = A_n ... A_1 of every segment of a forward run or chunk_kda_prepare's result (kcp_transfer,
    split-bf16 products): S_out = M S_in + B with B the segment's final state from a zero entering
    state. [N, H, 128, 128] fp32 (N = 1 on a segment_view)."""
    q = saved["q"]
    N, H = saved["seg_chunks"].numel() - 1, saved["w"].shape[2]
    t = {name: saved[name] for name in ("q", "chunks", "seg_chunks", "w", "kg", "gamma")}
    t["transfer"] = torch.empty(N, H, HEAD_DIM, HEAD_DIM, device=q.device, dtype=torch.float32)
    desc = {name: describe(x, name) for name, x in t.items()}
    registry.library("kcp_transfer", "full", q.device).launch(desc, saved["scale"], stream_of(q))
    return t["transfer"]
