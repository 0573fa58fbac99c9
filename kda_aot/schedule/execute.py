"""The executor of launch plans (plan.py): run(plan, call) walks the plan's nodes in order and hands each
kind of node to one launcher; `call` (a Call) holds the tensors of this run, which the nodes name
(Rows: a buffer and its rows). Everything that decides what runs where and after what is the plan's; the
one object a run supplies that acts is the CP exchange (Call.exchange, whose run(prepared, final_state)
performs the plan's RunExchange node: the collective has to be called)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from . import backward, kda
from .._runtime.tensor import host_table_to
from .plan import BwdChunk, ChunkStage, PipelinePlan, Record, Rows, RunExchange, Stream, Wait, WaitEvent, Walk


@dataclass
class Call:
    """The tensors one run of a plan reads and writes. buffers: the state buffers the nodes' Rows name
    (initial_state, final_state, handoff, ...; the exchange node adds `entering`); outputs: the forward walk's
    (o, tape, vnew; None where not asked for); dout, dtape: the backward walk's; piece_chunks: the pieces' chunk
    bounds on the device (int32); exchange: performs the RunExchange node (context parallelism); bwd_chunk:
    kda_bwd_chunk's tensors (backward.bwd_chunk_tensors), which the BwdChunk nodes launch over."""
    prepared: dict
    buffers: dict
    outputs: dict
    save_tape: bool = False
    want_output: bool = True
    walk_form: Optional[str] = None
    dout: Optional[torch.Tensor] = None
    dtape: Optional[torch.Tensor] = None
    piece_chunks: Optional[torch.Tensor] = None
    exchange: object = None
    bwd_chunk: Optional[dict] = None
    events: dict = field(default_factory=dict)

    def rows(self, ref: Optional[Rows]):
        """The rows a node names; None for no reference or a buffer given as None. A name the call does not
        hold raises: a piece walked from zeros, its state never written, would be wrong bits, not an error."""
        if ref is None:
            return None
        buffer = self.buffers[ref.buffer]
        return None if buffer is None else buffer[ref.first:ref.end]


def piece_buffers(plan: PipelinePlan, heads: int, device, names) -> tuple:
    """(piece_chunks, buffers) for a plan that walks a group in pieces: the pieces' chunk bounds on the device
    (int32) and, per name, a state handoff buffer with a row per boundary between pieces (fp32: a piece starts
    bitwise from the one before's end state); (None, {}) for a plan without pieces."""
    if plan.pieces is None:
        return None, {}
    bounds = plan.pieces.bounds
    chunks = host_table_to(torch.tensor(bounds, dtype=torch.int32), device)
    return chunks, {name: torch.empty(len(bounds) - 2, heads, kda.HEAD_DIM, kda.HEAD_DIM, device=device,
                                      dtype=torch.float32) for name in names}


class _Streams:
    """The plan's streams on the device: the current one, the side streams of each lane's pool (taken once
    per run), the exchange's own (taken when a node names it)."""

    def __init__(self, plan: PipelinePlan, device):
        self.device = device
        self.main = torch.cuda.current_stream(device)
        self.sides = [kda._side_streams(device, len(plan.groups), pool) for pool in plan.pools]
        self.exchange = None
        self.forked = set()  # the plan's streams that waited on another in this run (under capture: captured)

    def __call__(self, stream: Stream):
        if stream.kind == "main":
            return self.main
        if stream.kind == "side":
            return self.sides[stream.lane][stream.group]
        if self.exchange is None:
            self.exchange = kda._side_streams(self.device, 1, "kda_fwd_walk/exchange")[0]
        return self.exchange


def _chunk_stage(node: ChunkStage, plan, call: Call, streams):
    kda._launch_chunk_stage(call.prepared, call.buffers.get("initial_state"), node.first, node.end)


def _bwd_chunk(node: BwdChunk, plan, call: Call, streams):
    backward.launch_bwd_chunk(call.bwd_chunk, node.first, node.end)


def _wait(node: Wait, plan, call: Call, streams):
    streams(node.stream).wait_stream(streams(node.on))
    streams.forked.add(node.stream)


def _record(node: Record, plan, call: Call, streams):
    call.events[node.event] = streams.main.record_event()


def _wait_event(node: WaitEvent, plan, call: Call, streams):
    streams(node.stream).wait_event(call.events[node.event])
    streams.forked.add(node.stream)


def _view(node: Walk, plan: PipelinePlan, call: Call) -> dict:
    if node.piece is None:
        return kda.segments_view(call.prepared, node.first, node.end)
    return kda.piece_view(call.prepared, node.first, call.piece_chunks, plan.pieces.bounds, node.piece)


def _fwd_walk(node: Walk, plan, call: Call, streams):
    into = call.rows(node.into)
    out = {name: x for name, x in call.outputs.items() if x is not None and name != "final_state"}
    if into is not None:
        out["final_state"] = into
    with torch.cuda.stream(streams(node.stream)):
        kda.chunk_kda_walk(_view(node, plan, call), initial_state=call.rows(node.start),
                           output_final_state=into is not None, save_tape=call.save_tape, out=out,
                           walk_form=call.walk_form, want_output=call.want_output, sm_count=node.sms, pool=node.pool)


def _bwd_walk(node: Walk, plan, call: Call, streams):
    with torch.cuda.stream(streams(node.stream)):
        backward.chunk_kda_bwd_walk(_view(node, plan, call), call.dout, call.rows(node.start),
                                    out={"dtape": call.dtape, "dinitial_state": call.rows(node.into)},
                                    sm_count=node.sms, pool=node.pool)


_WALKS = {"kda_fwd_walk": _fwd_walk, "kda_bwd_walk": _bwd_walk}


def _walk(node: Walk, plan, call: Call, streams):
    _WALKS[node.program](node, plan, call, streams)


def _exchange(node: RunExchange, plan, call: Call, streams):
    """The collective on the node's stream (what it makes is made there); its states, fp32, become `entering`."""
    with torch.cuda.stream(streams(node.stream)):
        states = call.exchange.run(call.prepared, call.buffers["final_state"])
        call.buffers["entering"] = states.to(torch.float32).contiguous()


_LAUNCHERS = {ChunkStage: _chunk_stage, BwdChunk: _bwd_chunk, Wait: _wait, Record: _record, WaitEvent: _wait_event,
              Walk: _walk,
              RunExchange: _exchange}


def run(plan: PipelinePlan, call: Call):
    """Run the plan's nodes in order; when one raises, the joins after it still run for the streams this run
    forked (queued work may still read the caller's tensors; under CUDA-graph capture a join of a stream
    that never waited on the captured one would itself fail), each on its own, then the error goes on."""
    streams = _Streams(plan, call.prepared["q"].device)
    for step, node in enumerate(plan.nodes):
        try:
            _LAUNCHERS[type(node)](node, plan, call, streams)
        except BaseException:
            for later in plan.nodes[step + 1:]:
                if isinstance(later, Wait) and later.join and later.on in streams.forked:
                    try:
                        _wait(later, plan, call, streams)
                    except Exception:  # the first error is the one to report
                        pass
            raise
