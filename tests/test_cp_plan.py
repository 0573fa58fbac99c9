"""Unit tests of kda_aot.cp.plan: pure Python, no processes.

Packs are fixed corner cases plus fresh random ones every run (seed printed; replay with
KDA_TEST_SEED=<seed>).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kda_aot import cp
from kda_aot.cp.plan import CHUNK

from conftest import SEED, generator
print(f"[test_cp_plan] KDA_TEST_SEED={SEED}")

WORLDS = (1, 2, 3, 4, 8)
T = 48 * 64      # divisible by 2W for every W above: every layout applies to every pack


def cu_of(lens):
    return [0] + torch.tensor(lens).cumsum(0).tolist()


def random_pack(key, n_docs):
    g = generator(key)
    cuts = sorted(torch.randperm(T - 1, generator=g)[:n_docs - 1].add(1).tolist())
    return [b - a for a, b in zip([0] + cuts, cuts + [T])]


PACKS = {
    "one_long": [T],                                           # spans every rank
    "shorts": [1, 2, 3, 63, 64, 65] * 4 + [T - 4 * 198],       # shorter than any share
    "ragged": [1, 700, 64, 129, 5, 1000, T - 1899],
    "many_tiny": [3] * (T // 3),                               # every doc one short chunk
    "random_few": random_pack("few", 5),
    "random_many": random_pack("many", 40),
}


def all_plans(lens, layout, W):
    return [cp.make_plan(cu_of(lens), layout, world_size=W, rank=r) for r in range(W)]


CASES = [(p, lay, W) for p in PACKS for lay in cp.LAYOUTS for W in WORLDS]


@pytest.mark.parametrize("pack,layout,W", CASES)
def test_plan_invariants(pack, layout, W):
    lens = PACKS[pack]
    cu = cu_of(lens)
    plans = all_plans(lens, layout, W)
    table = plans[0].fragments
    msg = f"{pack} {layout} W={W} seed {SEED}"
    # a pure function of (cu_seqlens, W, layout): every rank computes the same table
    for p in plans:
        assert p.fragments == table, msg
        assert p.agreed() == plans[0].agreed()

    # every token owned exactly once, local order = increasing global order
    maps = [p.token_map for p in plans]
    owned = torch.cat(maps)
    assert torch.equal(owned.sort().values, torch.arange(T)), msg
    for m in maps:
        assert bool((m[1:] > m[:-1]).all()), msg

    # the table: global order, no empty fragment, chains in order within each document
    assert [f.index for f in table] == list(range(len(table)))
    assert table[0].start == 0 and table[-1].end == T
    for a, b in zip(table[:-1], table[1:]):
        assert a.end == b.start, msg
    for d in range(len(lens)):
        chain = plans[0].doc_fragments(d)
        assert chain[0].start == cu[d] and chain[-1].end == cu[d + 1], msg
        for i, f in enumerate(chain):
            assert f.doc == d and f.length > 0 and f.position == i
            assert f.needs_state == (i > 0) and f.is_last == (i == len(chain) - 1)
            assert plans[0].previous(f) == (chain[i - 1] if i else None)
            assert plans[0].next(f) == (chain[i + 1] if i + 1 < len(chain) else None)
        # fragments are maximal: neighbours in a chain live on different ranks
        for a, b in zip(chain[:-1], chain[1:]):
            assert a.rank != b.rank, msg

    # local segmentation: one segment per fragment, consistent offsets
    for r, p in enumerate(plans):
        local = p.local_fragments
        assert [f.segment for f in local] == list(range(len(local)))
        assert all(f.rank == r for f in local)
        assert list(p.local_cu_seqlens) == [0] + [f.local_start + f.length for f in local]
        assert [f.local_start for f in local] == list(p.local_cu_seqlens[:-1])
        assert p.num_local_tokens == p.local_cu_seqlens[-1] == len(maps[r])
        for f in local:
            assert torch.equal(maps[r][f.local_start:f.local_start + f.length],
                               torch.arange(f.start, f.end))


@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("W", WORLDS)
def test_contiguous_and_zigzag_ownership(pack, W):
    lens = PACKS[pack]
    n = T // W
    for r, p in enumerate(all_plans(lens, "contiguous", W)):
        assert torch.equal(p.token_map, torch.arange(r * n, (r + 1) * n))
    h = T // (2 * W)
    for r, p in enumerate(all_plans(lens, "zigzag", W)):
        want = torch.cat([torch.arange(r * h, (r + 1) * h),
                          torch.arange((2 * W - 1 - r) * h, (2 * W - r) * h)])
        assert torch.equal(p.token_map, want)       # exact balance: T / W tokens each


@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("W", WORLDS)
def test_doc_zigzag_pieces(pack, W):
    """Per document: whole chunks, pieces as equal as possible in zigzag order; over the pack:
    every rank's chunk count within one of the others (the rotated remainder)."""
    lens = PACKS[pack]
    cu = cu_of(lens)
    plans = all_plans(lens, "doc_zigzag", W)
    chunks_of_rank = [0] * W
    zig = list(range(W)) + list(range(W - 1, -1, -1))       # owner of piece p
    for d, L in enumerate(lens):
        n = -(-L // CHUNK)
        base = n // (2 * W)
        chain = plans[0].doc_fragments(d)
        for f in chain:
            assert (f.start - cu[d]) % CHUNK == 0, "fragments start on chunk boundaries"
            chunks_of_rank[f.rank] += -(-f.length // CHUNK)
        # Rebuild the piece sizes from the chain: owners must follow the zigzag order.
        sizes, p = [None] * (2 * W), 0
        for f in chain:
            while zig[p] != f.rank:
                sizes[p] = 0            # an empty piece
                p += 1
            c = -(-f.length // CHUNK)
            if f.rank == W - 1 and p == W - 1:
                # pieces W-1 and W are both rank W-1's and adjacent: merged into one fragment
                assert 2 * base <= c <= 2 * base + 2
                sizes[p], sizes[p + 1] = c, 0
                p += 2
            else:
                sizes[p] = c
                p += 1
        sizes = [0 if s is None else s for s in sizes]
        for q, s in enumerate(sizes):
            if q not in (W - 1, W):
                assert s in (base, base + 1), (d, L, sizes)
        assert sum(sizes) == n
        # rank r holds at most its two pieces (merged into one for rank W-1)
        per_rank = [sum(1 for f in chain if f.rank == r) for r in range(W)]
        assert max(per_rank) <= 2 and per_rank[W - 1] <= 1
    assert max(chunks_of_rank) - min(chunks_of_rank) <= 1, chunks_of_rank
    if all(L % CHUNK == 0 for L in lens):
        tokens = [p.num_local_tokens for p in plans]
        assert max(tokens) - min(tokens) <= CHUNK


def test_document_spanning_every_rank():
    plans = all_plans([T], "contiguous", 8)
    assert [f.rank for f in plans[0].fragments] == list(range(8))
    for W in (2, 4, 8):
        zz = [f.rank for f in all_plans([T], "zigzag", W)[0].fragments]
        assert zz == list(range(W)) + list(range(W - 2, -1, -1))     # W-1's halves merged
        dz = [f.rank for f in all_plans([T], "doc_zigzag", W)[0].fragments]
        assert dz == zz


def test_short_documents_and_empty_pieces():
    # doc_zigzag, W = 4: a 3-chunk document fills 3 of its 8 pieces; a 1-token one, 1 piece.
    plans = all_plans([130, 1, 64 * 8 - 1], "doc_zigzag", 4)
    chains = [plans[0].doc_fragments(d) for d in range(3)]
    assert [f.length for f in chains[0]] == [64, 64, 2]
    assert len(chains[1]) == 1 and chains[1][0].length == 1
    assert [f.length for f in chains[2]] == [64, 64, 64, 128, 64, 64, 63]
    # the remainder rotates: the docs' single/extra chunks do not all land on rank 0
    assert chains[1][0].rank != chains[0][0].rank
    # ranks that hold nothing (W = 8, two one-chunk documents)
    plans = all_plans([20, 28], "doc_zigzag", 8)
    empty = [p for p in plans if not p.local_fragments]
    assert len(empty) == 6
    for p in empty:
        assert p.num_local_tokens == 0 and p.local_cu_seqlens == (0,)
        assert p.token_map.numel() == 0
        assert p.shard(torch.randn(1, 48, 3)).shape == (1, 0, 3)
    # zigzag parts shorter than the conv halo (3 tokens each at W = 8, T = 48)
    zz = all_plans([20, 28], "zigzag", 8)[0]
    assert min(f.length for f in zz.fragments) < 3


@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_world_size_one_is_single_device(layout):
    lens = PACKS["ragged"]
    p = cp.make_plan(cu_of(lens), layout, world_size=1, rank=0)
    assert [(f.start, f.end) for f in p.fragments] == list(zip(cu_of(lens)[:-1], cu_of(lens)[1:]))
    assert list(p.local_cu_seqlens) == cu_of(lens)
    assert not any(f.needs_state for f in p.fragments)


@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_shard_unshard_roundtrip_and_gradients(layout):
    lens = [5, 300, 7, 64, T - 376]
    plans = all_plans(lens, layout, 3)
    x = torch.randn(1, T, 2, 3, requires_grad=True)
    parts = [p.shard(x) for p in plans]
    assert torch.equal(plans[0].unshard(parts), x.detach())
    assert torch.equal(plans[0].unshard([q.detach() for q in parts]), x.detach())
    # shard is an index_select: the gradient lands on the rank's own tokens only
    parts[1].sum().backward()
    mask = torch.zeros(T)
    mask[plans[1].token_map] = 1
    assert torch.equal(x.grad, mask[None, :, None, None].expand_as(x))
    with pytest.raises(ValueError, match="expected 3 parts"):
        plans[0].unshard(parts[:2])
    with pytest.raises(ValueError, match="rank 1's part"):
        plans[0].unshard([parts[0], parts[1][:, :-1], parts[2]])
    with pytest.raises(ValueError, match="global"):
        plans[0].shard(torch.randn(1, T - 1, 2))


def test_inputs_and_errors():
    cu = cu_of([100, 92])
    a = cp.make_plan(cu, "doc_zigzag", world_size=2, rank=1)
    assert a == cp.make_plan(torch.tensor(cu, dtype=torch.int32), "doc_zigzag", world_size=2, rank=1)
    assert a == cp.make_plan(torch.tensor(cu), "doc_zigzag", world_size=2, rank=0).for_rank(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.rank = 0
    assert a.agreed() != cp.make_plan(cu, "zigzag", world_size=2, rank=1).agreed()
    assert a.agreed() != cp.make_plan(cu_of([99, 93]), "doc_zigzag", world_size=2, rank=1).agreed()
    with pytest.raises(ValueError, match="contiguous, zigzag, doc_zigzag"):
        cp.make_plan(cu, "ring", world_size=2, rank=0)
    with pytest.raises(ValueError, match="T = 192, world size = 5"):
        cp.make_plan(cu, "contiguous", world_size=5, rank=0)
    with pytest.raises(ValueError, match="T = 192, world size = 5"):
        cp.make_plan(cu, "zigzag", world_size=5, rank=0)
    cp.make_plan(cu, "doc_zigzag", world_size=5, rank=0)        # ragged: any T
    with pytest.raises(ValueError, match="rank must be in"):
        cp.make_plan(cu, "contiguous", world_size=2, rank=2)
    with pytest.raises(ValueError, match="world size must be"):
        cp.make_plan(cu, "contiguous", world_size=0, rank=0)
    with pytest.raises(ValueError, match="world_size and rank"):
        cp.make_plan(cu, "contiguous")
    for bad in ([1, 10], [0, 7, 3]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            cp.make_plan(bad, "doc_zigzag", world_size=2, rank=0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        cp.make_plan([0], "doc_zigzag", world_size=2, rank=0)
    with pytest.raises(ValueError, match="cu_seqlens: zero-length document 1 .* context parallelism"):
        cp.make_plan([0, 5, 5, 10], "doc_zigzag", world_size=2, rank=0)
    with pytest.raises(TypeError, match="cu_seqlens"):
        cp.make_plan(torch.tensor([0.0, 4.0]), "doc_zigzag", world_size=2, rank=0)
    with pytest.raises(TypeError, match="cu_seqlens: expected a tensor or a sequence of ints"):
        cp.make_plan([0, 10.7, 20], "contiguous", world_size=2, rank=0)  # refused, never truncated


def test_phase_timing_records_only_when_asked(kda_options):
    from kda_aot.cp import collective as ops
    ops.phase_times()
    with ops._Phase("off", torch.device("cpu")):
        pass
    assert ops.phase_times() == {}
    kda_options(debug_timing=True)
    for _ in range(2):
        with ops._Phase("summary", torch.device("cpu")):
            pass
    got = ops.phase_times()
    assert list(got) == ["summary"] and len(got["summary"]) == 2 and all(ms >= 0 for ms in got["summary"])
    assert ops.phase_times() == {}  # cleared


def test_entering_decay_of_the_fragments_that_start_a_document():
    """The initial state's factor of a fragment that starts its document here is kda.entering_decay of
    that fragment's first local token under the backend's floor; a backend without gate_floor takes the
    initial state as it is."""
    from kda_aot.cp.collective import entering_decay
    from kda_aot.schedule.kda import GATE_FLOOR, entering_decay as decay_of
    plan = cp.make_plan([0, 20, 130, 200], "contiguous", world_size=2, rank=1)  # document 2 starts at local 30
    starts = [f for f in plan.local_fragments if f.position == 0]
    assert starts, "the pack has a document starting on rank 1"
    T = plan.local_cu_seqlens[-1]
    g = -40.0 * torch.rand(1, T, 2, 128, dtype=torch.float64)

    class Floored:
        gate_floor = GATE_FLOOR

    for f in starts:
        first = g[0, plan.local_cu_seqlens[f.segment]]
        got = entering_decay(g, plan, f, Floored())
        assert got.shape == (2, 128, 1) and torch.equal(got, decay_of(first))
        assert torch.equal(entering_decay(g, plan, f, object()), torch.ones(2, 128, 1))
