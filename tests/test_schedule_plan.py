"""The launch planner (kda_aot.schedule.plan) on the CPU: every plan covers each chunk once, in the
launch order the pipelined executors run (tests/test_pipeline_emulated.py runs them)."""
import subprocess
import sys
from pathlib import Path

import pytest

from kda_aot.schedule import grouping
from kda_aot.schedule.plan import forward_plan, replay_plan

Q1 = (1585, 641, 1216, 465)          # chunks per document of bench pack Q1
CP2_Q1_RANK0 = (1584, 368)           # rank 0 of CP2 contiguous on Q1 (a sent chain: segment 1)


def covered(plan):
    """Each chunk's chunk stage is launched exactly once, and each group's walks after all of it."""
    chunks = []
    for g, p in plan.launches:
        c0, c1 = plan.chunk_range(g, p)
        chunks += range(c0, c1)
    assert sorted(chunks) == list(range(sum(plan.chain_lengths)))
    assert {g for g, _ in plan.launches} == set(range(len(plan.groups)))


@pytest.mark.parametrize("lengths", [Q1, (5,), (3, 3), (700, 1, 64, 300), tuple(range(1, 40))])
def test_forward_plans_cover_every_chunk_once(lengths):
    plan = forward_plan(lengths, 32, 132)
    covered(plan)
    segments = [s for a, b in plan.groups for s in range(a, b)]  # contiguous groups, every segment in one of them
    assert sorted(segments) == list(range(len(lengths))) and all(a < b for a, b in plan.groups)
    assert len(dict(plan.walk_sms)["kda_fwd_walk"]) == len(plan.groups)


def test_q1_forward_plan():
    """Q1: the longest documents first, the last group's document in pieces launched in order."""
    plan = forward_plan(Q1, 32, 132)
    assert plan.groups == ((0, 1), (2, 3), (1, 2), (3, 4))
    pieces = plan.pieces
    assert pieces.group == 3 and list(pieces.bounds) == grouping.last_group_pieces(Q1)
    assert plan.launches == ((0, None), (1, None), (2, None)) + tuple((3, p) for p in pieces.order)
    assert pieces.order == tuple(range(len(pieces.bounds) - 1))  # each piece walked right after its chunk stage
    text = plan.explain()
    assert text.startswith("forward plan: 4 segments") and text.count("chunk stage of chunks") == len(plan.launches)


def test_cp_forward_plan_leads_with_the_critical_pieces():
    """CP: the rank's longest chain in pieces, its first lead_pieces pieces ahead of the senders' group."""
    plan = forward_plan(CP2_Q1_RANK0, 32, 132, first=(1,), cp=True)
    covered(plan)
    pieces = plan.pieces
    assert pieces is not None and pieces.group != plan.groups.index((1, 2))
    h = grouping.lead_pieces(len(pieces.order))
    assert plan.launches[:h] == tuple((pieces.group, p) for p in range(h))
    assert plan.launches[h] == (plan.groups.index((1, 2)), None)    # the sender right after
    assert plan.first == (1,)


@pytest.mark.parametrize("beside", [False, True], ids=["current-stream", "beside"])
def test_cp_forward_plan_ends_in_its_exchange(beside):
    """CP: the plan's exchange node waits for the walks of the groups that hold the senders and, on a stream of
    its own, for the chunk stage queued last of the summarised segments' groups (and of the deferred ones'
    before their walks); the deferred segments are walked after it, in runs of consecutive segments."""
    lengths, first, deferred = (5, 40, 3, 12, 7), (1,), (0, 3, 4)
    plan = forward_plan(lengths, 32, 132, first=first, deferred=deferred, cp=True, summarised=(3,),
                        exchange_beside=beside)
    covered(plan)
    node = plan.exchange
    assert node.after_walks == plan.groups_of(first) and node.beside == beside
    assert node.deferred_runs == ((0, 1), (3, 5))
    order = [g for g, p in plan.launches if p is None]
    if beside:
        assert node.after_stage == plan.groups_of((3,))[0]
        assert node.walks_after_stage == max(plan.groups_of(deferred), key=order.index)
    else:
        assert node.after_stage is None and node.walks_after_stage is None
    text = plan.explain()
    on = "exchange" if beside else "main"
    assert f"{on}: the exchange (summaries of segments [3], final states of segments [1] sent)" in text
    assert f"{on}: kda_fwd_walk over segments [0, 1) on the device's SMs, from entering[0:1]" in text
    assert f"{on}: kda_fwd_walk over segments [3, 5) on the device's SMs, from entering[1:3]" in text
    assert text.count("walked after the exchange") == sum(
        all(s in deferred for s in range(a, b)) for a, b in plan.groups)
    assert forward_plan(lengths, 32, 132).exchange is None  # one GPU: no exchange
    with pytest.raises(ValueError, match=r"summarised segments \[1\] must be deferred ones"):
        forward_plan(lengths, 32, 132, first=first, deferred=deferred, cp=True, summarised=(1,))


def test_replay_plan_orders_pieces_from_both_ends():
    plan = replay_plan(CP2_Q1_RANK0, 32, 132, pieced=True)
    covered(plan)
    n = len(plan.pieces.bounds) - 1
    assert plan.pieces.order[:4] == (0, n - 1, 1, n - 2)
    assert sorted(plan.pieces.order) == list(range(n))
    assert plan.sms == 66 and {prog for prog, _ in plan.walk_sms} == {"kda_fwd_walk", "kda_bwd_walk"}
    # the walks: each piece once a direction, each after its neighbour's and after its own chunk stage
    fwd = [r for f, _ in plan.pieces.walks for r in f]
    bwd = [r for _, b in plan.pieces.walks for r in b]
    assert fwd == list(range(n)) and bwd == list(range(n - 1, -1, -1))
    for step, (f, b) in enumerate(plan.pieces.walks):
        assert set(f) | set(b) <= set(plan.pieces.order[:step + 1])
    assert plan.pieces.walks[:2] == (((0,), ()), ((), (n - 1,)))
    text = plan.explain()
    assert f"side {plan.pieces.group}.0: kda_fwd_walk over piece 0 of segment 0" in text
    assert f"side {plan.pieces.group}.1: kda_bwd_walk over piece {n - 1} of segment 0" in text
    assert replay_plan(Q1, 32, 132).pieces is None              # one GPU: no pieces in the replay
    # the pieced chain's walks run beside the later pieces' chunk stage: one SM per chain, full (split on 66 SMs
    # each would leave the chunk stage 4); the single-GPU replay's long walk, beside the short rest, takes its half
    assert plan.sms_of("kda_fwd_walk", plan.pieces.group) == plan.sms_of("kda_bwd_walk", plan.pieces.group) == 32
    assert replay_plan((3125, 779), 32, 132).sms_of("kda_fwd_walk", 0) == 66


def test_explain_command():
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", "kda_aot.schedule", "--explain", "Q1", "32"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    assert "forward plan: 4 segments of [1585, 641, 1216, 465] chunks" in out and "replay plan" in out
    assert "group 3 kda_fwd_walk:" in out and "group 3 kda_bwd_walk:" in out
    lens = subprocess.run([sys.executable, "-m", "kda_aot.schedule", "--explain", "100,1,5000", "4"], cwd=root,
                          capture_output=True, text=True, check=True).stdout
    assert lens.startswith("pack: 3 documents, 5101 tokens")
    cp = subprocess.run([sys.executable, "-m", "kda_aot.schedule", "--explain", "100,1,5000", "4", "--cp", "1", "0,2",
                         "--beside"], cwd=root, capture_output=True, text=True, check=True).stdout
    assert "first [1], deferred [0, 2]" in cp and "exchange waits for event 'before'" in cp
    assert "exchange: the exchange (summaries of segments [0, 2]" in cp and "main waits for exchange (join)" in cp
    assert "walked after the exchange" in cp and "kda_bwd_walk over piece 7 of segment 2" in cp


@pytest.mark.parametrize("args,message", [(["Q1", "100"], "HEADS: chunk_kda takes 1 .. 64 heads, got 100"),
                                          (["Q1", "0"], "HEADS: chunk_kda takes 1 .. 64 heads"),
                                          (["Q1", "32", "--beside"], "--beside: only with --cp"),
                                          (["Q1", "32", "--cp", "x", "-"], "--cp: expected comma-separated"),
                                          (["0,0", "2"], "PACK: no tokens")])
def test_explain_command_refuses_what_chunk_kda_would(args, message):
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "kda_aot.schedule", "--explain", *args], cwd=root,
                         capture_output=True, text=True)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_explain_command_names_bad_lengths():
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "kda_aot.schedule", "--explain", "100,-5", "4"], cwd=root,
                         capture_output=True, text=True)
    assert run.returncode == 1 and "'100,-5': document lengths must be >= 0" in run.stderr, run.stderr


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "doc_zigzag"])
@pytest.mark.parametrize("pack", ["Q1", "Q2", "Q3", "Q4", "Q5", "Q6"])
def test_cp_rank_plans_of_every_layout(pack, layout, world):
    """Each CP rank's plans as the CP forward and replay build them (kda_aot.cp.collective.pipelined_roles:
    the fragments that others wait for first, those that need an entering state deferred, the middle ones
    summarised):
    every chunk's chunk stage once, the exchange after the senders' walks, every deferred segment walked
    after it once, the replay's pieces each walked once a direction after its chunk stage."""
    import math
    from bench.packs import PACKS
    from kda_aot.cp.collective import pipelined_roles
    from kda_aot.cp.plan import make_plan
    cu = [0]
    for n in PACKS[pack]:
        cu.append(cu[-1] + n)
    for rank in range(world):
        local = make_plan(cu, layout, world_size=world, rank=rank).local_fragments
        if not local:
            continue
        assert [f.segment for f in local] == list(range(len(local)))
        chains = tuple(math.ceil(f.length / 64) for f in local)
        deferred, senders, middle = pipelined_roles(local)
        plan = forward_plan(chains, 32, 132, first=senders, deferred=deferred, cp=True, summarised=middle)
        covered(plan)
        _checked_order(plan)
        node = plan.exchange
        assert node.after_walks == plan.groups_of(senders)
        walked_after = [s for a, b in node.deferred_runs for s in range(a, b)]
        assert walked_after == sorted(deferred)
        if plan.pieces is not None:  # never a deferred segment: it waits for the exchange
            a, b = plan.groups[plan.pieces.group]
            assert not set(range(a, b)) & set(deferred)
        replay = replay_plan(chains, 32, 132, pieced=True)
        covered(replay)
        _checked_order(replay)
        if replay.pieces is not None:
            n = len(replay.pieces.bounds) - 1
            assert sorted(r for f, _ in replay.pieces.walks for r in f) == list(range(n))
            assert sorted(r for _, b in replay.pieces.walks for r in b) == list(range(n))
            for step, (f, b) in enumerate(replay.pieces.walks):
                assert set(f) | set(b) <= set(replay.pieces.order[:step + 1])


def test_plans_are_cached_per_key_and_immutable(kda_options):
    """The same key gives the same plan object (lengths as any sequence); other lengths, heads, SMs, roles or
    Options.cp_piece_senders (which grouping.pieced_group reads) give another; a plan and its nodes are frozen."""
    import dataclasses
    plan = forward_plan(Q1, 32, 132)
    assert forward_plan(list(Q1), 32, 132) is plan and hash(plan) == hash(forward_plan(Q1, 32, 132))
    assert forward_plan(Q1[:3], 32, 132) is not plan and forward_plan(Q1, 16, 132) is not plan
    assert forward_plan(Q1, 32, 66) is not plan
    cp = forward_plan(CP2_Q1_RANK0, 32, 132, first=[1], deferred=[], cp=True)
    assert forward_plan(CP2_Q1_RANK0, 32, 132, first=(1,), cp=True) is cp
    assert forward_plan(CP2_Q1_RANK0, 32, 132, first=(1,), cp=True, exchange_beside=True) is not cp
    kda_options(cp_piece_senders=True)
    assert forward_plan(CP2_Q1_RANK0, 32, 132, first=(1,), cp=True) is not cp
    assert forward_plan(Q1, 32, 132) is plan  # one GPU: the option is not read
    replay = replay_plan(CP2_Q1_RANK0, 32, 132, pieced=True)
    assert replay_plan(CP2_Q1_RANK0, 32, 132, pieced=True) is replay
    assert replay_plan(CP2_Q1_RANK0, 32, 132, pieced=True, skip_bwd=[0]) is not replay
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.nodes = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.nodes[0].first = 1
    assert isinstance(plan.nodes, tuple) and all(hash(node) is not None for node in plan.nodes)


def _checked_order(plan):
    """What every executor run of the plan holds to: each side-stream walk after a fork of its stream that
    follows the chunk stage of what it walks (a piece also after the walk of the piece before: the same
    stream), every event recorded before it is waited for, the current stream joined with every side stream
    last. Returns the walks and the exchange."""
    from kda_aot.schedule.plan import MAIN, ChunkStage, Record, RunExchange, Wait, WaitEvent, Walk
    staged, forked, recorded, walks = set(), {}, set(), []
    for step, node in enumerate(plan.nodes):
        if isinstance(node, ChunkStage):
            staged.add((node.group, node.piece))
        elif isinstance(node, Wait) and node.on == MAIN:
            forked[node.stream] = set(staged)
        elif isinstance(node, Record):
            recorded.add(node.event)
        elif isinstance(node, WaitEvent):
            assert node.event in recorded, node
        elif isinstance(node, Walk) and node.stream.kind == "side":
            assert (node.stream.group, node.piece) in forked[node.stream], node
            walks.append(node)
        elif isinstance(node, (RunExchange, Walk)):
            walks.append(node)
    joins = [n for n in plan.nodes if isinstance(n, Wait) and n.join]
    assert plan.nodes[-len(joins):] == tuple(joins) or plan.exchange is not None
    assert {n.on for n in joins if n.on.kind == "side"} == {n.stream for n in plan.nodes
                                                         if isinstance(n, Wait) and n.on == MAIN}
    return walks


@pytest.mark.parametrize("lengths", [Q1, (5,), (700, 1, 64, 300)])
def test_forward_nodes(lengths):
    """One GPU: each launch's chunk stage, its group's side stream forked, the group's walk there; the pieces
    walked in order, each from the one before's end state (handoff), the last into the final state; the joins
    last. explain() prints every node."""
    from kda_aot.schedule.plan import ChunkStage, Rows, Walk
    plan = forward_plan(lengths, 32, 132)
    walks = _checked_order(plan)
    stages = [n for n in plan.nodes if isinstance(n, ChunkStage)]
    assert [(n.group, n.piece) for n in stages] == list(plan.launches)
    assert [(n.first, n.end) for n in stages] == [plan.chunk_range(g, p) for g, p in plan.launches]
    covered = sorted(s for w in walks if w.piece in (None, 0) for s in range(w.first, w.end))
    assert covered == list(range(len(lengths)))
    if plan.pieces is not None:
        pieced = [w for w in walks if w.piece is not None]
        n = len(plan.pieces.bounds) - 1
        assert [w.piece for w in pieced] == list(range(n))
        assert [w.start for w in pieced[1:]] == [w.into for w in pieced[:-1]] == [Rows("handoff", p, p + 1)
                                                                                  for p in range(n - 1)]
        a = plan.groups[plan.pieces.group][0]
        assert pieced[0].start == Rows("initial_state", a, a + 1) and pieced[-1].into == Rows("final_state", a, a + 1)
    assert all(isinstance(w, Walk) and w.sms == plan.sms_of("kda_fwd_walk", w.stream.group) for w in walks)
    text = plan.explain()
    assert all(str(node) in text for node in plan.nodes) and len(text.splitlines()) == len(plan.nodes) + 1


@pytest.mark.parametrize("beside", [False, True], ids=["current-stream", "beside"])
def test_cp_forward_exchange_nodes(beside):
    """CP: the exchange node (RunExchange: what it summarises, sends and gives) on the exchange's stream after
    the senders' walks (and, beside, after what came before the forward and the summarised segments' chunk
    stage); the deferred walks after it from its entering states; the deferred segments' groups walk nothing
    beside the chunk stage; beside, the exchange's stream is joined before the side streams."""
    from kda_aot.schedule.plan import EXCHANGE, MAIN, Rows, RunExchange, Stream, Wait, WaitEvent, Walk
    lengths, first, deferred = (5, 40, 3, 12, 7), (1,), (0, 3, 4)
    plan = forward_plan(lengths, 32, 132, first=first, deferred=deferred, cp=True, summarised=(3,),
                        exchange_beside=beside)
    _checked_order(plan)
    nodes = list(plan.nodes)
    at = next(i for i, n in enumerate(nodes) if isinstance(n, RunExchange))
    on = EXCHANGE if beside else MAIN
    assert nodes[at] == RunExchange(on, (3,), first, deferred)
    waits = [n for n in nodes[:at] if getattr(n, "stream", None) == on and isinstance(n, (Wait, WaitEvent))]
    assert [n.on for n in waits if isinstance(n, Wait)] == [Stream("side", g, 0) for g in plan.groups_of(first)]
    events = [n.event for n in waits if isinstance(n, WaitEvent)]
    assert events == (["before", f"stage {plan.exchange.after_stage}"] if beside else [])
    after = [n for n in nodes[at + 1:] if isinstance(n, Walk)]
    assert [(w.stream, w.first, w.end, w.start, w.into) for w in after] == [
        (on, 0, 1, Rows("entering", 0, 1), Rows("final_state", 0, 1)),
        (on, 3, 5, Rows("entering", 1, 3), Rows("final_state", 3, 5))]
    side_walks = {s for n in nodes[:at] if isinstance(n, Walk) for s in range(n.first, n.end)}
    assert side_walks == set(range(len(lengths))) - set(deferred)
    joins = [n for n in nodes if isinstance(n, Wait) and n.join]
    assert (joins[0] == Wait(MAIN, EXCHANGE, join=True)) == beside


def test_replay_nodes_leave_out_the_skipped_backward_walks():
    """The replay: both walks of each group on its two lanes; skip_bwd's segments get no backward walk (a
    pieced one none through any piece); the pieces' walks chain their handoffs from both ends."""
    from kda_aot.schedule.plan import Rows, Walk
    plan = replay_plan((40, 3, 1584, 5, 368), 32, 132, pieced=True, skip_bwd=(1,))
    walks = _checked_order(plan)
    bwd = [w for w in walks if w.program == "kda_bwd_walk"]
    assert {s for w in bwd for s in range(w.first, w.end)} == {0, 2, 3, 4}  # 1 skipped
    assert all(w.stream.lane == (w.program == "kda_bwd_walk") for w in walks)
    n = len(plan.pieces.bounds) - 1
    pieced_bwd = [w for w in bwd if w.piece is not None]
    assert [w.piece for w in pieced_bwd] == list(range(n - 1, -1, -1))
    a = plan.groups[plan.pieces.group][0]
    assert pieced_bwd[0].start == Rows("dfinal_state", a, a + 1)
    assert pieced_bwd[-1].into == Rows("dinitial_state", a, a + 1)
    assert [w.into for w in pieced_bwd[:-1]] == [w.start for w in pieced_bwd[1:]]
    skipped = replay_plan((40, 3, 1584, 5, 368), 32, 132, pieced=True, skip_bwd=(a,))
    assert not [w for w in skipped.nodes if isinstance(w, Walk) and w.program == "kda_bwd_walk" and w.first == a]
    assert f"no backward walk of [{a}]" in skipped.explain()


@pytest.mark.parametrize("lengths", [Q1, (3125, 779), (1025, 193, 1563, 487, 625, 205), (7,)])
def test_replay_plan_launches_bwd_chunk_behind_each_groups_walks(lengths):
    """bwd_chunk (one GPU): after the last chunk stage, each group's two joins then kda_bwd_chunk over its chunks,
    in launch order: every chunk once, none before its group's walks are joined; the last group's walks get one
    SM a chain when the earlier groups' kda_bwd_chunk outlasts them on every SM (Q1: 66 -> 32 SMs)."""
    from kda_aot.schedule.plan import BwdChunk, ChunkStage, Wait
    plan = replay_plan(lengths, 32, 132, bwd_chunk=True)
    nodes = plan.nodes
    last_stage = max(i for i, n in enumerate(nodes) if isinstance(n, ChunkStage))
    bwd = [(i, n) for i, n in enumerate(nodes) if isinstance(n, BwdChunk)]
    assert all(i > last_stage for i, _ in bwd)
    assert sorted((n.first, n.end) for _, n in bwd) == sorted(plan.chunk_range(g) for g in range(len(plan.groups)))
    for i, n in bwd:
        joined = {(w.on.group, w.on.lane) for w in nodes[:i] if isinstance(w, Wait) and w.join}
        assert {(n.group, 0), (n.group, 1)} <= joined
    assert sum(isinstance(n, Wait) and n.join for n in nodes) == 2 * len(plan.groups)
    assert "kda_bwd_chunk of each group after its walks" in plan.explain()
    assert replay_plan(lengths, 32, 132) is not plan and not any(isinstance(n, BwdChunk)
                                                                 for n in replay_plan(lengths, 32, 132).nodes)
    if lengths == Q1:
        assert replay_plan(Q1, 32, 132).sms_of("kda_bwd_walk", 3) == 66 and plan.sms_of("kda_bwd_walk", 3) == 32
        # the work beside the last walks is every other group's, wherever the last group sits in the pack
        moved = (465, 1585, 641, 1216)
        assert replay_plan(moved, 32, 132).sms_of("kda_bwd_walk", 3) == 66
        assert replay_plan(moved, 32, 132, bwd_chunk=True).sms_of("kda_bwd_walk", 3) == 32
    with pytest.raises(ValueError, match="bwd_chunk: only a replay without pieces"):
        replay_plan(lengths, 32, 132, pieced=True, bwd_chunk=True)
