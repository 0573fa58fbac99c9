"""Launch plans of the pipelined orders: which chunk-stage launches run in which order, which segment
group's walks follow each of them, on how many SMs those walks are planned. A plan is data, built by
one planner from the pack's chain lengths, the head count and the SM count (and, for context
parallelism, the segments that are sent or wait for the exchange); the executors in kda.py run it.

    forward_plan(chain_lengths, heads, sms)           the pipelined forward (chunk_kda_fwd)
    replay_plan(chain_lengths, heads, sms)            the replay's walks beside its chunk stage
    print(plan) / plan.explain()                      the schedule, one launch a line

Decisions come from the fit rule (fit.plan_pipeline, fit.pieced_group, fit.pipelined_walk_sms); the
plan only puts them in one place and in launch order.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Optional, Tuple

from . import fit

# The walk programs each plan kind runs beside its chunk stage, and how many walks share the GPU.
_WALKS = {"forward": ("kda_fwd_walk",), "replay": ("kda_fwd_walk", "kda_bwd_walk")}


@dataclass(frozen=True)
class Pieces:
    """One group's single segment cut in pieces: chunk bounds [c_0, .., c_P] (global chunk indices) and
    the order their chunk stage is launched in."""
    group: int
    bounds: Tuple[int, ...]
    order: Tuple[int, ...]


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
            walks = ", ".join(f"{prog} on {self.sms_of(prog, g)} SMs" for prog, _ in self.walk_sms)
            lines.append(f"  {step:2d}. chunk stage of chunks [{c0}, {c1}) ({what}), then beside what follows: "
                         f"group {g}'s walks ({walks})")
        return "\n".join(lines)

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
                 cp: bool = False) -> PipelinePlan:
    """The pipelined forward: the chunk stage a group at a time, each group's forward walk beside the
    later groups' chunk stage; one group's segment in pieces (fit.pieced_group: one GPU, the last group;
    CP, the rank's longest chain not deferred, whose first pieces lead)."""
    lengths = tuple(int(n) for n in chain_lengths)
    first, deferred = tuple(sorted(first)), tuple(sorted(deferred))
    groups = tuple(fit.plan_pipeline(lengths, first))
    chosen = fit.pieced_group(lengths, first, deferred, cp)
    pieces = None if chosen is None else Pieces(chosen[0], tuple(chosen[1]), tuple(range(len(chosen[1]) - 1)))
    sms_of = tuple(fit.pipelined_walk_sms("kda_fwd_walk", lengths, heads, sms, i, 1, first,
                                          pieces is not None and i == pieces.group)
                   for i in range(len(groups)))
    return PipelinePlan("forward", lengths, int(heads), int(sms), groups, _launch_order(groups, pieces, first, cp),
                        pieces, (("kda_fwd_walk", sms_of),), first, deferred)


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
        pieces = Pieces(chosen[0], tuple(chosen[1]), order)
    walk_sms = tuple((prog, tuple(fit.pipelined_walk_sms(prog, lengths, heads, half, i, 2)
                                  for i in range(len(groups)))) for prog in _WALKS["replay"])
    return PipelinePlan("replay", lengths, int(heads), half, groups,
                        _launch_order(groups, pieces, (), pieces is not None), pieces, walk_sms)
