"""The local primitives a context-parallel KDA backend provides (the seam for the CUDA kernels).

The CP forward and backward (collective.py, wrapped by ops.py) own the plan, the exchanges, the composition and
the autograd bookkeeping; a backend only computes on this rank's local tensors, segment by segment, with given
entering states:

    summary(k, v, g, beta, lo, hi)            -> (M [H, K, K], B [H, K, V]) in state_dtype,
                                                 of the local tokens [lo, hi) (one fragment)
    forward(q, k, v, g, beta, cu_local, states, scale, keep)
                                              -> (o [1, T_l, H, V] state_dtype,
                                                  finals [n, H, K, V] state_dtype, ctx)
        one segment per local fragment (cu_local, at least one: the op never calls a backend
        on a rank that holds no token), states [n, H, K, V] = entering states;
        ctx (None unless keep) is whatever `backward` needs: "saved" mode keeps it from the
        forward, "replay" mode calls forward(keep=True) again inside the backward.
    backward(ctx, do, dfinals)                -> (dq, dk, dv, dg, dbeta, dstates), state_dtype
        the local backward from (do, the gradient of each segment's exit state); may be called
        more than once on one ctx.
    gate_floor                                the floor under g of its programs, finite (the initial state's
                                              factor, kda_aot.schedule.kda.entering_decay; optional:
                                              without it, none)
    state_grads(ctx, do, dfinals)             -> dstates [n, H, K, V], state_dtype (optional)
        backward's dstates alone, bitwise the same; what the op needs before the exchange (with
        dS_out = 0). A backend without it gets backward(...)[5].
    prepare(q, k, v, g, beta, cu_local, scale, keep) -> prepared                     (optional)
        the part of forward that needs no entering state, run before the summaries and the
        exchange so that it overlaps the wait; then summary_of(prepared, segment, need_b) ->
        (M, B or None) replaces summary for local segments, and forward(..., prepared=prepared)
        runs only the rest. All bitwise the same as without it.
    summaries_of(prepared, requests, plan_segments) -> [(M, B or None)]               (optional)
        several segments' summaries at once (batched, each walked as pieces composed in fp32:
        another rounding order, within the fp32 summary bound); used instead of summary_of
        unless Options.cp_batched_summaries is off. Each segment's bits depend only on the segment and
        on plan_segments, which the op keeps the same in the forward and the backward.
    replay(prepared, states, do, dfinals) -> (ctx, dstates or None)                  (optional)
        the replay backward's forward(keep=True) on a prepared chunk stage and, when dfinals is
        given, state_grads(ctx, do, dfinals) — in any order or concurrently; bitwise the same as
        the two calls. Used only in "replay" mode and only when prepare returned a result.
    replay_keeps = True                                                               (optional)
        "replay" mode's forward keeps what the replay's chunk stage reads back instead of forming it
        again: forward, forward_pipelined and prepare take keep_replay=True and the forward's ctx is then
        that ({REPLAY_KEPT: tensor}: kda_aot.schedule.kda._chunk_stage_tensors); the replay hands it back as
        kept= to prepare and replay_pipelined. Bitwise the same as forming it again.
    final_state_lo = True                                                             (optional)
        prepare and forward_pipelined take final_segments: the local segments whose final state is an
        output (their document ends here) take their last chunk's U rounding error into it (the others'
        end states, a sender's included, keep the plain walk's bits); the op passes them when the final
        state is asked for.

CudaBackend: summary = the forward walk from zero (B) + the transfer (M) walk, forward(keep) =
the forward kernels keeping the tape, backward = the backward kernels, state_grads = the backward
offset walk (the state walk writing no tape; its d_initial_state is the one the full backward
returns), replay = the forward walk (no output) beside the backward offset walk (backward.replay_walks).
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

from .. import options, reference
from .._runtime.packing import HEAD_DIM
from .._runtime.tensor import host_table_to
from ..schedule import backward as kda_backward, fit, grouping, kda as kda_schedule
from .summaries import compose_pieces

__all__ = ["ReferenceBackend", "CudaBackend", "get_backend"]


class ReferenceBackend:
    """kda_aot.reference in `dtype` (fp32 by default, like the kernels; fp64 for tight tests). The
    backward is the reference's written-out chunked backward (no autograd: it runs inside the CP
    custom ops, below autograd). gate_floor: g is summed floored there (default the reference's own,
    exact; kda_aot.schedule.kda.GATE_FLOOR: the kernels' floor, so that CPU tests check the CP op's
    handling of it), its gradient zero below."""
    name = "reference"

    def __init__(self, dtype: torch.dtype = torch.float32, chunk_size: int = 64, gate_floor: float = reference.G_FLOOR):
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"ReferenceBackend: dtype must be float32 or float64, got {dtype}")
        if not reference.G_FLOOR <= gate_floor < 0:
            raise ValueError(f"ReferenceBackend: gate_floor must lie in [{reference.G_FLOOR}, 0), got {gate_floor}")
        self.dtype = dtype
        self.chunk_size = chunk_size
        self.gate_floor = float(gate_floor)

    def _floored(self, g):
        return g if self.gate_floor == reference.G_FLOOR else torch.clamp(g, min=self.gate_floor)

    @property
    def state_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def spec(self) -> str:
        """What get_backend rebuilds this backend from (the CP custom ops take it as a string)."""
        floor = "" if self.gate_floor == reference.G_FLOOR else f":{self.gate_floor!r}"
        return f"reference:{str(self.dtype).replace('torch.', '')}:{self.chunk_size}{floor}"

    def __repr__(self):
        return f"ReferenceBackend(dtype={self.dtype}, chunk_size={self.chunk_size}, gate_floor={self.gate_floor})"

    def summary(self, k, v, g, beta, lo: int, hi: int):
        return reference.fragment_summary(k[0, lo:hi], v[0, lo:hi], self._floored(g[0, lo:hi]), beta[0, lo:hi],
                                          chunk_size=self.chunk_size, dtype=self.dtype)

    def forward(self, q, k, v, g, beta, cu_local: Sequence[int], states: torch.Tensor,
                scale: float, keep: bool):
        saved = reference.kda_chunked_fwd_saved(q, k, v, self._floored(g), beta, cu_seqlens=list(cu_local),
                                                scale=scale, initial_state=states, chunk_size=self.chunk_size,
                                                dtype=self.dtype)
        ctx = (saved, (q, k, v, g, beta)) if keep else None
        return saved["o"], saved["final_state"], ctx

    def backward(self, ctx, do: torch.Tensor, dfinals: torch.Tensor):
        saved, (q, k, v, g, beta) = ctx
        grads = reference.kda_chunked_bwd(saved, do, dfinals, q=q, k=k, v=v, g=self._floored(g), beta=beta)
        if self.gate_floor == reference.G_FLOOR:
            return grads
        dq, dk, dv, dg, *rest = grads
        return (dq, dk, dv, torch.where(g < self.gate_floor, torch.zeros_like(dg), dg), *rest)

    def state_grads(self, ctx, do: torch.Tensor, dfinals: torch.Tensor):
        return self.backward(ctx, do, dfinals)[5]


class CudaBackend:
    """The KDA kernels (kda_aot.schedule.kda) behind the same seam: summary = the forward walk from a zero
    state (B = its final state) + the transfer walk (M); forward(keep) = the forward kernels keeping
    the tape; backward = the backward kernels on that saved context (reusable: it is read only).
    States fp32; q, k, v, dO bf16."""
    name = "cuda"
    spec = "cuda"
    state_dtype = torch.float32
    gate_floor = kda_schedule.GATE_FLOOR

    def __repr__(self):
        return "CudaBackend()"

    def summary(self, k, v, g, beta, lo: int, hi: int):
        frag = [x[:, lo:hi] for x in (k, v, g, beta)]
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)  # CPU boundaries: no host sync
        # the kernels take a q; the fragment's k stands in (no output is computed)
        return self.summary_of(kda_schedule.chunk_kda_prepare(frag[0], *frag, cu_seqlens=cu), 0, True)

    replay_keeps = True
    # prepare() and forward_pipelined() take final_segments: the local segments whose final state is an output
    # (their document ends here) carry their last chunk's U rounding error (kda_aot.schedule.kda)
    final_state_lo = True

    def prepare(self, q, k, v, g, beta, cu_local: Sequence[int], scale: float, keep: bool, keep_replay=False,
                kept=None, final_segments=()):
        cu = torch.tensor(list(cu_local), dtype=torch.int32)
        return kda_schedule.chunk_kda_prepare(q, k, v, g, beta, cu_seqlens=cu, scale=scale, save_tape=keep,
                                              keep=keep_replay, kept=kept, final_state=bool(final_segments),
                                              final_segments=tuple(final_segments))

    def summary_of(self, prepared, segment: int, need_b: bool):
        """(M, B) of one local segment from the prepared chunk stage: the same chunk-stage values
        as a fragment prepared alone (chunks restart at segment starts), so the same bits."""
        view = kda_schedule.segment_view(prepared, segment)
        B = None
        if need_b:
            _, B, _ = kda_schedule.chunk_kda_walk(view, output_final_state=True, want_output=False)
            B = B[0]
        return kda_schedule.chunk_kda_transfer(view)[0], B

    def summaries_of(self, prepared, requests, plan_segments):
        """[(M, B or None)] of the local segments in `requests` ((segment, need_b) pairs) in two
        launches over all of them at once: each segment cut into chunk-aligned pieces (the numbers
        fit.summary_pieces picks for the segments `plan_segments`, which include the requested ones:
        the forward's set, so that the backward's M have the forward's bits), every piece walked
        from zero (B: the forward offset walk, only when some request needs B) and by the transfer
        walk (M), side by side, then composed in fp32 (summaries.compose_pieces). The chunk tables
        are gathered to the pieces (the kernels index per-chunk tensors by the table's rows), the
        token tensors shared. Another rounding order than summary_of: within the fp32 summary bound."""
        lengths = prepared["chain_lengths"]
        H, device = prepared["v"].shape[2], prepared["v"].device  # H: the value heads
        planned = dict(zip(plan_segments, fit.summary_pieces(tuple(lengths[s] for s in plan_segments), H,
                                                             kda_schedule.device_sms(device))))
        first = [0, *itertools.accumulate(lengths)]
        rows, bounds, pieces, counts = [], [0], [], []
        for segment, _ in requests:  # a segment's pieces are consecutive: its chunk rows in order
            rows.append(torch.arange(first[segment], first[segment + 1]))
            counts.append(planned[segment])
            for n in grouping.piece_lengths(lengths[segment], planned[segment]):
                bounds.append(bounds[-1] + n)
                pieces.append(n)
        sel = host_table_to(torch.cat(rows), device)
        view = dict(prepared, chunks=prepared["chunks"].index_select(0, sel),
                    gamma=prepared["gamma"].index_select(0, sel),
                    seg_chunks=host_table_to(torch.tensor(bounds, dtype=torch.int32), device),
                    chain_lengths=tuple(pieces), u_lo_end=None, end_segment=None)  # (tables of the segments)
        B = None
        if any(need_b for _, need_b in requests):
            _, B, _ = kda_schedule.chunk_kda_walk(view, output_final_state=True, want_output=False)
        summaries = compose_pieces(kda_schedule.chunk_kda_transfer(view), B, counts)
        return [(M, Bf if need_b else None) for (M, Bf), (_, need_b) in zip(summaries, requests)]

    def forward(self, q, k, v, g, beta, cu_local: Sequence[int], states: torch.Tensor,
                scale: float, keep: bool, prepared=None, keep_replay=False):
        if prepared is None:
            prepared = self.prepare(q, k, v, g, beta, cu_local, scale, keep, keep_replay)
        o, finals, saved = kda_schedule.chunk_kda_walk(prepared, initial_state=states.to(torch.float32).contiguous(),
                                                       output_final_state=True, save_tape=keep)
        return o, finals, _forward_ctx(saved, keep, keep_replay)

    def replay(self, prepared, states: torch.Tensor, do: torch.Tensor, dfinals):
        """The replay backward's forward walk (tape and V' for the backward; no output) and, when
        `dfinals` is given, the state-gradient walk for D — which reads only the chunk stage — side
        by side (backward.replay_walks). Returns (saved context, D or None): the same bits as forward()
        then state_grads()."""
        saved, bwd = kda_backward.replay_walks(prepared, states.to(torch.float32).contiguous(),
                                               None if dfinals is None else do.to(torch.bfloat16).contiguous(),
                                               None if dfinals is None else dfinals.to(torch.float32).contiguous(),
                                               need_dtape=False)  # the offset walk: D alone
        return saved, (None if bwd is None else bwd[1])

    def forward_pipelined(self, q, k, v, g, beta, cu_local: Sequence[int], scale: float, keep: bool,
                          known: torch.Tensor, deferred: Sequence[int], exchange, senders: Sequence[int] = (),
                          summarised: Optional[Sequence[int]] = None, keep_replay=False, final_segments=()):
        """forward() in the single-GPU pipelined order (kda.chunk_kda_fwd_deferred): the chunk stage a
        segment group at a time with the walks of the segments whose entering state is known (`known`,
        one row per local segment; the `deferred` rows are not read) beside it, the `senders` first;
        exchange.run(prepared, final_state) then runs the summaries and the exchange (the senders' exit
        states are their final_state rows) and returns the deferred segments' entering states, whose
        walks run beside the others; it runs on a stream of its own (Options.cp_exchange_beside): what it
        makes that the caller keeps must be record_stream'd onto the current stream, and what it reads of
        `prepared` must be the `summarised` segments' (default: every deferred one). Each segment's walk
        is the one forward() runs: the same bits."""
        cu = torch.tensor(list(cu_local), dtype=torch.int32)
        o, finals, saved = kda_schedule.chunk_kda_fwd_deferred(
            q, k, v, g, beta, cu_seqlens=cu, scale=scale, initial_state=known.to(torch.float32).contiguous(),
            deferred=deferred, exchange=exchange,
            save_tape=keep, senders=senders, exchange_beside=options.current().cp_exchange_beside,
            summarised=summarised, keep=keep_replay, final_segments=final_segments)
        return o, finals, _forward_ctx(saved, keep, keep_replay)

    def replay_pipelined(self, q, k, v, g, beta, cu_local: Sequence[int], scale: float, states: torch.Tensor,
                         do: torch.Tensor, dfinals: torch.Tensor, skip_bwd: Sequence[int] = (), kept=None):
        """prepare() then replay() in the single-GPU replay's pipelined order (backward.replay_walks_pipelined):
        the chunk stage a segment group at a time, each group's forward walk and backward walk beside
        the later groups' chunk stage. The backward walk runs in full (its tape too) from `dfinals`:
        returns (saved context, [dtape, D]); D has replay()'s bits, and the segments whose exit-state
        gradient was complete in `dfinals` need no second walk (backward(walk=, rewalk=) walks the
        others again). skip_bwd: segments whose backward walk is left out here (their D is not wanted
        and backward(rewalk=) walks them anyway): their rows of the walk are unwritten. The rank's longest
        chain is walked in pieces (backward.replay_walks_pipelined(pieced=True)): bitwise one walk.
        kept: what the forward kept (replay_keeps)."""
        cu = torch.tensor(list(cu_local), dtype=torch.int32)
        return kda_backward.replay_walks_pipelined(q, k, v, g, beta, states.to(torch.float32).contiguous(), cu,
                                                   scale, do.to(torch.bfloat16).contiguous(),
                                                   dfinals.to(torch.float32).contiguous(), tuple(skip_bwd),
                                                   pieced=True, kept=kept)

    def backward(self, ctx, do: torch.Tensor, dfinals: torch.Tensor, walk=None, rewalk: Sequence[int] = ()):
        """The local backward; walk: [dtape, d_initial_state] when the backward walk has run already;
        rewalk (with walk): segments whose walk ran from a stand-in exit-state gradient and runs again
        from dfinals' rows (beside kda_bwd_chunk over the other segments where that hides it)."""
        return kda_backward.chunk_kda_bwd(ctx, do.to(torch.bfloat16).contiguous(),
                                          dfinals.to(torch.float32).contiguous(), walk=walk, rewalk=rewalk)

    def state_grads(self, ctx, do: torch.Tensor, dfinals: torch.Tensor):
        return kda_backward.chunk_kda_bwd_walk(ctx, do.to(torch.bfloat16).contiguous(),
                                               dfinals.to(torch.float32).contiguous(),
                                               need_dtape=False)[1]  # the offset walk: no tape written


def _forward_ctx(saved: dict, keep: bool, keep_replay: bool):
    """The forward's ctx: the saved context (keep), what the replay reads back (keep_replay), or None."""
    if keep:
        return saved
    return {name: saved[name] for name in kda_schedule.REPLAY_KEPT} if keep_replay else None


def backend_name(backend) -> str:
    """The string a CP op takes for a backend object: its spec (ours), else the key it is registered under
    (kda_aot.cp.keys; once per object)."""
    if type(backend) in (ReferenceBackend, CudaBackend):
        return backend.spec
    from . import keys
    if "_kda_aot_key" not in backend.__dict__:
        backend.__dict__["_kda_aot_key"] = f"object:{keys.register(backend)}"
    return backend.__dict__["_kda_aot_key"]


def get_backend(backend, dtype: Optional[torch.dtype] = None, like=None):
    """'auto' | 'reference' | 'cuda' | a backend object -> a backend object; 'auto': kda_aot.registry.auto_backend
    of like (q: its head dim too)."""
    if backend == "auto":
        from .._runtime.registry import auto_backend
        heads = isinstance(like, torch.Tensor) and like.dim() == 4  # q, k [1, T, H, K]
        backend = auto_backend(like, like.shape[-1] if heads else HEAD_DIM)
    if isinstance(backend, str):
        if backend.startswith("object:"):  # backend_name's key of a backend object
            from . import keys
            return keys.lookup(int(backend.split(":")[1]))
        if backend.startswith("reference:"):  # a ReferenceBackend's spec
            _, name, chunk, *floor = backend.split(":")
            return ReferenceBackend(getattr(torch, name), int(chunk), *(float(f) for f in floor))
        if backend == "reference":
            return ReferenceBackend(dtype or torch.float32)
        if backend == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("kda_aot.cp: backend='cuda' needs a CUDA GPU")
            return CudaBackend()
        raise ValueError(f"unknown backend {backend!r}: valid backends are 'auto', 'reference', 'cuda' "
                         f"(or a backend object, see kda_aot.cp.backends)")
    for attr in ("summary", "forward", "backward", "state_dtype", "name"):
        if not hasattr(backend, attr):
            raise TypeError(f"backend object {backend!r} lacks {attr!r} (see kda_aot.cp.backends)")
    return backend
