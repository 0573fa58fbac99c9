"""Bad input to the KDA forward: a clear TypeError/ValueError naming the argument, before any launch.

Runs without a GPU: Python checks the shapes users pass, the bindings re-check dtype, shape,
contiguity and alignment of every tensor before the device (CPU tensors reach every check; the
device check is the last one).
"""
import re

import pytest
import torch

import kda_aot

from conftest import HAS_GPU
from kda_aot._runtime import registry
from kda_aot._runtime.tensor import describe
from kda_aot.schedule.kda import chunk_kda_fwd
from kda_aot._runtime.packing import chunk_table, pack_tables

DEV = "cuda" if HAS_GPU else "cpu"


def good(T=70, H=2, lens=(5, 65)):
    bf = dict(device=DEV, dtype=torch.bfloat16)
    q = torch.randn(1, T, H, 128, **bf)
    k = torch.randn(1, T, H, 128, **bf)
    v = torch.randn(1, T, H, 128, **bf)
    g = -torch.rand(1, T, H, 128, device=DEV)
    beta = torch.rand(1, T, H, **bf)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return q, k, v, g, beta, cu


CASES = [
    ("q rank", lambda q, k, v, g, b, cu: (q[0], k, v, g, b, cu), ValueError, r"q: expected shape \[1, T, H, 128\]"),
    ("k shape", lambda q, k, v, g, b, cu: (q, k[:, :69], v, g, b, cu), ValueError, r"k: expected shape .* \(as q\)"),
    ("g shape", lambda q, k, v, g, b, cu: (q, k, v, g[..., :64], b, cu), ValueError, r"g: expected shape"),
    ("beta shape", lambda q, k, v, g, b, cu: (q, k, v, g, b[..., :1], cu), ValueError, r"beta: expected shape"),
    ("cu decreasing", lambda q, k, v, g, b, cu: (q, k, v, g, b, torch.tensor([0, 5, 4, 70], dtype=torch.int32)),
     ValueError, "cu_seqlens: must be non-decreasing"),
    ("cu end", lambda q, k, v, g, b, cu: (q, k, v, g, b, torch.tensor([0, 5, 69], dtype=torch.int32)), ValueError,
     "cu_seqlens: must end at T = 70"),
    ("cu dtype", lambda q, k, v, g, b, cu: (q, k, v, g, b, cu.float()), TypeError, "cu_seqlens: expected dtype"),
    ("head dim 64", lambda q, k, v, g, b, cu: (q[..., :64], k[..., :64], v[..., :64], g[..., :64], b, cu),
     ValueError, "q: head dim must be 128"),
    ("q dtype", lambda q, k, v, g, b, cu: (q.float(), k, v, g, b, cu), TypeError, "q: expected dtype bfloat16"),
    ("g dtype", lambda q, k, v, g, b, cu: (q, k, v, g.to(torch.bfloat16), b, cu), TypeError, "g: expected dtype float32"),
    ("beta dtype", lambda q, k, v, g, b, cu: (q, k, v, g, b.float(), cu), TypeError, "beta: expected dtype bfloat16"),
    ("v non-contiguous", lambda q, k, v, g, b, cu: (q, k, v.transpose(2, 3).contiguous().transpose(2, 3), g, b, cu),
     ValueError, "v: expected contiguous"),
    ("k misaligned", lambda q, k, v, g, b, cu: (q, torch.randn(k.numel() + 1, device=k.device).to(torch.bfloat16)[1:]
                                               .view(k.shape), v, g, b, cu), ValueError, "k: storage must be 16-byte"),
    ("v not a tensor", lambda q, k, v, g, b, cu: (q, k, v.tolist(), g, b, cu), TypeError, "v: expected a torch.Tensor"),
]


@pytest.mark.parametrize("name,mutate,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_named(name, mutate, exc, match):
    args = mutate(*good())
    with pytest.raises(exc, match=match):
        chunk_kda_fwd(*args[:5], cu_seqlens=args[5])


def test_more_than_64_heads():
    q, k, v, g, b, cu = good(T=8, H=65, lens=(8,))
    with pytest.raises(ValueError, match="q: at most 64 heads, got 65"):
        chunk_kda_fwd(q, k, v, g, b, cu_seqlens=cu)


def test_grouped_value_heads_must_divide():
    """HV a multiple of q's and k's H, named before any kernel: the schedule's check and the binding's."""
    q, k, v, g, b, cu = good(H=2)
    T = q.shape[1]
    v3, g3, b3 = (torch.cat([x, x[:, :, :1]], dim=2) for x in (v, g, b))  # 3 value heads
    with pytest.raises(ValueError, match=r"v: its heads \(HV = 3\) must be a multiple of q's and k's \(H = 2\)"):
        chunk_kda_fwd(q, k, v3, g3, b3, cu_seqlens=cu)
    chunks, segs = chunk_table([0, 5, T])
    lib = registry.library("kda_fwd_chunk", "lean")
    base = {"q": q, "k": k, "chunks": torch.tensor(chunks, dtype=torch.int32, device=DEV).view(-1, 2),
            "seg_chunks": torch.tensor(segs, dtype=torch.int32, device=DEV)}
    bf = dict(device=DEV, dtype=torch.bfloat16)

    def outputs(HV):
        C = len(chunks) // 2
        return {"w": torch.empty(1, T, HV, 128, **bf), "u": torch.empty(1, T, HV, 128, **bf),
                "qg": torch.empty(1, T, HV, 128, **bf), "kg": torch.empty(1, T, HV, 128, **bf),
                "aqk": torch.empty(1, T, HV, 64, **bf), "aqk_diag_lo": torch.empty(1, T, HV, device=DEV),
                "gamma": torch.empty(C, HV, 128, device=DEV)}
    bad = dict(base, v=v3, g=g3, beta=b3, **outputs(3))
    with pytest.raises(ValueError, match=r"v: its heads \(HV = 3\) must be a multiple of q's and k's \(H = 2\)"):
        lib.launch({n: describe(x, n) for n, x in bad.items()}, 1.0, 0)
    v4, g4, b4 = (torch.cat([x, x], dim=2) for x in (v, g, b))  # 4 value heads: 2 per q, k head
    wrong_k = dict(base, k=torch.cat([k, k], dim=2), v=v4, g=g4, beta=b4, **outputs(4))
    with pytest.raises(ValueError, match=r"k: expected shape \[1, T, Hqk, 128\] \(as q\)"):
        lib.launch({n: describe(x, n) for n, x in wrong_k.items()}, 1.0, 0)
    if not HAS_GPU:  # the grouped call passes every shape check: the device check is the last one
        good_call = dict(base, v=v4, g=g4, beta=b4, **outputs(4))
        with pytest.raises(ValueError, match="expected a CUDA tensor"):
            lib.launch({n: describe(x, n) for n, x in good_call.items()}, 1.0, 0)


SHAPE_CASES = [  # (mutation of good()'s q, k, v, g, beta; the message every entry point gives)
    ("v heads", lambda q, k, v, g, b: (q, k, *(torch.cat([x, x[:, :, :1]], dim=2) for x in (v, g, b))),
     r"v: its heads \(HV = 3\) must be a multiple of q's and k's \(H = 2\)"),
    ("g shape", lambda q, k, v, g, b: (q, k, v, g[..., :64], b), r"g: expected shape \[1, 70, 2, 128\] \(\[B, T, HV, K\]\)"),
    ("beta shape", lambda q, k, v, g, b: (q, k, v, g, b[..., :1]), r"beta: expected shape \[1, 70, 2\]"),
    ("k shape", lambda q, k, v, g, b: (q, k[:, :69], v, g, b), r"k: expected shape \[1, 70, 2, 128\] \(as q\)"),
    ("q rank", lambda q, k, v, g, b: (q[0], k, v, g, b), r"q: expected shape \[(1|B), T, H, (128|K)\]"),
    ("beta type", lambda q, k, v, g, b: (q, k, v, g, b.tolist()), "beta: expected a torch.Tensor"),
]


@pytest.mark.parametrize("name,mutate,match", SHAPE_CASES, ids=[c[0] for c in SHAPE_CASES])
def test_every_entry_point_names_a_shape_the_same_way(name, mutate, match):
    """One check of the KDA inputs' shapes (check_kda_shapes): the public op, the programs' caller, the op with
    the gate activated in torch, the fp64 reference and the CP op's per-rank validation give the same message."""
    from kda_aot import reference
    from kda_aot.cp import make_plan
    from kda_aot.cp.ops import _validate
    q, k, v, g, b, cu = good()
    args = mutate(q, k, v, g, b)
    with pytest.raises((TypeError, ValueError), match=match):
        kda_aot.chunk_kda(*args, cu_seqlens=cu)
    with pytest.raises((TypeError, ValueError), match=match):
        chunk_kda_fwd(*args, cu_seqlens=cu)
    raw = (*args[:3], args[3] if name != "g shape" else g[..., :64].neg(), args[4])
    with pytest.raises((TypeError, ValueError), match=match):
        kda_aot.chunk_kda(*raw, cu_seqlens=cu, use_gate_in_kernel=True, A_log=torch.zeros(2, device=DEV))
    fp64 = [x.double() if isinstance(x, torch.Tensor) else x for x in args]
    with pytest.raises((TypeError, ValueError), match=match):
        reference.kda_chunked(*fp64, cu_seqlens=cu.cpu())
    with pytest.raises((TypeError, ValueError), match=match):
        reference.kda_recurrent(*fp64, cu_seqlens=cu.cpu())
    assert re.search(match, _validate(*args, None, make_plan(cu.cpu(), "contiguous", world_size=1, rank=0)))


def test_initial_state_shape_and_dtype():
    q, k, v, g, b, cu = good()
    with pytest.raises(ValueError, match=r"initial_state: expected shape \[2, 2, 128, 128\]"):
        chunk_kda_fwd(q, k, v, g, b, cu_seqlens=cu, initial_state=torch.zeros(1, 2, 128, 128, device=DEV))
    with pytest.raises(TypeError, match="initial_state: expected dtype float32"):
        chunk_kda_fwd(q, k, v, g, b, cu_seqlens=cu,
                      initial_state=torch.zeros(2, 2, 128, 128, device=DEV, dtype=torch.bfloat16))


@pytest.mark.skipif(HAS_GPU, reason="the CPU-tensor refusal is what a GPU-less machine can show")
def test_cpu_tensors_are_refused_last():
    q, k, v, g, b, cu = good()
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):  # the schedule's call: the binding's check
        chunk_kda_fwd(q, k, v, g, b, cu_seqlens=cu)
    for norm in (False, True):  # the op's: named, with where to go on the CPU (with the norm, its kernel is first)
        with pytest.raises(ValueError, match="q: chunk_kda runs its kernels on a CUDA GPU, got a tensor on cpu; on "
                                             r"the CPU, kda_aot.reference.kda_chunked is the same math in fp64, on one "
                                             r"packed sequence \(B sequences .* with K-first states"):
            kda_aot.chunk_kda(q, k, v, g, b, cu_seqlens=cu, use_qk_l2norm_in_kernel=norm)
    empty = [x[:, :0] for x in (q, k, v, g, b)]  # no token: nothing to launch, and still the same refusal
    with pytest.raises(ValueError, match="q: chunk_kda runs its kernels on a CUDA GPU, got a tensor on cpu"):
        kda_aot.chunk_kda(*empty, cu_seqlens=torch.zeros(3, dtype=torch.int32))


def test_binding_refuses_unknown_and_missing_tensors():
    q, k, v, g, b, cu = good()
    lib = registry.library("kda_fwd_chunk", "lean")  # the shipped form
    with pytest.raises(ValueError, match="unknown tensor argument 'qq'"):
        lib.launch({"qq": describe(q, "qq")}, 1.0, 0)
    with pytest.raises(TypeError, match="k: a tensor is required by kda_fwd_chunk/lean"):
        lib.launch({"q": describe(q, "q")}, 1.0, 0)


def test_chunk_table():
    chunks, segs = chunk_table([0, 1, 65, 130, 259])
    assert chunks == [0, 1, 1, 65, 65, 129, 129, 130, 130, 194, 194, 258, 258, 259]
    assert segs == [0, 1, 2, 4, 7]


def test_backward_walk_binding_checks():
    q, k, v, g, b, cu = good()
    T, H = q.shape[1], q.shape[2]
    lib = registry.library("kda_bwd_walk", "full")
    with pytest.raises(TypeError, match="chunks: a tensor is required by kda_bwd_walk/full"):
        lib.launch({"dout": describe(q, "dout")}, 1.0, 0)
    chunks, segs = chunk_table([0, 5, T])
    bf = dict(device=DEV, dtype=torch.bfloat16)
    full = {"dout": q, "chunks": torch.tensor(chunks, dtype=torch.int32, device=DEV).view(-1, 2),
            "seg_chunks": torch.tensor(segs, dtype=torch.int32, device=DEV), "w": k, "qg": v, "kg": k,
            "aqk": torch.zeros(1, T, H, 64, **bf), "gamma": torch.zeros(len(chunks) // 2, H, 128, device=DEV),
            "dtape": torch.zeros(len(chunks) // 2, H, 128, 128, device=DEV)}
    bad = dict(full, dout=q.float())
    with pytest.raises(TypeError, match="dout: expected dtype bfloat16"):
        lib.launch({n: describe(x, n) for n, x in bad.items()}, 1.0, 0)
    nothing = {n: describe(x, n) for n, x in full.items() if n != "dtape"}  # the offset walk with no output
    with pytest.raises(TypeError, match="kda_bwd_walk/full: expected a tensor for dtape or dinitial_state"):
        lib.launch(nothing, 1.0, 0)
    bad = dict(full, dtape=full["dtape"][:1])
    with pytest.raises(ValueError, match=r"dtape: expected shape \[n_chunks, H, 128, 128\]"):
        lib.launch({n: describe(x, n) for n, x in bad.items()}, 1.0, 0)


def test_forward_walk_needs_the_diagonal_correction_with_an_output():
    q, k, v, g, b, cu = good()
    T, H = q.shape[1], q.shape[2]
    lib = registry.library("kda_fwd_walk", "full")
    chunks, segs = chunk_table([0, 5, T])
    full = {"q": q, "chunks": torch.tensor(chunks, dtype=torch.int32, device=DEV).view(-1, 2),
            "seg_chunks": torch.tensor(segs, dtype=torch.int32, device=DEV), "w": k, "u": v, "qg": q, "kg": k,
            "aqk": torch.zeros(1, T, H, 64, device=DEV, dtype=torch.bfloat16),
            "gamma": torch.zeros(len(chunks) // 2, H, 128, device=DEV), "o": torch.empty_like(q)}
    with pytest.raises(TypeError, match="kda_fwd_walk/full: aqk_diag_lo is required with o"):
        lib.launch({n: describe(x, n) for n, x in full.items()}, 1.0, 0)
    bad = dict(full, aqk_diag_lo=torch.zeros(1, T, H, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="aqk_diag_lo: expected dtype float32"):
        lib.launch({n: describe(x, n) for n, x in bad.items()}, 1.0, 0)


def test_pack_tables_are_cached_by_value_and_accept_cpu_boundaries():
    a = pack_tables(torch.tensor([0, 1, 65, 130, 259]), 259, DEV)
    b = pack_tables(torch.tensor([0, 1, 65, 130, 259], dtype=torch.int32, device=DEV), 259, DEV)
    assert a is b  # same boundaries, same device: built once
    assert a.cu.dtype == torch.int32 and a.cu.device.type == torch.device(DEV).type
    assert a.chunks.cpu().flatten().tolist() == chunk_table([0, 1, 65, 130, 259])[0]
    assert a.seg_chunks.cpu().tolist() == [0, 1, 2, 4, 7]
    # the segment whose last chunk each chunk is (the forward's U rounding error of that chunk goes to its final state)
    assert a.end_segment.cpu().tolist() == [0, 1, -1, 2, -1, -1, 3]
    assert pack_tables(torch.tensor([0, 5, 5, 70]), 70, DEV).end_segment.cpu().tolist() == [0, -1, 1]  # an empty doc
    with pytest.raises(ValueError, match="cu_seqlens: must end at T = 260"):
        pack_tables(torch.tensor([0, 1, 65, 130, 259]), 260, DEV)


def test_backward_mode_must_be_known():
    from kda_aot import chunk_kda
    q, k, v, g, b, cu = good()
    with pytest.raises(ValueError, match="backward: expected one of"):
        chunk_kda(q, k, v, g, b, cu_seqlens=cu, backward="checkpoint")


def test_head_groups_split_evenly_and_cover_every_head():
    from kda_aot.schedule.backward import head_groups
    assert head_groups(64, per_head=10, available=1000) == [(0, 64)]
    assert head_groups(64, per_head=10, available=420) == [(0, 32), (32, 64)]
    assert head_groups(3, per_head=10, available=1000, max_heads=1) == [(0, 1), (1, 2), (2, 3)]
    assert head_groups(5, per_head=10, available=1) == [(i, i + 1) for i in range(5)]  # at least one head
    for H in (1, 7, 33, 64):
        for cap in (1, 2, 5, 64):
            groups = head_groups(H, per_head=1, available=cap)
            assert groups[0][0] == 0 and groups[-1][1] == H
            assert all(a < b and b - a <= cap for a, b in groups)
            assert all(groups[i][1] == groups[i + 1][0] for i in range(len(groups) - 1))


def test_replay_working_set_is_counted_per_head():
    from kda_aot.schedule.backward import replay_bytes_per_head
    # Q1 (249,856 tokens, 3,904 chunks): about 1.7 GB a head with a group's input copies
    b = replay_bytes_per_head(249856, 3904)
    assert 1.5e9 < b < 1.75e9
    # one pass over every head makes no input copies (1,538 B a token-head): priced without them
    assert b - replay_bytes_per_head(249856, 3904, grouped=False) == 249856 * 1538


def test_replay_tiles_one_pass_then_segment_runs_then_head_groups():
    from kda_aot.schedule.backward import replay_bytes_per_head, replay_tiles
    bounds = (0, 101377, 142338, 220115, 249856)  # Q1
    lengths = tuple(-(-(b - a) // 64) for a, b in zip(bounds, bounds[1:]))
    T, C = bounds[-1], sum(lengths)
    alone, grouped = replay_bytes_per_head(T, C, 4, grouped=False), replay_bytes_per_head(T, C, 1)
    # H = 64: fits in one pass (no copies) but not with the copies counted -> one pass
    assert replay_tiles(bounds, lengths, 64, 1, 64 * alone, 0) == [(0, 4, 0, 64)]
    # short of one pass: runs of whole segments over every head, the fewest, filled in pack order
    assert replay_tiles(bounds, lengths, 64, 1, 64 * alone - 1, 0) == [(0, 3, 0, 64), (3, 4, 0, 64)]
    assert replay_tiles(bounds, lengths, 64, 1, 64 * alone, 64 * alone // 2) == [(0, 4, 0, 64)]
    tiles = replay_tiles(bounds, lengths, 64, 1, 64 * alone - 1, 64 * alone // 2)
    assert tiles == [(0, 1, 0, 64), (1, 3, 0, 64), (3, 4, 0, 64)]
    for a, b, _, _ in tiles:  # each run fits in what is left beside the whole gradients
        t, c = bounds[b] - bounds[a], sum(lengths[a:b])
        assert 64 * replay_bytes_per_head(t, c, b - a, grouped=False) <= 64 * alone - 1 - 64 * alone // 2
    # a segment that alone does not fit is cut into head groups, priced with their copies; the rest run whole
    first = replay_bytes_per_head(bounds[1], lengths[0], 1, grouped=False)
    left = 64 * first - 1
    tiles = replay_tiles(bounds, lengths, 64, 1, left, 0)
    assert tiles == [(0, 1, 0, 32), (0, 1, 32, 64), (1, 2, 0, 64), (2, 3, 0, 64), (3, 4, 0, 64)]
    one_doc, one_pass = (0, T), replay_bytes_per_head(T, C, 1, grouped=False)
    assert replay_tiles(one_doc, (C,), 64, 1, 64 * one_pass - 1, 0) == [(0, 1, 0, 32), (0, 1, 32, 64)]
    assert replay_tiles(one_doc, (C,), 64, 1, 64 * grouped, 0) == [(0, 1, 0, 64)]  # one pass: no copies
    assert replay_tiles(one_doc, (C,), 64, 1, 32 * grouped - 1, 0) == [(0, 1, 0, 21), (0, 1, 21, 43), (0, 1, 43, 64)]
    # max_heads caps a tile's value heads (GVA: G value heads a q, k head); max_tokens a run's tokens
    assert replay_tiles(bounds, lengths, 64, 1, 10 ** 15, 0, max_heads=32) == [(0, 4, 0, 32), (0, 4, 32, 64)]
    assert replay_tiles(bounds, lengths, 16, 4, 10 ** 15, 0, max_heads=32) == [(0, 4, 0, 8), (0, 4, 8, 16)]
    assert replay_tiles(bounds, lengths, 16, 4, 10 ** 15, 0, max_heads=64) == [(0, 4, 0, 16)]
    assert replay_tiles(bounds, lengths, 32, 1, 10 ** 15, 0, max_tokens=150000) == [(0, 2, 0, 32), (2, 4, 0, 32)]
    assert replay_tiles(bounds, lengths, 32, 1, 10 ** 15, 0, max_tokens=T) == [(0, 4, 0, 32)]
    assert replay_tiles(bounds, lengths, 2, 1, 10 ** 15, 0, max_heads=1, max_tokens=150000) == [
        (0, 2, 0, 1), (0, 2, 1, 2), (2, 4, 0, 1), (2, 4, 1, 2)]
    # a segment longer than max_tokens is a run of its own; runs cover every segment in order
    assert replay_tiles((0, 10, 500, 520, 530), (1, 8, 1, 1), 1, 1, 10 ** 15, 0, max_tokens=100) == [
        (0, 1, 0, 1), (1, 2, 0, 1), (2, 4, 0, 1)]


def test_chunk_kda_batched_and_packed_shapes_are_checked():
    from kda_aot import chunk_kda
    x = torch.randn(2, 8, 1, 128, device=DEV).to(torch.bfloat16)
    g = torch.zeros(2, 8, 1, 128, device=DEV)
    b = torch.rand(2, 8, 1, device=DEV).to(torch.bfloat16)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"packed in one sequence \(B = 1\), got B = 2"):
        chunk_kda(x, x, x, g, b, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"beta: expected shape \[2, 8, 1\]"):
        chunk_kda(x, x, x, g, b[:1])
    with pytest.raises(ValueError, match=r"g: expected shape \[2, 8, 1, 128\]"):
        chunk_kda(x, x, x, g[:, :4], b)
    with pytest.raises(TypeError, match="beta: expected a torch.Tensor"):
        chunk_kda(x, x, x, g, None)
    with pytest.raises(ValueError, match=r"q: expected shape \[1, T, H, 128\] \(packed documents\)"):
        chunk_kda_fwd(x, x, x, g, b, cu_seqlens=cu)


def test_backward_forms_are_checked_before_any_kernel(kda_options):
    from kda_aot.schedule.backward import chunk_kda_bwd
    with pytest.raises(ValueError, match="gate_form: expected one of"):
        chunk_kda_bwd({}, None, gate_form="quarter")
    kda_options(gate_form="half")
    with pytest.raises(ValueError, match="gate_form: expected one of"):
        chunk_kda_bwd({}, None)


def test_backward_stage_launches_name_every_tensor(monkeypatch):
    """The chunk-parallel backward's launches on the CPU with the kernels replaced by a recorder:
    kda_bwd_chunk and kda_bwd_gate get every tensor they read and write (the plain order: all
    chunks), and a chunk-range launch (the pipelined replay's backward) narrows exactly the
    chunk-indexed ones (chunks, gamma, tape, dtape, dgam_s) and nothing else."""
    from kda_aot.schedule import backward

    calls = []

    class Recorder:
        def __init__(self, program):
            self.program = program

        def launch(self, desc, scale, stream):
            calls.append((self.program, {name: d[3] for name, d in desc.items()}))

    monkeypatch.setattr(registry, "library", lambda program, form="default", device=None: Recorder(program))
    T, H = 200, 2
    tables = pack_tables(torch.tensor([0, 70, 200]), T, "cpu")
    C = tables.chunks.shape[0]
    bf = dict(dtype=torch.bfloat16)
    tok = lambda d=128: torch.zeros(1, T, H, d, **bf)  # noqa: E731
    saved = {"q": tok(), "k": tok(), "v": tok(), "g": torch.zeros(1, T, H, 128), "beta": torch.zeros(1, T, H, **bf),
             "chunks": tables.chunks, "seg_chunks": tables.seg_chunks, "chain_lengths": tables.chain_lengths,
             "w": tok(), "u": tok(), "kg": tok(), "qg": tok(), "aqk": tok(64), "akk_inv": tok(64), "vnew": tok(),
             "gamma": torch.zeros(C, H, 128), "tape": torch.zeros(C, H, 128, 128), "scale": 0.1,
             "gate": None, "beta_kind": 0}  # as chunk_kda_fwd's saved context holds them
    dtape, dh0 = torch.zeros(C, H, 128, 128), torch.zeros(2, H, 128, 128)
    for gate_form in ("split_staged", "full"):
        calls.clear()
        dq, dk, dv, dg, dbeta, d0 = backward.chunk_kda_bwd(dict(saved), tok(), gate_form=gate_form, walk=[dtape, dh0])
        assert [p for p, _ in calls] == ["kda_bwd_chunk", "kda_bwd_gate"] and d0 is dh0
        assert set(calls[0][1]) == {"chunks", "seg_chunks", "w", "kg", "aqk", "gamma", "v", "u", "vnew", "akk_inv",
                                    "beta", "tape", "dout", "dtape", "dv", "drk", "dqg", "dkg", "daqk", "daqk_lo",
                                    "dakk", "daqk_diag", "dbeta_v", "dgam_s"}
        dbeta_out = "dbeta_part" if gate_form.startswith("split") else "dbeta"
        assert set(calls[1][1]) == {"q", "k", "g", "beta", "chunks", "seg_chunks", "daqk", "daqk_lo", "dakk", "daqk_diag",
                                    "dqg", "dkg", "drk", "dbeta_v", "dgam_s", "dq", "dk", "dg", dbeta_out}
        assert dq.shape == dk.shape == dv.shape == (1, T, H, 128) and dbeta.shape == (1, T, H)


def test_the_gate_and_norm_flags_check_before_any_kernel(monkeypatch):
    """On CUDA tensors (fake ones: nothing can run), a wrong-shaped raw gate is named as g's shape, not as its
    parameters', and use_qk_l2norm_in_kernel normalises q and k only after every check, the boundaries'
    values included."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    import kda_aot.ops.chunk_kda as op

    def norm_ran(q, k):
        raise AssertionError("the q, k norm ran before a check")
    monkeypatch.setattr(op, "_qk_l2norm", norm_ran)
    cu, bad_cu = torch.tensor([0, 60, 130]), torch.tensor([3, 60, 130])  # real: the check reads their values
    with FakeTensorMode(allow_non_fake_inputs=True):
        bf = dict(device="cuda", dtype=torch.bfloat16)
        q, v, beta = torch.empty(1, 130, 2, 128, **bf), torch.empty(1, 130, 2, 128, **bf), torch.empty(1, 130, 2, **bf)
        gate = dict(use_gate_in_kernel=True, A_log=torch.empty(2, device="cuda"),
                    dt_bias=torch.empty(256, device="cuda"), cu_seqlens=cu)
        for g in (torch.empty(1, 130, 256, **bf), torch.empty(1, 130, 4, 128, **bf), torch.empty(130, **bf)):
            with pytest.raises(ValueError, match=r"g: expected shape \[1, 130, 2, 128\]"):
                kda_aot.chunk_kda(q, q, v, g, beta, **gate)
        g = torch.empty(1, 130, 2, 128, device="cuda")
        for args, kw, exc, match in [
                ((q.float(), q, v, g, beta), {"cu_seqlens": cu}, TypeError, "q: expected dtype bfloat16"),
                ((q, torch.empty(1, 129, 2, 128, **bf), v, g, beta), {"cu_seqlens": cu}, ValueError, "k: expected shape"),
                ((q, q, v, g, beta), {"cu_seqlens": [0, 60.5, 130]}, TypeError, "cu_seqlens: expected a tensor or a sequence of ints"),
                ((q, q, v, g, beta), {"cu_seqlens": bad_cu}, ValueError, "cu_seqlens: must start at 0"),
        ]:
            with pytest.raises(exc, match=match):
                kda_aot.chunk_kda(*args, use_qk_l2norm_in_kernel=True, **kw)
        with pytest.raises(AssertionError, match="norm ran"):  # every check passed: the norm is next
            kda_aot.chunk_kda(q, q, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)


def test_u_rounding_error_goes_to_the_final_states_that_are_outputs():
    """The forward's u_lo_end (one row per segment) follows the walk's views, narrowed with the segments and
    pieces; end_segment says which last chunks carry it: every segment's (one GPU) or the listed ones (context
    parallelism: the fragments that end their document here), never a piece's inner end."""
    from kda_aot.schedule.kda import piece_view, segments_view
    lo = torch.arange(4).view(4, 1)
    prepared = {"seg_chunks": torch.tensor([0, 1, 5, 6, 9]), "chain_lengths": (1, 4, 1, 3), "u_lo_end": lo}
    assert segments_view(prepared, 1, 3)["u_lo_end"].flatten().tolist() == [1, 2]
    bounds = (1, 3, 5)  # segment 1 in two pieces: piece 0 ends at chunk 2 (no segment's end), beside the chunk
    chunks = torch.tensor(bounds)  # stage of piece 1, which writes the segment's row: it is not handed the tensor
    assert "u_lo_end" not in piece_view(prepared, 1, chunks, bounds, 0)
    assert piece_view(prepared, 1, chunks, bounds, 1)["u_lo_end"].flatten().tolist() == [1]
    assert "u_lo_end" not in segments_view({k: v for k, v in prepared.items() if k != "u_lo_end"}, 0, 2)
    tables = pack_tables(torch.tensor([0, 1, 65, 130, 259]), 259, DEV)
    assert tables.end_segment.cpu().tolist() == tables.end_segment_of((0, 1, 2, 3)).cpu().tolist()
    assert tables.end_segment_of((1, 3)).cpu().tolist() == [-1, 1, -1, -1, -1, -1, 3]
    assert tables.end_segment_of((1, 3)) is tables.end_segment_of((1, 3))  # made once per segment set
    assert tables.end_segment_of(()).cpu().tolist() == [-1] * 7
