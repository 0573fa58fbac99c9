"""The launch planner (kda_aot.schedule.plan) on the CPU: every plan covers each chunk once, in the
launch order the pipelined executors run (tests/test_pipeline_emulated.py runs them)."""
import subprocess
import sys
from pathlib import Path

import pytest

from kda_aot.schedule import fit
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
    assert plan.groups == tuple(fit.plan_pipeline(lengths))
    assert len(dict(plan.walk_sms)["kda_fwd_walk"]) == len(plan.groups)


def test_q1_forward_plan():
    """Q1: the longest documents first, the last group's document in pieces launched in order."""
    plan = forward_plan(Q1, 32, 132)
    assert plan.groups == ((0, 1), (2, 3), (1, 2), (3, 4))
    pieces = plan.pieces
    assert pieces.group == 3 and list(pieces.bounds) == fit.last_group_pieces(Q1)
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
    h = fit.lead_pieces(len(pieces.order))
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
    assert "then the exchange" in text and "segments [0, 1), segments [3, 5)" in text
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
    assert "through pieces: forward [0], backward []" in plan.explain()
    assert replay_plan(Q1, 32, 132).pieces is None              # one GPU: no pieces in the replay


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
    assert "first [1], deferred [0, 2]" in cp and "then the exchange on its own stream" in cp
    assert "walked after the exchange" in cp and "through pieces: forward" in cp


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
        node = plan.exchange
        assert node.after_walks == plan.groups_of(senders)
        walked_after = [s for a, b in node.deferred_runs for s in range(a, b)]
        assert walked_after == sorted(deferred)
        if plan.pieces is not None:  # never a deferred segment: it waits for the exchange
            a, b = plan.groups[plan.pieces.group]
            assert not set(range(a, b)) & set(deferred)
        replay = replay_plan(chains, 32, 132, pieced=True)
        covered(replay)
        if replay.pieces is not None:
            n = len(replay.pieces.bounds) - 1
            assert sorted(r for f, _ in replay.pieces.walks for r in f) == list(range(n))
            assert sorted(r for _, b in replay.pieces.walks for r in b) == list(range(n))
            for step, (f, b) in enumerate(replay.pieces.walks):
                assert set(f) | set(b) <= set(replay.pieces.order[:step + 1])
