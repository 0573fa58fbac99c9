"""chunk_kda_cp: KDA over a packed sequence split across the ranks of a process group.

Forward (per call, on every rank of the group, in the same order):
    agreement check -> summaries of the local fragments that others wait for -> exchange
    (one all_gather, fp32) -> compose the entering state of every local fragment -> local
    chunked forward with those states -> o (+ final states of the documents that end here).
    A backend with forward_pipelined (CUDA; the default order, _pipeline_on) runs it as one GPU
    runs its forward: the chunk stage a group at a time beside the walks that need no entering
    state - the ones whose exit state others wait for first, that state being their walk's final
    state - then the middle fragments' summaries and the exchange, then the remaining walks.
Backward (mirrors it, see summaries.py for the maths and why no gradient through M is needed):
    the local entering-state gradients with dS_out = 0, D (only where a fragment's entering-state
    gradient is wanted by a fragment before it; the backend's state walk alone, so that the
    ranks waiting for D start their backward early; in replay mode a backend with a `replay`
    hook runs it beside the replayed forward walk) -> exchange (M, D) -> compose dS_out of every
    local fragment -> local backward with the true dS_out -> grads of q, k, v, g, beta (and
    initial_state).

Modes: "saved" keeps the forward's local context (autograd graph / tape) until the backward;
"replay" keeps only the inputs and the entering states and recomputes the local forward and
the local M's in the backward. Both run the same arithmetic on the same values, so their
gradients are bitwise equal.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from .. import options
from ..ops.gate import activate, expand_heads
from .._runtime.packing import PLANNED_FROM_HOST
from ..schedule import kda
from . import keys
from .backends import backend_name, get_backend
from .exchange import check_agreement, exchange, resolve_group
from .plan import CPPlan
from .summaries import backward_payload_size, compose_entering_states, compose_exit_grads, exit_state, forward_payload_size

__all__ = ["chunk_kda_cp", "chunk_kda_cp_agreed", "kda_facts", "BACKWARD_MODES", "phase_times"]

BACKWARD_MODES = ("replay", "saved")

# Phase timing for the CP benchmark (issue 4: time in communication vs in the summary walks):
# with Options.debug_timing every call appends (phase, start event, end event) on its device's
# current stream (host clocks on the CPU); phase_times() syncs and returns {phase: [ms, ...]}.
_PHASES: list = []


def _clock(device: torch.device):
    if device.type == "cuda":
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()


class _Phase:
    def __init__(self, name: str, device: torch.device):
        self.name, self.device = name, device
        self.on = options.current().debug_timing

    def __enter__(self):
        self.start = _clock(self.device) if self.on else None
        return self

    def __exit__(self, *exc):
        if self.on:
            _PHASES.append((self.name, self.start, _clock(self.device)))
        return False


def phase_times(clear: bool = True) -> dict:
    """{phase: [milliseconds per call]} recorded since the last clear (see Options.debug_timing)."""
    out: dict = {}
    for name, a, b in _PHASES:
        if isinstance(a, float):
            ms = (b - a) * 1e3
        else:
            b.synchronize()
            ms = a.elapsed_time(b)
        out.setdefault(name, []).append(ms)
    if clear:
        _PHASES.clear()
    return out


def _validate(q, k, v, g, beta, initial_state, plan: CPPlan) -> Optional[str]:
    """This rank's input problems as one message (None: fine). Never raises: a rank that
    raised here alone would leave the others waiting in the agreement collective."""
    try:
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            if not isinstance(t, torch.Tensor):
                return f"{name}: expected a torch.Tensor, got {type(t).__name__}"
        if q.dim() != 4 or q.shape[0] != 1:
            return f"q must be [1, T_local, H, K], got {list(q.shape)}"
        _, T, H, K = q.shape
        V = v.shape[-1] if v.dim() == 4 else -1
        if T != plan.num_local_tokens:
            return (f"q holds {T} local tokens but the plan gives rank {plan.rank} "
                    f"{plan.num_local_tokens} (layout {plan.layout})")
        for name, t, shape in (("k", k, (1, T, H, K)), ("v", v, (1, T, H, V)),
                               ("g", g, (1, T, H, K)), ("beta", beta, (1, T, H))):
            if tuple(t.shape) != shape:
                return f"{name} must be {list(shape)}, got {list(t.shape)}"
        for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
            if t.device != q.device:
                return f"{name} is on {t.device} but q is on {q.device}"
        if initial_state is not None:
            shape = (plan.num_docs, H, K, V)
            if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != shape:
                return (f"initial_state must be a tensor {list(shape)} (one row per global "
                        f"document), got {getattr(initial_state, 'shape', initial_state)}")
    except Exception as e:  # pragma: no cover - defensive: report instead of raising alone
        return f"invalid input: {type(e).__name__}: {e}"
    return None


def _prepare(backend, local, q, k, v, g, beta, plan: CPPlan, scale, keep):
    """The backend's state-free part of the local forward, when it has one (else None)."""
    prepare = getattr(backend, "prepare", None)
    if prepare is None or not local:
        return None
    return prepare(q, k, v, g, beta, plan.local_cu_seqlens, scale, keep)


def _summary(backend, prepared, f, k, v, g, beta, need_b: bool):
    """(M, B) of local fragment f (B may be None when not needed): bitwise the same either way."""
    if prepared is not None:
        return backend.summary_of(prepared, f.segment, need_b)
    return backend.summary(k, v, g, beta, f.local_start, f.local_start + f.length)


def _batched_summaries_on() -> bool:
    """A backend's summaries_of, all fragments at once in pieces (Options.cp_batched_summaries; off:
    one summary per fragment, the slower order kept to check the batched one bitwise)."""
    return options.current().cp_batched_summaries


def _summaries(backend, prepared, local, frags, k, v, g, beta, need_b: bool) -> dict:
    """{f.index: (M, B or None)} of the local fragments `frags`. Batched (summaries_of) when the
    backend has it and Options.cp_batched_summaries is on, its pieces planned on the fragments the forward summarises
    (every local fragment but the last of its document) in both passes, so that the backward's M
    are the forward's bits; else one summary per fragment."""
    if prepared is not None and frags and _batched_summaries_on() and hasattr(backend, "summaries_of"):
        planned = [f.segment for f in local if not f.is_last]
        got = backend.summaries_of(prepared, [(f.segment, need_b) for f in frags], planned)
        return {f.index: mb for f, mb in zip(frags, got)}
    return {f.index: _summary(backend, prepared, f, k, v, g, beta, need_b) for f in frags}


def _pipeline_on() -> bool:
    """A backend's pipelined orders, as on one GPU (the chunk stage a segment group at a time beside
    the walks): forward_pipelined in the forward (the walks of fragments that start their document
    here beside the chunk stage, those whose exit state others wait for first; then the summaries,
    the exchange and the other walks) and replay_pipelined in the replay backward, whose backward
    walk runs in full there for the fragments that end their document (their exit-state gradient is
    known: no second walk; rewalk for the others). Options.cp_pipeline off: the plain order (prepare,
    summaries, exchange, forward), within the fp32 summary bound of it."""
    return options.current().cp_pipeline


def _forward(backend, prepared, q, k, v, g, beta, plan: CPPlan, states, scale, keep):
    """The local forward with entering states (the rest of it when `prepared`)."""
    extra = {} if prepared is None else {"prepared": prepared}
    return backend.forward(q, k, v, g, beta, plan.local_cu_seqlens, states, scale, keep=keep, **extra)


class _Context:
    """What the CP forward leaves for its backward (held under the op's handle: kda_aot.cp.keys), its
    tensors detached."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = keys.detached(tensors)

    def __setattr__(self, name, value):
        object.__setattr__(self, name, keys.detached(value))


def entering_decay(g, plan: CPPlan, f, backend) -> torch.Tensor:
    """kda_aot.schedule.kda.entering_decay of the first token of fragment f (one that starts its
    document here) under the backend's gate floor: the initial state's factor and its gradient's."""
    return kda.entering_decay(g[0, plan.local_cu_seqlens[f.segment]], backend.gate_floor)


def _cp_forward(ctx, q, k, v, g, beta, initial_state, plan: CPPlan, group, scale, want_final, mode, backend):
    """The CP forward (collective): (o, final_state or [0]); fills ctx for _cp_backward."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))  # the kernels read them densely
    H, K, V = q.shape[2], q.shape[3], v.shape[-1]
    sd = backend.state_dtype
    local = plan.local_fragments
    keep = mode == "saved"

    middle = [f for f in local if f.needs_state and not f.is_last]  # summarised whatever the order

    def known_state(f):  # the entering state of a fragment that starts its document here
        return (torch.zeros(H, K, V, dtype=sd, device=q.device) if initial_state is None
                else initial_state[f.doc].to(sd) * entering_decay(g, plan, f, backend))

    def entering_states(prepared, finals=None):
        """Steps 1-2: what the others wait for ((M, B) of middle fragments, exit states of first
        ones: from the summaries, or the local walks' final states `finals` when given), the
        exchange, and the local fragments' entering states composed from it."""
        items, M_local = {}, {}
        summarised = middle if finals is not None else [f for f in local if not f.is_last]
        with _Phase("fwd summary walks", q.device):
            summaries = _summaries(backend, prepared, local, summarised, k, v, g, beta, need_b=True)
            for f in local:
                if f.is_last:
                    continue
                if f.needs_state:
                    M, B = summaries[f.index]
                    items[f.index] = torch.cat([M.reshape(-1), B.reshape(-1)])
                    M_local[f.index] = M
                elif finals is not None:
                    items[f.index] = finals[f.segment]
                else:
                    M, B = summaries[f.index]
                    items[f.index] = exit_state(M, B, None if initial_state is None else known_state(f))
        with _Phase("fwd exchange", q.device):
            published = exchange(plan, group, forward_payload_size(H, K, V), items, sd, like=q)
        return compose_entering_states(plan, published, H, K, V, local), M_local

    pipelined = getattr(backend, "forward_pipelined", None) if _pipeline_on() and local else None
    if pipelined is not None:
        # 0-3 beside each other: the chunk stage a segment group at a time with the walks of the
        # fragments whose entering state is known here, first those of the fragments that others
        # wait for (their exit state is their walk's final state: no summary walk); once it is
        # queued, the middle fragments' summaries, the exchange, then the other fragments' walks
        # (the backend's pipelined order)
        got = {}

        def entering(prepared, finals):
            got["S_in"], got["M_local"] = entering_states(prepared, finals)
            later = [got["S_in"][f.index].to(q.device) for f in local if f.needs_state]  # segment order
            return torch.stack(later) if later else torch.zeros(0, H, K, V, dtype=sd, device=q.device)
        with _Phase("fwd local", q.device):
            o, finals, lctx = pipelined(q, k, v, g, beta, plan.local_cu_seqlens, scale, keep,
                                        torch.stack([known_state(f) for f in local]),
                                        [f.segment for f in local if f.needs_state], entering,
                                        [f.segment for f in local if not f.needs_state and not f.is_last],
                                        [f.segment for f in middle])
        S_in, M_local = got["S_in"], got["M_local"]
        if q.is_cuda:  # made on the backend's exchange stream, read on this one from here on
            main = torch.cuda.current_stream(q.device)
            for t in (*S_in.values(), *M_local.values()):
                t.record_stream(main)
    else:
        # 0. the local work that needs no entering state (a backend that can split it off), so
        #    that it runs while this rank waits for the others' summaries.
        prepared = _prepare(backend, local, q, k, v, g, beta, plan, scale, keep=keep)
        S_in, M_local = entering_states(prepared)

    # 2. entering states of the local fragments, then (not pipelined) the local forward.
    states = [S_in[f.index].to(q.device) if f.needs_state else known_state(f) for f in local]
    final = (torch.zeros(plan.num_docs, H, K, V, dtype=sd, device=q.device) if want_final
             else torch.zeros(0, dtype=sd, device=q.device))
    if local:
        states = torch.stack(states)
        if pipelined is None:
            with _Phase("fwd local", q.device):
                o, finals, lctx = _forward(backend, prepared, q, k, v, g, beta, plan, states, scale, keep=keep)
        if want_final:
            for f in local:
                if f.is_last:
                    final[f.doc] = finals[f.segment]
        o = o.to(q.dtype)
    else:
        states, lctx = torch.zeros(0, H, K, V, dtype=sd, device=q.device), None
        o = torch.zeros(1, 0, H, V, dtype=q.dtype, device=q.device)

    ctx.cfg = (plan, group, scale, want_final, mode, backend, (H, K, V),
               initial_state is not None)
    ctx.dtypes = tuple(x.dtype for x in (q, k, v, g, beta))
    ctx.h0_dtype = None if initial_state is None else initial_state.dtype
    ctx.decays = ({} if initial_state is None else
                  {f.segment: entering_decay(g, plan, f, backend) for f in local if f.position == 0})
    if mode == "saved":
        ctx.lctx, ctx.M_local = lctx, M_local
        ctx.save_for_backward(states)
    else:
        ctx.save_for_backward(q, k, v, g, beta, states)
    return o, final


def _cp_backward(ctx, do, dfinal):
    """The CP backward (collective) of a _cp_forward: (dq, dk, dv, dg, dbeta, d_initial_state or None)."""
    plan, group, scale, want_final, mode, backend, (H, K, V), has_h0 = ctx.cfg
    sd = backend.state_dtype
    local = plan.local_fragments
    if mode == "saved":
        if ctx.lctx is None and plan.local_fragments:
            raise RuntimeError("chunk_kda_cp(backward='saved'): the saved context went with the first backward; "
                               "backward='replay' can run a backward again (retain_graph=True)")
        (states,) = ctx.saved_tensors
        lctx, M_local = ctx.lctx, ctx.M_local
        ctx.lctx = ctx.M_local = None          # free the saved context as soon as possible
    device = do.device
    # Exit-state gradients known locally: the final-state gradient of documents that end here.
    known = torch.zeros(len(local), H, K, V, dtype=sd, device=device)
    if want_final and dfinal is not None:
        for f in local:
            if f.is_last:
                known[f.segment] = dfinal[f.doc].to(sd)
    need_d = any(f.needs_state for f in local)
    first_pass = walk = None
    if mode != "saved":
        q, k, v, g, beta, states = ctx.saved_tensors
        lctx, M_local = None, {}
        if local:
            # Replay: the same calls on the same values as the forward -> bitwise the same.
            replay = getattr(backend, "replay", None)
            replay_pipelined = getattr(backend, "replay_pipelined", None) if _pipeline_on() else None
            with _Phase("bwd replay", q.device):
                if replay_pipelined is not None:
                    # the chunk stage and both walks pipelined, the backward walk in full (its tape
                    # too) from the exit-state gradients known here: the fragments that end their
                    # document are done with it, the others walk again once theirs arrive (rewalk);
                    # those that also start their document here are left out of this first walk (no
                    # D is wanted of them). The saved context holds the chunk stage's outputs, which
                    # the summaries read.
                    lctx, walk = replay_pipelined(q, k, v, g, beta, plan.local_cu_seqlens, scale, states,
                                                  do, known, [f.segment for f in local
                                                              if not f.is_last and not f.needs_state])
                    first_pass, prepared = walk[1], lctx
                else:
                    prepared = _prepare(backend, local, q, k, v, g, beta, plan, scale, keep=True)
                    if replay is not None and prepared is not None:
                        # the forward walk and the walk for D side by side (the backend's choice)
                        lctx, first_pass = replay(prepared, states, do, known if need_d else None)
                    else:
                        _, _, lctx = _forward(backend, prepared, q, k, v, g, beta, plan, states, scale,
                                              keep=True)
            with _Phase("bwd summary walks", q.device):
                frags = [f for f in local if f.needs_state and not f.is_last]
                M_local = {i: mb[0] for i, mb in
                           _summaries(backend, prepared, local, frags, k, v, g, beta, need_b=False).items()}

    # 1. D (dS_out = 0) of the local fragments whose entering-state gradient others wait for.
    if need_d and first_pass is None:
        state_grads = getattr(backend, "state_grads", None)
        with _Phase("bwd summary walks", device):
            first_pass = (state_grads(lctx, do, known) if state_grads is not None
                          else backend.backward(lctx, do, known)[5])
    items = {}
    for f in local:
        if f.needs_state:
            D = first_pass[f.segment]
            items[f.index] = D if f.is_last else torch.cat([M_local[f.index].reshape(-1),
                                                             D.reshape(-1)])
    with _Phase("bwd exchange", device):
        published = exchange(plan, group, backward_payload_size(H, K, V), items, sd, like=do)

    # 2. true exit-state gradients, then the local backward with them.
    dS_out = compose_exit_grads(plan, published, H, K, V, local)
    dtypes = ctx.dtypes
    if not local:
        grads = [torch.zeros(1, 0, *shape, dtype=dt, device=device) for shape, dt in
                 zip(((H, K), (H, K), (H, V), (H, K), (H,)), dtypes)]
        dh0 = (torch.zeros(plan.num_docs, H, K, V, dtype=ctx.h0_dtype, device=device)
               if has_h0 else None)
        return (*grads, dh0)
    true = known.clone()
    for f in local:
        if not f.is_last:
            true[f.segment] = dS_out[f.index].to(device)
    with _Phase("bwd local", device):
        if walk is not None:
            final_pass = backend.backward(lctx, do, true, walk=walk,
                                          rewalk=[f.segment for f in local if not f.is_last])
        else:
            final_pass = backend.backward(lctx, do, true)
    grads = [gr.to(dt) for gr, dt in zip(final_pass[:5], dtypes)]
    dh0 = None
    if has_h0:
        # Rows of documents whose first fragment is here; zero elsewhere (an all_reduce(SUM)
        # over the group gives the full initial-state gradient).
        dh0 = torch.zeros(plan.num_docs, H, K, V, dtype=ctx.h0_dtype, device=device)
        for f in local:
            if f.position == 0:
                dh0[f.doc] = (final_pass[5][f.segment] * ctx.decays[f.segment]).to(ctx.h0_dtype)
    return (*grads, dh0)


# ---------------------------------------------------------------------------- the custom ops
# kda_aot::chunk_kda_cp_fwd / _bwd: the op's forward and backward as torch.library custom ops (so that
# torch.compile traces a CP step into one graph); the plan travels as its key tensor, the group and the
# backend as strings (kda_aot.cp.keys), the forward's context as a handle tensor. The implementations run
# with autocast off: the summaries' compositions are fp32 products by design.

@torch.library.custom_op("kda_aot::chunk_kda_cp_fwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def chunk_kda_cp_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        initial_state: Optional[torch.Tensor], plan: torch.Tensor, num_docs: int, group: str,
                        scale: float, output_final_state: bool, backward: str, backend: str, agree: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collective: (o, final_state [num_docs, H, K, V] or [0], the context handle). agree: check the ranks'
    agreement first (else the caller did: PackedKDA's one check)."""
    plan_obj, group_obj, backend_obj = keys.lookup(plan), keys.group_of(group), get_backend(backend)
    with torch.autocast(q.device.type, enabled=False):
        if agree:
            _, facts, problem, _ = kda_facts(q, k, v, g, beta, initial_state, plan_obj, scale, backward,
                                             backend_obj)
            check_agreement("chunk_kda_cp", plan_obj, group_obj, facts, problem, q)
        ctx = _Context()
        o, final = _cp_forward(ctx, q, k, v, g, beta, initial_state, plan_obj, group_obj, scale,
                               output_final_state, backward, backend_obj)
    return o.contiguous(), final, keys.stash(ctx)


@chunk_kda_cp_fwd_op.register_fake
def _(q, k, v, g, beta, initial_state, plan, num_docs, group, scale, output_final_state, backward, backend, agree):
    H, K, V = q.shape[2], q.shape[3], v.shape[-1]
    sd = get_backend(backend).state_dtype
    final = q.new_empty((num_docs, H, K, V), dtype=sd) if output_final_state else q.new_empty((0,), dtype=sd)
    return q.new_empty((1, q.shape[1], H, V)), final, torch.empty(1, dtype=torch.int64, device="cpu")


@torch.library.custom_op("kda_aot::chunk_kda_cp_bwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def chunk_kda_cp_bwd_op(handle: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, initial_state: Optional[torch.Tensor], do: torch.Tensor,
                        dfinal_state: Optional[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collective: (dq, dk, dv, dg, dbeta, d_initial_state or [0]) of the forward behind `handle`
    (q ... initial_state: the forward's inputs, for the gradients' shapes)."""
    with torch.autocast(q.device.type, enabled=False):
        grads = _cp_backward(keys.context_of(handle), do, dfinal_state)
    return (*(x.contiguous() for x in grads[:5]), q.new_empty((0,)) if grads[5] is None else grads[5].contiguous())


@chunk_kda_cp_bwd_op.register_fake
def _(handle, q, k, v, g, beta, initial_state, do, dfinal_state):
    dh0 = q.new_empty((0,)) if initial_state is None else initial_state.new_empty(initial_state.shape)
    return (*(x.new_empty(x.shape) for x in (q, k, v, g, beta)), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state = inputs[:6]
    ctx.has_initial_state = initial_state is not None
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(output[2], q, k, v, g, beta, initial_state)
    ctx.mark_non_differentiable(output[2])
    keys.adopt(ctx, output[2])


def _backward(ctx, do, dfinal_state, _):
    handle, q, k, v, g, beta, h0 = ctx.saved_tensors
    if do is None:
        do = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    grads = chunk_kda_cp_bwd_op(keys.handle_for(ctx, handle), q, k, v, g, beta, h0, do, dfinal_state)
    return (*grads[:5], grads[5] if ctx.has_initial_state else None) + (None,) * 8


chunk_kda_cp_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def chunk_kda_cp(q, k, v, g, beta, *, plan: CPPlan, group=None, scale: Optional[float] = None,
                 initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                 backward: str = "replay", backend="auto", use_gate_in_kernel: bool = False, A_log=None,
                 dt_bias=None, lower_bound: Optional[float] = None, safe_gate: bool = False,
                 use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False):
    """Context-parallel KDA on this rank's LOCAL shards. Collective: every rank of `group`
    calls it with the same plan (built for its rank), in the same order; so is the backward.

    q, k [1, T_local, H, K], v [1, T_local, H, V], g [1, T_local, H, K] (log decay, <= 0),
    beta [1, T_local, H]; T_local = plan.num_local_tokens, tokens in plan.token_map order.
    initial_state: [N, H, K, V] (one row per global document) or None; only the rows of the
    documents whose first fragment is on this rank are read.
    scale: defaults to K ** -0.5. backward: "replay" | "saved" (bitwise-equal gradients).
    backend: "auto" (kda_aot.registry.auto_backend: the kernels for bf16 tensors on a GPU they serve) | "reference"
    (kda_aot.reference in fp32) | "cuda" (the kernels) | a backend object.

    Returns (o [1, T_local, H, V] in q's dtype, final_state or None). final_state is
    [N, H, K, V] fp32 holding the final states of the documents whose last fragment is on this
    rank, zero rows elsewhere (all_reduce(SUM) over the group gives all of them). Likewise the
    gradient of initial_state has the rows of the documents that start on this rank.

    FLA's per-token activations, as kda_aot.chunk_kda takes them (no communication: each rank activates
    its own tokens): use_gate_in_kernel with A_log, dt_bias, lower_bound, safe_gate (g the raw gate);
    use_beta_sigmoid_in_kernel, allow_neg_eigval (beta the logits); grouped value heads (v, g, beta and
    the states with HV heads, a multiple of q's and k's H).

    Inputs, agreement: all ranks must agree on the plan, H, K, V and scale; a rank whose local
    shapes do not match the plan, or a disagreement, raises a ValueError on every rank.
    The backward is collective too: every rank must back-propagate through its o (or
    final_state), including a rank that holds no token (its o is [1, 0, H, V]), in the same
    order as the other ranks' CP calls.
    """
    backend, scale = kda_config(q, plan, scale, backward, backend)
    group, _, _ = resolve_group(group)
    g, beta = activate(q, v, g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                       lower_bound=lower_bound, safe_gate=safe_gate, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                       allow_neg_eigval=allow_neg_eigval,
                       beta_dtype=beta.dtype if beta.dtype in (torch.float32, torch.float64) else torch.bfloat16)
    q, k = expand_heads(q, k, v.shape[2])
    return _apply(q, k, v, g, beta, plan, group, scale, initial_state, output_final_state, backward, backend,
                  agree=True)


def kda_config(q, plan: CPPlan, scale, backward: str, backend):
    """(backend object, scale) of a chunk_kda_cp call, raising on arguments that are wrong on every rank alike
    (mode, plan type, backend); reads nothing of the plan (torch.compile would guard on it): its facts are
    checked inside the op (kda_facts, check_agreement)."""
    if backward not in BACKWARD_MODES:
        raise ValueError(f"backward must be one of {', '.join(BACKWARD_MODES)}, got {backward!r}")
    if not isinstance(plan, CPPlan):
        raise TypeError(f"plan: expected a kda_aot.cp.CPPlan (see kda_aot.cp.make_plan), "
                        f"got {type(plan).__name__}")
    backend = get_backend(backend, like=q)
    K = q.shape[3] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
    return backend, (K ** -0.5 if scale is None and K else scale)


def kda_facts(q, k, v, g, beta, initial_state, plan: CPPlan, scale, backward: str, backend):
    """(backend object, facts every rank must agree on, this rank's problem or None, scale) of a
    chunk_kda_cp call (kda_config, then the plan's checks); raises as kda_config does."""
    backend, scale = kda_config(q, plan, scale, backward, backend)
    problem = _validate(q, k, v, g, beta, initial_state, plan)
    shape = tuple(q.shape) if isinstance(q, torch.Tensor) else ()
    facts = {"H": shape[2] if len(shape) == 4 else None, "K": shape[3] if len(shape) == 4 else None,
             "V": v.shape[-1] if isinstance(v, torch.Tensor) and v.dim() else None,
             "scale": float(scale) if scale is not None else None,
             "state dtype": backend.state_dtype, "backend": backend.name}
    return backend, facts, problem, scale


def chunk_kda_cp_agreed(q, k, v, g, beta, *, plan: CPPlan, group, scale: float, initial_state, output_final_state,
                        backward: str, backend):
    """chunk_kda_cp once the ranks have agreed (check_agreement on kda_facts, e.g. PackedKDA's one
    check for its whole call): group resolved, scale set, backend an object."""
    return _apply(q, k, v, g, beta, plan, group, scale, initial_state, output_final_state, backward, backend,
                  agree=False)


def _apply(q, k, v, g, beta, plan, group, scale, initial_state, output_final_state, backward, backend, agree):
    # Without a backward to come (inference, no_grad), "saved" would keep a graph for nothing.
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    o, final, _ = chunk_kda_cp_fwd_op(q, k, v, g, beta, initial_state, plan.key_tensor, plan.num_docs,
                                      group.group_name, float(scale), bool(output_final_state),
                                      backward if needs_grad else "replay", backend_name(backend), agree)
    return o, (final if output_final_state else None)
