"""Launch plans of the pipelined orders: which chunk-stage launches run in which order, which segment
group's walks follow each of them, on how many SMs those walks are planned, on which streams, waiting for
what. A plan is data, built by one planner from the pack's chain lengths, the head count and the SM count
(and, for context parallelism, the segments that are sent or wait for the exchange), cached per key;
its `nodes` are what the executor (execute.py) runs, one kind of node to one launcher.

    forward_plan(chain_lengths, heads, sms)           the pipelined forward (chunk_kda_fwd); with cp=True
                                                      and the deferred segments, its exchange node (CP)
    replay_plan(chain_lengths, heads, sms)            the replay's walks beside its chunk stage; with
                                                      bwd_chunk=True, kda_bwd_chunk after each group's walks
    print(plan) / plan.explain()                      the schedule, one node a line

Decisions come from the grouping (grouping.plan_pipeline, grouping.pieced_group) and the fit rule
(fit.pipelined_walk_sms); the plan only puts them in one place and in launch order.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from . import fit, grouping
from .. import options

# The walk programs a replay plan runs beside its chunk stage, at the same time (a forward plan: kda_fwd_walk alone).
_REPLAY_WALKS = ("kda_fwd_walk", "kda_bwd_walk")


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
    return [(a, b) for inside, a, b in grouping.runs_of([s in segments for s in range(n)]) if inside]


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
    collective (the summaries and the exchange: the node RunExchange) gives the deferred segments their
    entering states, and their walks follow it. The groups are the plan's, by index."""
    after_walks: Tuple[int, ...]           # groups whose walks write the senders' final states, which it sends
    after_stage: Optional[int]             # beside: the group whose chunk stage (queued last of those that
    #                                        hold summarised segments) the summaries read, or None
    walks_after_stage: Optional[int]       # beside: the same for the deferred segments, which their walks read
    deferred_runs: Tuple[Tuple[int, int], ...]  # the deferred segments in runs of consecutive ones
    beside: bool                           # on a stream of its own, which waits for what came before the
    #                                        forward and for those launches only; else the current stream,
    #                                        after the whole chunk stage
    summarised: Tuple[int, ...] = ()       # the deferred segments whose chunk stage the summaries read


# The nodes of a plan, in the order the executor runs them (execute.run: one launcher per kind of node).

@dataclass(frozen=True)
class Stream:
    """Where a node runs: the current stream (main), side stream `lane` of group `group` (one pool of side
    streams per walk program that runs at the same time: PipelinePlan.pools), or the exchange's own."""
    kind: str  # "main" | "side" | "exchange"
    group: int = 0
    lane: int = 0

    def __str__(self) -> str:
        return f"side {self.group}.{self.lane}" if self.kind == "side" else self.kind


MAIN, EXCHANGE = Stream("main"), Stream("exchange")


@dataclass(frozen=True)
class Rows:
    """Rows [first, end) of one of a run's state buffers: initial_state, final_state, dfinal_state,
    dinitial_state (a row per segment), handoff, fwd_handoff, bwd_handoff (a row per boundary between
    pieces), entering (the exchange's states, in the deferred segments' order); a buffer the run holds as None
    (no initial state) gives None."""
    buffer: str
    first: int
    end: int

    def __str__(self) -> str:
        return f"{self.buffer}[{self.first}:{self.end}]"


@dataclass(frozen=True)
class ChunkStage:
    """kda_fwd_chunk over chunks [first, end) on the current stream: group `group`'s, or its piece `piece`."""
    first: int
    end: int
    group: int
    piece: Optional[int]
    what: str

    def __str__(self) -> str:
        return f"main: chunk stage of chunks [{self.first}, {self.end}) ({self.what})"


@dataclass(frozen=True)
class BwdChunk:
    """kda_bwd_chunk over chunks [first, end) (group `group`'s) on the current stream, once the group's walks
    (its tape and dtape rows) are done."""
    first: int
    end: int
    group: int

    def __str__(self) -> str:
        return f"main: kda_bwd_chunk over chunks [{self.first}, {self.end}) (group {self.group})"


@dataclass(frozen=True)
class Wait:
    """`stream` waits for what is queued on `on` so far. join: run also when a node before it raised, since
    queued work may still read the caller's tensors."""
    stream: Stream
    on: Stream
    join: bool = False

    def __str__(self) -> str:
        return f"{self.stream} waits for {self.on}" + (" (join)" if self.join else "")


@dataclass(frozen=True)
class Record:
    """An event recorded on the current stream, named for what is queued there by then."""
    event: str

    def __str__(self) -> str:
        return f"main: record event '{self.event}'"


@dataclass(frozen=True)
class WaitEvent:
    """`stream` waits for a recorded event."""
    stream: Stream
    event: str

    def __str__(self) -> str:
        return f"{self.stream} waits for event '{self.event}'"


@dataclass(frozen=True)
class Walk:
    """A state walk on `stream`: `program` over segments [first, end), or over piece `piece` of segment `first`,
    from the state in `start` (kda_bwd_walk: the exit-state gradient; None: zero) into `into` (the exit state;
    kda_bwd_walk: the entering-state gradient; None: not written), its forms planned on `sms` SMs (None: the
    device's), a mixed plan's side streams from pool `pool`."""
    program: str
    stream: Stream
    first: int
    end: int
    piece: Optional[int]
    start: Optional[Rows]
    into: Optional[Rows]
    sms: Optional[int]
    pool: str

    def __str__(self) -> str:
        what = (f"piece {self.piece} of segment {self.first}" if self.piece is not None
                else f"segments [{self.first}, {self.end})")
        sms = "the device's SMs" if self.sms is None else f"{self.sms} SMs"
        return (f"{self.stream}: {self.program} over {what} on {sms}, from {self.start or 'zero'} "
                f"into {self.into or 'nothing'}")


@dataclass(frozen=True)
class RunExchange:
    """Context parallelism's collective on `stream`: the summaries of segments `summarised` (reading their chunk
    stage), the final states of segments `sends` (their walks'), the exchange; it gives the deferred segments
    `gives` their entering states (buffer `entering`, in that order). The run's exchange object performs it."""
    stream: Stream
    summarised: Tuple[int, ...]
    sends: Tuple[int, ...]
    gives: Tuple[int, ...]

    def __str__(self) -> str:
        return (f"{self.stream}: the exchange (summaries of segments {list(self.summarised)}, final states of "
                f"segments {list(self.sends)} sent), giving segments {list(self.gives)} their entering states")


@dataclass(frozen=True)
class PipelinePlan:
    kind: str                                  # "forward" | "replay"
    chain_lengths: Tuple[int, ...]             # chunks per segment
    heads: int
    sms: int                                   # the SMs the walks are planned on
    groups: Tuple[Tuple[int, int], ...]        # segment ranges (first, end), grouping.plan_pipeline's order
    launches: Tuple[Tuple[int, Optional[int]], ...]  # (group, piece or None) in launch order
    pieces: Optional[Pieces]
    walk_sms: Tuple[Tuple[str, Tuple[int, ...]], ...]  # (program, SMs of each group's walk)
    first: Tuple[int, ...] = ()                # segments that go first (CP: the senders)
    deferred: Tuple[int, ...] = ()             # segments whose walk waits for the exchange (CP)
    exchange: Optional[Exchange] = None        # CP: the exchange and the deferred walks, after the launches
    skip_bwd: Tuple[int, ...] = ()             # replay: segments whose backward walk is left out
    bwd_chunk: bool = False                    # replay: kda_bwd_chunk launched by the plan, a group at a time
    pools: Tuple[str, ...] = ()                # the side-stream pool of each lane (a walk program at a time)
    nodes: tuple = ()                          # what the executor runs, in order

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
        if self.skip_bwd:
            head += f"; no backward walk of {list(self.skip_bwd)}"
        if self.bwd_chunk:
            head += "; kda_bwd_chunk of each group after its walks"
        return "\n".join([head] + [f"  {step:2d}. {node}" for step, node in enumerate(self.nodes)])

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
    (lead, context parallelism) its first grouping.lead_pieces pieces ahead of every other group and the
    rest right after the groups of the `first` segments."""
    launches = [(i, None) for i in range(len(groups))]
    if pieces is None:
        return tuple(launches)
    k = pieces.group
    cut = [(k, p) for p in pieces.order]
    rest = [x for x in launches if x != (k, None)]
    if lead:
        h = grouping.lead_pieces(len(cut))
        senders = sum(1 for i, _ in rest if groups[i][0] in first)  # their groups lead `rest`
        return tuple(cut[:h] + rest[:senders] + cut[h:] + rest[senders:])
    return tuple(rest[:k] + cut + rest[k:])


def _chunk_stage(plan: PipelinePlan, group: int, piece: Optional[int], lanes: int) -> list:
    """A launch's chunk stage, then the group's side streams (one per lane) wait for it."""
    c0, c1 = plan.chunk_range(group, piece)
    a, b = plan.groups[group]
    what = f"piece {piece} of segment {a}" if piece is not None else f"segments [{a}, {b})"
    if piece is None and all(s in plan.deferred for s in range(a, b)):
        what += ", walked after the exchange"
    return [ChunkStage(c0, c1, group, piece, what)] + [Wait(Stream("side", group, lane), MAIN)
                                                       for lane in range(lanes)]


def _joins(plan: PipelinePlan) -> tuple:
    """The current stream waits for every side stream, lane by lane."""
    return tuple(Wait(MAIN, Stream("side", g, lane), join=True)
                 for lane in range(len(plan.pools)) for g in range(len(plan.groups)))


def _forward_nodes(plan: PipelinePlan) -> tuple:
    """Each launch's chunk stage, then its group's walks (the segments not deferred, in runs; a piece from the
    piece before's end state) on the group's side stream; then the exchange node's; then the joins."""
    ex = plan.exchange
    beside = ex is not None and ex.beside
    events = {g for g in (ex.after_stage, ex.walks_after_stage) if g is not None} if beside else set()
    n = 0 if plan.pieces is None else len(plan.pieces.bounds) - 1
    nodes = [Record("before")] if beside else []
    for i, p in plan.launches:
        nodes += _chunk_stage(plan, i, p, 1)
        if p is None and i in events:
            nodes.append(Record(f"stage {i}"))
        walk = dict(stream=Stream("side", i, 0), sms=plan.sms_of("kda_fwd_walk", i), pool=f"kda_fwd_walk/pipeline{i}")
        a, b = plan.groups[i]
        if p is not None:  # the group is one segment
            start = Rows("initial_state", a, a + 1) if p == 0 else Rows("handoff", p - 1, p)
            into = Rows("handoff", p, p + 1) if p < n - 1 else Rows("final_state", a, a + 1)
            nodes.append(Walk("kda_fwd_walk", first=a, end=a + 1, piece=p, start=start, into=into, **walk))
            continue
        runs = (segment_runs({s for s in range(a, b) if s not in plan.deferred}, len(plan.chain_lengths))
                if plan.deferred else [(a, b)])
        nodes += [Walk("kda_fwd_walk", first=ra, end=rb, piece=None, start=Rows("initial_state", ra, rb),
                       into=Rows("final_state", ra, rb), **walk) for ra, rb in runs]
    if ex is not None:
        on = EXCHANGE if beside else MAIN
        nodes += [Wait(on, Stream("side", g, 0)) for g in ex.after_walks]  # the senders' final states
        if beside:
            nodes.append(WaitEvent(on, "before"))  # an earlier collective: one order on every rank
            if ex.after_stage is not None:
                nodes.append(WaitEvent(on, f"stage {ex.after_stage}"))  # what the summaries read
        nodes.append(RunExchange(on, ex.summarised, plan.first, plan.deferred))
        if ex.walks_after_stage not in (None, ex.after_stage):
            nodes.append(WaitEvent(on, f"stage {ex.walks_after_stage}"))  # what the deferred walks read
        start = 0
        for ra, rb in ex.deferred_runs:
            nodes.append(Walk("kda_fwd_walk", on, ra, rb, None, Rows("entering", start, start + rb - ra),
                              Rows("final_state", ra, rb), None, "kda_fwd_walk/deferred"))
            start += rb - ra
        if beside:
            nodes.append(Wait(MAIN, on, join=True))
    return tuple(nodes) + _joins(plan)


def _bwd_chunk_joins(plan: PipelinePlan) -> tuple:
    """The joins, a group at a time in launch order (the order its walks start, and about the order they end),
    each followed by kda_bwd_chunk over the group's chunks: after the last chunk stage, so it competes with no
    chunk stage the walks wait for, and beside the later groups' walks, on the SMs they leave idle (the last
    group's walks run alone otherwise, on half the GPU: docs/backward.md)."""
    nodes = []
    for g in dict.fromkeys(i for i, _ in plan.launches):
        nodes += [Wait(MAIN, Stream("side", g, lane), join=True) for lane in range(len(plan.pools))]
        nodes.append(BwdChunk(*plan.chunk_range(g), g))
    return tuple(nodes)


def _replay_nodes(plan: PipelinePlan) -> tuple:
    """Each launch's chunk stage, then its group's forward walk (lane 0) and backward walk (lane 1; not of
    plan.skip_bwd); a piece's launch walks the pieces plan.pieces.walks says are ready, each from its
    neighbour's end state; then the joins (plan.bwd_chunk: each group's followed by its kda_bwd_chunk)."""
    n = 0 if plan.pieces is None else len(plan.pieces.bounds) - 1
    nodes = []
    for i, p in plan.launches:
        nodes += _chunk_stage(plan, i, p, 2)
        fwd = dict(stream=Stream("side", i, 0), sms=plan.sms_of("kda_fwd_walk", i), pool=f"kda_fwd_walk/replay{i}")
        bwd = dict(stream=Stream("side", i, 1), sms=plan.sms_of("kda_bwd_walk", i), pool=f"kda_bwd_walk/replay{i}")
        a, b = plan.groups[i]
        if p is not None:  # the group is one segment
            forward_pieces, backward_pieces = plan.pieces.walks[plan.pieces.order.index(p)]
            for r in forward_pieces:
                start = Rows("initial_state", a, a + 1) if r == 0 else Rows("fwd_handoff", r - 1, r)
                into = Rows("fwd_handoff", r, r + 1) if r < n - 1 else None
                nodes.append(Walk("kda_fwd_walk", first=a, end=a + 1, piece=r, start=start, into=into, **fwd))
            for r in () if a in plan.skip_bwd else backward_pieces:
                start = Rows("dfinal_state", a, a + 1) if r == n - 1 else Rows("bwd_handoff", r, r + 1)
                into = Rows("dinitial_state", a, a + 1) if r == 0 else Rows("bwd_handoff", r - 1, r)
                nodes.append(Walk("kda_bwd_walk", first=a, end=a + 1, piece=r, start=start, into=into, **bwd))
            continue
        nodes.append(Walk("kda_fwd_walk", first=a, end=b, piece=None, start=Rows("initial_state", a, b), into=None,
                          **fwd))
        runs = (segment_runs({s for s in range(a, b) if s not in plan.skip_bwd}, len(plan.chain_lengths))
                if plan.skip_bwd else [(a, b)])
        nodes += [Walk("kda_bwd_walk", first=ra, end=rb, piece=None, start=Rows("dfinal_state", ra, rb),
                       into=Rows("dinitial_state", ra, rb), **bwd) for ra, rb in runs]
    return tuple(nodes) + (_bwd_chunk_joins(plan) if plan.bwd_chunk else _joins(plan))


def _segments(segments) -> tuple:
    return tuple(sorted(int(s) for s in segments))


def _planner_reads(cp: bool) -> tuple:
    """What the planner reads besides its arguments, part of the cache key: the GPU's fit table and, for
    context parallelism, Options.cp_piece_senders (grouping.pieced_group)."""
    return str(fit.params_file()), bool(options.current().cp_piece_senders) if cp else None


def forward_plan(chain_lengths, heads: int, sms: int, *, first=(), deferred=(), cp: bool = False,
                 summarised=None, exchange_beside: bool = False) -> PipelinePlan:
    """The pipelined forward: the chunk stage a group at a time, each group's forward walk beside the
    later groups' chunk stage; one group's segment in pieces (grouping.pieced_group: one GPU, the last group;
    CP, the rank's longest chain not deferred, whose first pieces lead). cp: the plan ends in the exchange
    node (Exchange, RunExchange) that walks the `deferred` segments; summarised (default: all deferred) the
    deferred segments whose chunk stage the exchange's summaries read, exchange_beside its stream. Cached:
    the same key gives the same (immutable) plan."""
    return _forward_plan(tuple(int(n) for n in chain_lengths), int(heads), int(sms), _segments(first),
                         _segments(deferred), bool(cp), None if summarised is None else _segments(summarised),
                         bool(exchange_beside), _planner_reads(cp))


@functools.lru_cache(maxsize=1024)
def _forward_plan(lengths: tuple, heads: int, sms: int, first: tuple, deferred: tuple, cp: bool,
                  summarised: Optional[tuple], beside: bool, reads: tuple) -> PipelinePlan:
    groups = tuple(grouping.plan_pipeline(lengths, first))
    chosen = grouping.pieced_group(lengths, first, deferred, cp)
    pieces = None if chosen is None else Pieces(chosen[0], tuple(chosen[1]), tuple(range(len(chosen[1]) - 1)))
    pieced = -1 if pieces is None else pieces.group
    sms_of = tuple(fit.pipelined_walk_sms("kda_fwd_walk", lengths, heads, sms, i, 1, first, pieced)
                   for i in range(len(groups)))
    plan = PipelinePlan("forward", lengths, heads, sms, groups, _launch_order(groups, pieces, first, cp),
                        pieces, (("kda_fwd_walk", sms_of),), first, deferred, pools=("pipeline",))
    if cp:
        summarised = deferred if summarised is None else summarised
        if not set(summarised) <= set(deferred):
            raise ValueError(f"summarised segments {list(summarised)} must be deferred ones ({list(deferred)})")
        runs = tuple(segment_runs(set(deferred), len(lengths)))
        plan = replace(plan, exchange=Exchange(
            plan.groups_of(first), plan.last_queued(plan.groups_of(summarised)) if beside else None,
            plan.last_queued(plan.groups_of(deferred)) if beside else None, runs, beside, summarised))
    return replace(plan, nodes=_forward_nodes(plan))


def replay_plan(chain_lengths, heads: int, sms: int, *, pieced: bool = False, skip_bwd=(),
                bwd_chunk: bool = False) -> PipelinePlan:
    """The replay's walks in the pipelined order: each group's forward and backward walks (two side
    streams, each planned on half the SMs) beside the later groups' chunk stage. pieced (the CP replay):
    the longest chain's chunk stage a piece at a time, first and last piece first, then the second and
    the last but one, ...: the forward walk goes through the pieces from the front, the backward walk
    from the back, so both start after one piece's chunk stage. skip_bwd (CP): segments whose backward
    walk is left out. bwd_chunk (one GPU): the plan launches kda_bwd_chunk too, each group's chunks once its
    walks are done (_bwd_chunk_joins); not with pieces or skip_bwd (the CP replay: its backward walks are
    not final there). Cached: the same key gives the same (immutable) plan."""
    if bwd_chunk and (pieced or skip_bwd):
        raise ValueError("bwd_chunk: only a replay without pieces or skipped backward walks (one GPU)")
    return _replay_plan(tuple(int(n) for n in chain_lengths), int(heads), int(sms), bool(pieced),
                        _segments(skip_bwd), bool(bwd_chunk), _planner_reads(bool(pieced)))


def replay_walk_sms(sms: int) -> int:
    """The SMs each of the replay's two walks is planned on: half the GPU's, as they run side by side."""
    return max(1, sms // 2)


@functools.lru_cache(maxsize=1024)
def _replay_plan(lengths: tuple, heads: int, sms: int, pieced: bool, skip_bwd: tuple, bwd_chunk: bool,
                 reads: tuple) -> PipelinePlan:
    groups = tuple(grouping.plan_pipeline(lengths))
    half = replay_walk_sms(sms)
    chosen = grouping.pieced_group(lengths, cp=True) if pieced else None
    pieces = None
    if chosen is not None:
        n = len(chosen[1]) - 1
        order = tuple(p for j in range((n + 1) // 2) for p in dict.fromkeys((j, n - 1 - j)))  # 0, n-1, 1, ...
        pieces = Pieces(chosen[0], tuple(chosen[1]), order, walks_ready(order, n))
    pieced = -1 if pieces is None else pieces.group
    walk_sms = tuple((prog, tuple(fit.pipelined_walk_sms(prog, lengths, heads, half, i, 2, (), pieced, bwd_chunk)
                                  for i in range(len(groups)))) for prog in _REPLAY_WALKS)
    plan = PipelinePlan("replay", lengths, heads, half, groups, _launch_order(groups, pieces, (), pieces is not None),
                        pieces, walk_sms, skip_bwd=skip_bwd, bwd_chunk=bwd_chunk,
                        pools=("replay/pipeline-fwd", "replay/pipeline-bwd"))
    return replace(plan, nodes=_replay_nodes(plan))


def cache_clear():
    """Forget the cached plans and the fit rule's decisions they were built from (a test that changes what
    the planner reads)."""
    _forward_plan.cache_clear()
    _replay_plan.cache_clear()
    fit.cache_clear()
