"""The CP forward and backward as collectives (kda_aot.cp.ops wraps them in custom ops and autograd).

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

import torch
from .. import options
from ..schedule import kda
from . import keys
from .exchange import exchange
from .plan import CPPlan
from .summaries import backward_payload_size, compose_entering_states, compose_exit_grads, exit_state, forward_payload_size


# Phase timing for the CP benchmark (time in communication vs in the summary walks):
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

def _prepare(backend, local, q, k, v, g, beta, plan: CPPlan, scale, keep, **replay):
    """The backend's state-free part of the local forward, when it has one (else None). replay: keep_replay or
    kept (a backend with replay_keeps), and final_segments (one with final_state_lo)."""
    prepare = getattr(backend, "prepare", None)
    if prepare is None or not local:
        return None
    return prepare(q, k, v, g, beta, plan.local_cu_seqlens, scale, keep, **replay)


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


def _forward(backend, prepared, q, k, v, g, beta, plan: CPPlan, states, scale, keep, **replay):
    """The local forward with entering states (the rest of it when `prepared`); replay: keep_replay."""
    extra = {} if prepared is None else {"prepared": prepared}
    return backend.forward(q, k, v, g, beta, plan.local_cu_seqlens, states, scale, keep=keep, **extra, **replay)


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
    first = g[0, plan.local_cu_seqlens[f.segment]]
    floor = getattr(backend, "gate_floor", None)
    if floor is None:  # a backend that does not floor g takes the initial state as it is
        return torch.ones(*first.shape, 1, dtype=torch.float32, device=first.device)
    return kda.entering_decay(first, floor)


def pipelined_roles(local) -> tuple:
    """(deferred, senders, summarised): the segments of a rank's local fragments by their part in the
    pipelined CP forward. deferred: those that enter with another rank's state (walked after the
    exchange); senders: those that start their document and hand their exit state on (walked first,
    their final state sent); summarised: the deferred ones that hand a state on too (their summaries
    go in the exchange)."""
    deferred = tuple(f.segment for f in local if f.needs_state)
    senders = tuple(f.segment for f in local if not f.needs_state and not f.is_last)
    summarised = tuple(f.segment for f in local if f.needs_state and not f.is_last)
    return deferred, senders, summarised


class _ForwardExchange:
    """The CP forward's exchange node (kda_aot.schedule.plan.RunExchange) in the backend's pipelined forward:
    run(prepared, final_state) makes the summaries, exchanges them and returns the deferred fragments'
    entering states in segment order; it keeps S_in and M_local, which the rest of the forward reads."""

    def __init__(self, entering_states, local, shape: tuple, dtype, device):
        self.entering_states, self.local = entering_states, local
        self.shape, self.dtype, self.device = shape, dtype, device
        self.S_in = self.M_local = None

    def run(self, prepared, final_state):
        self.S_in, self.M_local = self.entering_states(prepared, final_state)
        later = [self.S_in[f.index].to(self.device) for f in self.local if f.needs_state]  # segment order
        return torch.stack(later) if later else torch.zeros(0, *self.shape, dtype=self.dtype, device=self.device)


def _cp_forward(ctx, q, k, v, g, beta, initial_state, plan: CPPlan, group, scale, want_final, mode, backend):
    """The CP forward (collective): (o, final_state or [0]); fills ctx for _cp_backward."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))  # the kernels read them densely
    H, K, V = v.shape[2], q.shape[3], v.shape[-1]  # H: the value heads (grouped ones: q, k have fewer)
    sd = backend.state_dtype
    local = plan.local_fragments
    keep = mode == "saved"
    # "replay" with a backend that can: the forward keeps what the replay's chunk stage reads back (backends.py)
    replay = {"keep_replay": True} if mode == "replay" and getattr(backend, "replay_keeps", False) else {}

    deferred, senders, summarised = pipelined_roles(local)
    middle = [f for f in local if f.segment in summarised]  # summarised whatever the order
    # the final states that are outputs carry their last chunk's U rounding error, where the backend can
    ends = tuple(f.segment for f in local if f.is_last)
    lo = {"final_segments": ends} if want_final and ends and getattr(backend, "final_state_lo", False) else {}

    # the initial state's factor of each local fragment's first token, formed once (known_state runs for
    # a fragment several times; only the factors of fragments that start their document are used)
    decays = {} if initial_state is None else {f.segment: entering_decay(g, plan, f, backend) for f in local}

    def known_state(f):  # the entering state of a fragment that starts its document here
        return (torch.zeros(H, K, V, dtype=sd, device=q.device) if initial_state is None
                else initial_state[f.doc].to(sd) * decays[f.segment])

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
        node = _ForwardExchange(entering_states, local, (H, K, V), sd, q.device)
        with _Phase("fwd local", q.device):
            o, finals, lctx = pipelined(q, k, v, g, beta, plan.local_cu_seqlens, scale, keep,
                                        torch.stack([known_state(f) for f in local]),
                                        list(deferred), node, list(senders), list(summarised), **replay, **lo)
        S_in, M_local = node.S_in, node.M_local
        if q.is_cuda:  # made on the backend's exchange stream, read on this one from here on
            main = torch.cuda.current_stream(q.device)
            for t in (*S_in.values(), *M_local.values()):
                t.record_stream(main)
    else:
        # 0. the local work that needs no entering state (a backend that can split it off), so
        #    that it runs while this rank waits for the others' summaries.
        prepared = _prepare(backend, local, q, k, v, g, beta, plan, scale, keep=keep, **replay, **lo)
        S_in, M_local = entering_states(prepared)

    # 2. entering states of the local fragments, then (not pipelined) the local forward.
    states = [S_in[f.index].to(q.device) if f.needs_state else known_state(f) for f in local]
    final = (torch.zeros(plan.num_docs, H, K, V, dtype=sd, device=q.device) if want_final
             else torch.zeros(0, dtype=sd, device=q.device))
    if local:
        states = torch.stack(states)
        if pipelined is None:
            with _Phase("fwd local", q.device):
                o, finals, lctx = _forward(backend, prepared, q, k, v, g, beta, plan, states, scale, keep=keep,
                                           **replay)
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
    ctx.qk_heads = q.shape[2]
    ctx.h0_dtype = None if initial_state is None else initial_state.dtype
    ctx.decays = {f.segment: decays[f.segment] for f in local if f.position == 0 and decays}
    if mode == "saved":
        ctx.lctx, ctx.M_local = lctx, M_local
        ctx.save_for_backward(states)
    else:  # and what the replay reads back, when the backend kept it
        kept = tuple(lctx[name] for name in kda.REPLAY_KEPT) if replay and lctx is not None else ()
        ctx.save_for_backward(q, k, v, g, beta, states, *kept)
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
        q, k, v, g, beta, states, *kept = ctx.saved_tensors
        kept = {"kept": dict(zip(kda.REPLAY_KEPT, kept))} if kept else {}
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
                                                              if not f.is_last and not f.needs_state], **kept)
                    first_pass, prepared = walk[1], lctx
                else:
                    prepared = _prepare(backend, local, q, k, v, g, beta, plan, scale, keep=True, **kept)
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
                 zip(((ctx.qk_heads, K), (ctx.qk_heads, K), (H, V), (H, K), (H,)), dtypes)]
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
