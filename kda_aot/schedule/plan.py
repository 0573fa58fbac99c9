"""Launch plans of the pipelined orders: which chunk-stage launches run in which order, which segment
group's walks follow each of them, on how many SMs those walks are planned. A plan is data, built by
one planner from the pack's chain lengths, the head count and the SM count (and, for context
parallelism, the segments that are sent or wait for the exchange); the executors in kda.py run it.

    forward_plan(chain_lengths, heads, sms)           the pipelined forward (chunk_kda_fwd); with cp=True
                                                      and the deferred segments, its exchange node (CP)
    replay_plan(chain_lengths, heads, sms)            the replay's walks beside its chunk stage
    print(plan) / plan.explain()                      the schedule, one launch a line

Decisions come from the fit rule (fit.plan_pipeline, fit.pieced_group, fit.pipelined_walk_sms); the
plan only puts them in one place and in launch order.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from . import fit

# The walk programs each plan kind runs beside its chunk stage, and how many walks share the GPU.
_WALKS = {"forward": ("kda_fwd_walk",), "replay": ("kda_fwd_walk", "kda_bwd_walk")}


@dataclass(frozen=True)
class Pieces:
    """One group's single segment cut in pieces: chunk bounds [c_0, .., c_P] (global chunk indices), the
    order their chunk stage is launched in, and (replay plans) for each of those launches the pieces the
    walks go through once it is queued (forward walk from the front, backward walk from the back, each piece
    after its neighbour: walks_ready). The forward's pieces are launched in order, each walked right after."""
    group: int
    bounds: Tuple[int, ...]
    order: Tuple[int, ...]
    walks: Tuple[Tuple[Tuple[int, ...], Tuple[int, ...]], ...] = ()  # replay, per launch: (forward, backward pieces)


def segment_runs(segments, n: int) -> list:
    """[(a, b), ...]: the maximal runs of consecutive segments of `segments` (a set of 0 .. n - 1)."""
    return [(a, b) for inside, a, b in fit.runs_of([s in segments for s in range(n)]) if inside]


def walks_ready(order, n: int) -> tuple:
    """For each piece launched in `order`, the pieces the forward walk (0, 1, ..) and the backward walk
    (n - 1, n - 2, ..) can go through once its chunk stage is queued: a walk takes the next piece in its
    direction as soon as that piece's chunk stage is."""
    queued, fwd, bwd, out = set(), 0, n - 1, []
    for p in order:
        queued.add(p)
        f, b = [], []
        while fwd < n and fwd in queued:
            f.append(fwd)
            fwd += 1
        while bwd >= 0 and bwd in queued:
            b.append(bwd)
            bwd -= 1
        out.append((tuple(f), tuple(b)))
    return tuple(out)


@dataclass(frozen=True)
class Exchange:
    """Context parallelism's step inside the pipelined forward, once every chunk-stage launch is queued: the
    collective (the summaries and the exchange: the executor's `entering`) gives the deferred segments their
    entering states, and their walks follow it. The groups are the plan's, by index."""
    after_walks: Tuple[int, ...]           # groups whose walks write the senders' final states, which it sends
    after_stage: Optional[int]             # beside: the group whose chunk stage (queued last of those that
    #                                        hold summarised segments) the summaries read, or None
    walks_after_stage: Optional[int]       # beside: the same for the deferred segments, which their walks read
    deferred_runs: Tuple[Tuple[int, int], ...]  # the deferred segments in runs of consecutive ones
    beside: bool                           # on a stream of its own, which waits for what came before the
    #                                        forward and for those launches only; else the current stream,
    #                                        after the whole chunk stage

    def explain(self) -> str:
        where = ("on its own stream, after what came before the forward" if self.beside else
                 "on the current stream, after the whole chunk stage")
        waits = [f"the walks of groups {list(self.after_walks)}"] if self.after_walks else []
        if self.after_stage is not None:
            waits.append(f"group {self.after_stage}'s chunk stage")
        then = ", ".join(f"segments [{a}, {b})" for a, b in self.deferred_runs) or "nothing"
        if self.walks_after_stage is not None and self.deferred_runs:
            then += f" (after group {self.walks_after_stage}'s chunk stage)"
        return (f"  then the exchange {where}" + (f", waiting for {' and '.join(waits)}" if waits else "")
                + f"; then the deferred walks: {then}")


@dataclass(frozen=True)
class PipelinePlan:
    kind: str                                  # "forward" | "replay"
    chain_lengths: Tuple[int, ...]             # chunks per segment
    heads: int
    sms: int                                   # the SMs the walks are planned on
    groups: Tuple[Tuple[int, int], ...]        # segment ranges (first, end), fit.plan_pipeline's order
    launches: Tuple[Tuple[int, Optional[int]], ...]  # (group, piece or None) in launch order
    pieces: Optional[Pieces]
    walk_sms: Tuple[Tuple[str, Tuple[int, ...]], ...]  # (program, SMs of each group's walk)
    first: Tuple[int, ...] = ()                # segments that go first (CP: the senders)
    deferred: Tuple[int, ...] = ()             # segments whose walk waits for the exchange (CP)
    exchange: Optional[Exchange] = None        # CP: the exchange and the deferred walks, after the launches

    def sms_of(self, program: str, group: int) -> int:
        return dict(self.walk_sms)[program][group]

    @functools.cached_property
    def first_chunks(self) -> Tuple[int, ...]:
        """Each segment's first chunk, and the chunk count last."""
        return (0, *itertools.accumulate(self.chain_lengths))

    def chunk_range(self, group: int, piece: Optional[int] = None) -> Tuple[int, int]:
        """The chunk range [c0, c1) a launch's chunk stage covers."""
        if piece is not None:
            return self.pieces.bounds[piece], self.pieces.bounds[piece + 1]
        a, b = self.groups[group]
        return self.first_chunks[a], self.first_chunks[b]

    def explain(self) -> str:
        head = (f"{self.kind} plan: {len(self.chain_lengths)} segments of {list(self.chain_lengths)} chunks, "
                f"H = {self.heads}, walks planned on {self.sms} SMs")
        if self.first or self.deferred:
            head += f"; first {list(self.first)}, deferred {list(self.deferred)}"
        lines = [head]
        for step, (g, p) in enumerate(self.launches):
            c0, c1 = self.chunk_range(g, p)
            a, b = self.groups[g]
            what = f"piece {p} of segment {a}" if p is not None else f"segments [{a}, {b})"
            if all(s in self.deferred for s in range(a, b)):
                lines.append(f"  {step:2d}. chunk stage of chunks [{c0}, {c1}) ({what}): walked after the exchange")
                continue
            walks = ", ".join(f"{prog} on {self.sms_of(prog, g)} SMs" for prog, _ in self.walk_sms)
            if p is not None and self.kind == "replay":
                fwd, bwd = self.pieces.walks[self.pieces.order.index(p)]
                walks += f"; through pieces: forward {list(fwd)}, backward {list(bwd)}"
            lines.append(f"  {step:2d}. chunk stage of chunks [{c0}, {c1}) ({what}), then beside what follows: "
                         f"group {g}'s walks ({walks})")
        if self.exchange is not None:
            lines.append(self.exchange.explain())
        return "\n".join(lines)

    def groups_of(self, segments) -> Tuple[int, ...]:
        """The groups that hold any of `segments`."""
        return tuple(i for i, (a, b) in enumerate(self.groups) if any(a <= s < b for s in segments))

    def last_queued(self, groups) -> Optional[int]:
        """Of `groups`, the one whose (whole-group) chunk stage is launched last, or None."""
        order = [g for g, p in self.launches if p is None]
        return max(groups, key=order.index) if groups else None

    __str__ = explain


def _launch_order(groups, pieces: Optional[Pieces], first: tuple, lead: bool) -> tuple:
    """(group, piece or None) in launch order. The pieced group's pieces go where the group would, or
    (lead, context parallelism) its first fit.lead_pieces pieces ahead of every other group and the
    rest right after the groups of the `first` segments."""
    launches = [(i, None) for i in range(len(groups))]
    if pieces is None:
        return tuple(launches)
    k = pieces.group
    cut = [(k, p) for p in pieces.order]
    rest = [x for x in launches if x != (k, None)]
    if lead:
        h = fit.lead_pieces(len(cut))
        senders = sum(1 for i, _ in rest if groups[i][0] in first)  # their groups lead `rest`
        return tuple(cut[:h] + rest[:senders] + cut[h:] + rest[senders:])
    return tuple(rest[:k] + cut + rest[k:])


def forward_plan(chain_lengths, heads: int, sms: int, *, first: tuple = (), deferred: tuple = (),
                 cp: bool = False, summarised: Optional[tuple] = None, exchange_beside: bool = False) -> PipelinePlan:
    """The pipelined forward: the chunk stage a group at a time, each group's forward walk beside the
    later groups' chunk stage; one group's segment in pieces (fit.pieced_group: one GPU, the last group;
    CP, the rank's longest chain not deferred, whose first pieces lead). cp: the plan ends in the exchange
    node (Exchange) that walks the `deferred` segments; summarised (default: all deferred) the deferred
    segments whose chunk stage the exchange's summaries read, exchange_beside its stream."""
    lengths = tuple(int(n) for n in chain_lengths)
    first, deferred = tuple(sorted(first)), tuple(sorted(deferred))
    groups = tuple(fit.plan_pipeline(lengths, first))
    chosen = fit.pieced_group(lengths, first, deferred, cp)
    pieces = None if chosen is None else Pieces(chosen[0], tuple(chosen[1]), tuple(range(len(chosen[1]) - 1)))
    sms_of = tuple(fit.pipelined_walk_sms("kda_fwd_walk", lengths, heads, sms, i, 1, first,
                                          pieces is not None and i == pieces.group)
                   for i in range(len(groups)))
    plan = PipelinePlan("forward", lengths, int(heads), int(sms), groups, _launch_order(groups, pieces, first, cp),
                        pieces, (("kda_fwd_walk", sms_of),), first, deferred)
    if not cp:
        return plan
    summarised = deferred if summarised is None else tuple(sorted(summarised))
    if not set(summarised) <= set(deferred):
        raise ValueError(f"summarised segments {list(summarised)} must be deferred ones ({list(deferred)})")
    runs = tuple(segment_runs(set(deferred), len(lengths)))
    beside = bool(exchange_beside)
    exchange = Exchange(plan.groups_of(first), plan.last_queued(plan.groups_of(summarised)) if beside else None,
                        plan.last_queued(plan.groups_of(deferred)) if beside else None, runs, beside)
    return replace(plan, exchange=exchange)


def replay_plan(chain_lengths, heads: int, sms: int, *, pieced: bool = False) -> PipelinePlan:
    """The replay's walks in the pipelined order: each group's forward and backward walks (two side
    streams, each planned on half the SMs) beside the later groups' chunk stage. pieced (the CP replay):
    the longest chain's chunk stage a piece at a time, first and last piece first, then the second and
    the last but one, ...: the forward walk goes through the pieces from the front, the backward walk
    from the back, so both start after one piece's chunk stage."""
    lengths = tuple(int(n) for n in chain_lengths)
    groups = tuple(fit.plan_pipeline(lengths))
    half = max(1, int(sms) // 2)
    chosen = fit.pieced_group(lengths, cp=True) if pieced else None
    pieces = None
    if chosen is not None:
        n = len(chosen[1]) - 1
        order = tuple(p for j in range((n + 1) // 2) for p in dict.fromkeys((j, n - 1 - j)))  # 0, n-1, 1, ...
        pieces = Pieces(chosen[0], tuple(chosen[1]), order, walks_ready(order, n))
    walk_sms = tuple((prog, tuple(fit.pipelined_walk_sms(prog, lengths, heads, half, i, 2)
                                  for i in range(len(groups)))) for prog in _WALKS["replay"])
    return PipelinePlan("replay", lengths, int(heads), half, groups,
                        _launch_order(groups, pieces, (), pieces is not None), pieces, walk_sms)
