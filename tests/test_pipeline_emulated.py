"""The launch bookkeeping of the replay orders, emulated on the CPU: every kernel is replaced by a
small CPU stand-in with the same data flow (chunk-parallel programs compute per chunk row of the
table they are given, the walks carry a state along each segment they are given, forwards and
backwards). The stand-ins run in launch order, which checks which chunk ranges, segments and tensors each
launch gets: every order must give the same bits (the plain replay, the pipelined replay and the saved mode;
with mixed walk plans too; outputs start as NaN, so a chunk no launch covers shows). The streams carry vector
clocks instead, and every launch is held to having waited for the earlier launches that wrote what it reads
or touched what it writes (_Ordering, over byte ranges): the orders the GPU may run them in, which launch
order hides (test_the_ordering_check_sees_a_missing_wait shows it failing)."""
import contextlib
import itertools
from types import SimpleNamespace

import pytest
import torch

from conftest import generator
from kda_aot.schedule import backward, fit, kda, plan


def _rows(t):
    return [(int(a), int(b)) for a, b in t["chunks"].tolist()]


def _fwd_chunk(t):
    for c, (t0, t1) in enumerate(_rows(t)):
        sl = slice(t0, t1)
        k, v, q = (t[n][0, sl].float() for n in ("k", "v", "q"))
        t["w"][0, sl] = (k * 2 + t["beta"][0, sl, :, None].float()).to(t["w"].dtype)
        t["u"][0, sl] = (v + 1).to(t["u"].dtype)
        t["qg"][0, sl] = (q * 3).to(t["qg"].dtype)
        t["kg"][0, sl] = (k - 1).to(t["kg"].dtype)
        t["aqk"][0, sl] = float(t1 - t0)
        t["aqk_diag_lo"][0, sl] = (q.sum(-1) * 1e-3).to(t["aqk_diag_lo"].dtype)
        if t.get("akk_inv") is not None:
            t["akk_inv"][0, sl] = (k[..., :64] * 0.25).to(t["akk_inv"].dtype)  # from the data, not the position
        t["gamma"][c] = t["g"][0, sl].sum(0)
        if t.get("u_lo_end") is not None and int(t["end_segment"][c]) >= 0:  # a segment's last chunk
            t["u_lo_end"][int(t["end_segment"][c]), :t1 - t0] = (v * 1e-2).to(t["u_lo_end"].dtype)


def _segments(t):
    s = t["seg_chunks"].tolist()
    return list(zip(s, s[1:]))


def _fwd_walk(t):
    rows = _rows(t)
    for s, (a, b) in enumerate(_segments(t)):
        S = t["initial_state"][s].clone() if t.get("initial_state") is not None else torch.zeros(t["gamma"].shape[1:] + (128,))
        for c in range(a, b):
            t0, t1 = rows[c]
            if t.get("tape") is not None:
                t["tape"][c] = S
            if t.get("vnew") is not None:
                t["vnew"][0, t0:t1] = (t["u"][0, t0:t1].float() - S.mean(-1)).to(t["vnew"].dtype)
            if t.get("o") is not None:
                t["o"][0, t0:t1] = (t["qg"][0, t0:t1].float() + S.mean(-2)
                                    + t["aqk_diag_lo"][0, t0:t1, :, None]).to(t["o"].dtype)
            S = 0.9 * S + 1e-3 * t["gamma"][c][..., None] + 1e-3 * t["w"][0, t0:t1].float().sum(0)[..., None]
        if t.get("final_state") is not None:
            if t.get("u_lo_end") is not None and b > a and int(t["end_segment"][b - 1]) >= 0:  # Kg^T of the last
                # chunk's U rounding error, where that chunk ends a segment whose final state is an output
                t0, t1 = rows[b - 1]
                S = S + torch.einsum("thk,thv->hkv", t["kg"][0, t0:t1].float(), t["u_lo_end"][s, :t1 - t0].float())
            t["final_state"][s] = S


def _bwd_walk(t):
    rows = _rows(t)
    for s, (a, b) in enumerate(_segments(t)):
        dS = t["dfinal_state"][s].clone() if t.get("dfinal_state") is not None else torch.zeros(t["gamma"].shape[1:] + (128,))
        for c in reversed(range(a, b)):
            t0, t1 = rows[c]
            if t.get("dtape") is not None:
                t["dtape"][c] = dS
            dS = 0.8 * dS + 1e-3 * t["dout"][0, t0:t1].float().sum(0)[..., None] + 1e-3 * t["qg"][0, t0:t1].float().sum(0)[:, None, :]
        if t.get("dinitial_state") is not None:
            t["dinitial_state"][s] = dS


def _bwd_chunk(t):
    for c, (t0, t1) in enumerate(_rows(t)):
        sl = slice(t0, t1)
        base = t["dtape"][c].mean(-1) + t["tape"][c].mean(-1)  # [H, 128]
        t["dv"][0, sl] = (t["dout"][0, sl].float() + base + t["vnew"][0, sl].float()).to(t["dv"].dtype)
        for name in ("drk", "dqg", "dkg"):
            t[name][0, sl] = (t["kg"][0, sl].float() * 0.5 + base).to(t[name].dtype)
        t["daqk"][0, sl] = (t["aqk"][0, sl].float() + 1).to(t["daqk"].dtype)
        t["daqk_lo"][0, sl] = (t["aqk"][0, sl].float() * 1e-3).to(t["daqk_lo"].dtype)
        t["daqk_diag"][0, sl] = t["aqk"][0, sl].float().mean(-1)
        t["dakk"][0, sl] = (t["akk_inv"][0, sl].float() - 1).to(t["dakk"].dtype)
        t["dbeta_v"][0, sl] = t["u"][0, sl].float().mean(-1)
        t["dgam_s"][c] = base + t["gamma"][c]


def _gate(t):
    for c, (t0, t1) in enumerate(_rows(t)):
        sl = slice(t0, t1)
        t["dq"][0, sl] = (t["dqg"][0, sl].float() + t["dgam_s"][c]
                          + t["daqk_lo"][0, sl].float().mean(-1, keepdim=True)).to(t["dq"].dtype)
        t["dk"][0, sl] = (t["dkg"][0, sl].float() + t["drk"][0, sl].float()).to(t["dk"].dtype)
        t["dg"][0, sl] = (t["g"][0, sl] + t["dgam_s"][c] + t["daqk"][0, sl].float().mean(-1, keepdim=True)
                          + t["daqk_diag"][0, sl, :, None])
        if "dbeta_part" in t:
            t["dbeta_part"][0, sl] = t["dakk"][0, sl].float().mean(-1)
            t["dbeta_part"][1, sl] = t["beta"][0, sl].float()
        else:
            t["dbeta"][0, sl] = t["dakk"][0, sl].float().mean(-1) + t["beta"][0, sl].float() + t["dbeta_v"][0, sl]


_PROGRAMS = {"kda_fwd_chunk": _fwd_chunk, "kda_fwd_walk": _fwd_walk, "kda_bwd_walk": _bwd_walk,
             "kda_bwd_chunk": _bwd_chunk, "kda_bwd_gate": _gate}


# What each program's kernel reads and writes (as the stand-ins above use them): the ordering check below
# holds every launch to having waited for the launches that wrote what it reads, and for those that read or
# wrote what it writes.
_READS = {"kda_fwd_chunk": ("q", "k", "v", "g", "beta"),
          "kda_fwd_walk": ("w", "u", "qg", "kg", "aqk", "aqk_diag_lo", "gamma", "initial_state", "u_lo_end"),
          "kda_bwd_walk": ("dout", "w", "qg", "kg", "aqk", "gamma", "dfinal_state"),
          "kda_bwd_chunk": ("dtape", "tape", "dout", "vnew", "kg", "aqk", "akk_inv", "u", "v", "w", "beta", "gamma"),
          "kda_bwd_gate": ("dqg", "dkg", "drk", "daqk", "daqk_lo", "daqk_diag", "dakk", "dbeta_v", "dgam_s", "q", "k",
                           "g", "beta")}
_WRITES = {"kda_fwd_chunk": ("w", "u", "qg", "kg", "aqk", "aqk_diag_lo", "akk_inv", "gamma", "u_lo_end"),
           "kda_fwd_walk": ("tape", "vnew", "o", "final_state"),
           "kda_bwd_walk": ("dtape", "dinitial_state"),
           "kda_bwd_chunk": ("dv", "drk", "dqg", "dkg", "daqk", "daqk_lo", "dakk", "daqk_diag", "dbeta_v", "dgam_s"),
           "kda_bwd_gate": ("dq", "dk", "dg", "dbeta", "dbeta_part", "ddt_bias_part", "da_log_part")}
_WALKS = ("kda_fwd_walk", "kda_bwd_walk")
_CHUNK_ROWS = ("gamma", "tape", "dtape", "dgam_s", "ddt_bias_part", "da_log_part")


class _Stream:
    """A stream with a vector clock: launches are numbered; waiting on a stream or an event takes its clock."""
    ids = itertools.count(1)

    def __init__(self):
        self.id, self.launched, self.clock = next(_Stream.ids), 0, {}
        self.cuda_stream = self

    def now(self) -> dict:
        return {**self.clock, self.id: self.launched}

    def wait_stream(self, other):
        self.wait_event(other.now())

    def record_event(self):
        return self.now()

    def wait_event(self, event):
        assert event is not None
        for sid, n in event.items():
            self.clock[sid] = max(self.clock.get(sid, 0), n)


class _Ordering:
    """Every launch's byte ranges read and written, and the check that each launch has waited (in the
    streams' clocks) for every earlier launch that wrote what it touches or read what it writes: what the
    GPU may reorder, which the stand-ins running in launch order would hide."""

    def __init__(self):
        self.current = [_Stream()]
        self.history = []  # (lo, hi, writes, (stream id, launch), label, tensor kept alive: no address reuse)

    def launch(self, program, desc, stream):
        stream.launched += 1
        me = (stream.id, stream.launched)
        chunks = desc["chunks"]
        if program in _WALKS:  # whole tables; the walk covers chunks [seg_chunks[0], seg_chunks[-1])
            c0, c1 = int(desc["seg_chunks"][0]), int(desc["seg_chunks"][-1])
            rows = [(c0, c1)] if c1 > c0 else []
            tokens = (int(chunks[c0][0]), int(chunks[c1 - 1][1])) if rows else None
        else:  # chunk-indexed tensors narrowed to the launch's chunks
            rows = None
            tokens = (int(chunks[0][0]), int(chunks[-1][1])) if chunks.shape[0] else None
        # the segments whose last chunk a chunk-parallel launch holds (its rows of u_lo_end)
        ends = None if rows is not None or desc.get("end_segment") is None else \
            [int(s) for s in desc["end_segment"].tolist() if s >= 0]
        touched = []
        for writes, names in ((False, _READS[program]), (True, _WRITES[program])):
            for name in names:
                x = desc.get(name)
                if isinstance(x, torch.Tensor) and x.numel() and tokens is not None:
                    touched += [(lo, hi, writes, name, x) for lo, hi in self._ranges(name, x, rows, tokens, ends)]
        self._check(program, stream, me, touched)

    def touch(self, what, reads=(), writes=()):
        """Work other than a kernel launch on the current stream (the CP exchange, the caller reading a
        forward's outputs), held to the same check: reads / writes are tensors, whole (views narrow them)."""
        stream = self.current[-1]
        stream.launched += 1
        me = (stream.id, stream.launched)
        touched = [(x.data_ptr(), x.data_ptr() + x.numel() * x.element_size(), writes_, "it", x)
                   for writes_, xs in ((False, reads), (True, writes)) for x in xs if x is not None and x.numel()]
        self._check(what, stream, me, touched)

    def _check(self, program, stream, me, touched):
        for lo, hi, writes, name, x in touched:
            for plo, phi, pwrites, op, label, _ in self.history:
                if lo < phi and plo < hi and (writes or pwrites):
                    sid, n = op
                    assert sid == stream.id or stream.clock.get(sid, 0) >= n, (
                        f"{program} {'writes' if writes else 'reads'} {name} without waiting for {label}")
        self.history += [(lo, hi, writes, me, f"{program}'s {'write' if writes else 'read'} of {name}", x)
                         for lo, hi, writes, name, x in touched]

    @staticmethod
    def _ranges(name, x, rows, tokens, ends=None):
        es, ptr = x.element_size(), x.data_ptr()
        if name == "u_lo_end" and ends is not None:  # a chunk-parallel launch: its segments' rows
            return [(ptr + s * x.stride(0) * es, ptr + (s + 1) * x.stride(0) * es) for s in ends]
        if name in _CHUNK_ROWS:
            if rows is None:  # narrowed to the launch's chunks
                return [(ptr, ptr + x.numel() * es)]
            return [(ptr + a * x.stride(0) * es, ptr + b * x.stride(0) * es) for a, b in rows]
        if name in kda._PER_SEGMENT:  # narrowed to the launch's segments
            return [(ptr, ptr + x.numel() * es)]
        t0, t1 = tokens  # token-indexed [P, T, ...]: the launch's tokens in every plane
        return [(ptr + (p * x.stride(0) + t0 * x.stride(1)) * es, ptr + (p * x.stride(0) + t1 * x.stride(1)) * es)
                for p in range(x.shape[0])]


class _Library:
    def __init__(self, program, ordering):
        self.program, self.ordering = program, ordering

    def launch(self, desc, scale, stream):
        # what the bindings check: chunk-indexed tensors one row per chunk of the table, segment-
        # indexed ones one row per segment
        C, N = desc["chunks"].shape[0], desc["seg_chunks"].shape[0] - 1
        for name in kda._PER_CHUNK:
            assert desc.get(name) is None or desc[name].shape[0] == C, (self.program, name)
        for name in kda._PER_SEGMENT:
            assert desc.get(name) is None or desc[name].shape[0] == N, (self.program, name)
        self.ordering.launch(self.program, desc, stream)
        _PROGRAMS[self.program]({name: x for name, x in desc.items()})


@pytest.fixture
def emulated(monkeypatch):
    """kda's kernels, streams and SM count replaced for the CPU (descriptors are the tensors); the streams
    carry clocks and every launch is checked against what it reads and writes (_Ordering). Returns it."""
    order, pools = _Ordering(), {}

    def side_streams(device, n, pool):  # one pool per user, kept as kda keeps them
        have = pools.setdefault(pool, [])
        while len(have) < n:
            have.append(_Stream())
        return have[:n]

    @contextlib.contextmanager
    def on(stream):
        order.current.append(stream)
        try:
            yield
        finally:
            order.current.pop()
    monkeypatch.setattr(kda, "describe", lambda x, name: x)
    monkeypatch.setattr(kda, "stream_of", lambda x: order.current[-1])
    monkeypatch.setattr(kda.registry, "library", lambda program, form="default", device=None: _Library(program, order))
    monkeypatch.setattr(kda, "device_sms", lambda device: 132)
    monkeypatch.setattr(kda, "_on_gpu", lambda x: True)  # the pipelined orders on the CPU stand-ins
    monkeypatch.setattr(kda, "_side_streams", side_streams)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: order.current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    plan.cache_clear()
    return order


def _inputs(lens, H, tag):
    gen = generator(tag)
    T = sum(lens)
    q, k, v = (torch.randn(1, T, H, 128, generator=gen).to(torch.bfloat16) for _ in range(3))
    g = -torch.rand(1, T, H, 128, generator=gen)
    beta = torch.rand(1, T, H, generator=gen).to(torch.bfloat16)
    h0 = torch.randn(len(lens), H, 128, 128, generator=gen)
    do = torch.randn(1, T, H, 128, generator=gen).to(torch.bfloat16)
    dht = torch.randn(len(lens), H, 128, 128, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, cu, h0, do, dht


def _nan_empty(monkeypatch):
    """torch.empty / empty_like give NaN-filled tensors: a row no launch writes stays NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(x):
        return x.fill_(float("nan")) if x.is_floating_point() else x
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: nan(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: nan(empty_like(*a, **kw)))


@pytest.mark.parametrize("lens", [[700], [300, 129], [1, 63, 64, 65, 130, 2], [40] * 30 + [900, 5]],
                         ids=["1", "2", "6", "32"])
@pytest.mark.parametrize("gate_form", ["split_staged", "full"])
@pytest.mark.parametrize("mixed", [False, True])
def test_every_replay_order_gives_the_same_bits(kda_options, emulated, monkeypatch, lens, gate_form, mixed):
    if mixed:  # a mixed walk plan on every walk launch of more than one segment (side streams, narrowed rows)
        monkeypatch.setattr(fit, "plan_walk", lambda program, lengths, *a, **kw: (
            (("split", 0, 1), ("full", 1, len(lengths))) if len(lengths) > 1 else (("full", 0, 1),)))
    _nan_empty(monkeypatch)
    kda_options(gate_form=gate_form)
    q, k, v, g, beta, cu, h0, do, dht = _inputs(lens, 2, ("replay-orders", tuple(lens)))
    got = {}
    for name, pipeline in (("plain", "0"), ("pipelined", "1")):
        kda_options(pipeline=pipeline == "1")
        got[name] = backward._replay_step(q, k, v, g, beta, h0, cu, 0.1, do, dht)
    _, _, saved = kda.chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, scale=0.1, initial_state=h0, save_tape=True,
                                    pipeline=False)
    got["saved"] = backward.chunk_kda_bwd(saved, do, dht, release=True)
    for name, grads in got.items():
        for label, x, y in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got["plain"], grads):
            assert not torch.isnan(y).any(), f"{name} {label}: rows no launch wrote"
            assert torch.equal(x, y), f"{name} {label}"


@pytest.mark.parametrize("lens", [[40] * 30 + [900, 5], [64 * 60, 64 * 50 + 3, 64 * 40, 64 * 33 - 1], [3000, 2200]],
                         ids=["32", "4-last-in-pieces", "2-last-in-pieces"])
def test_pipelined_forward_gives_the_plain_bits(emulated, monkeypatch, lens):
    """The pipelined forward, the last group's segment cut in pieces (grouping.last_group_pieces; each
    piece's walk starts from the end state of the one before), gives the plain order's bits."""
    _nan_empty(monkeypatch)
    q, k, v, g, beta, cu, h0, _, _ = _inputs(lens, 2, ("pipelined-forward", tuple(lens)))
    a = kda.chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                          save_tape=True, pipeline=False)
    b = kda.chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                          save_tape=True, pipeline=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.isnan(b[0]).any()
    for name in ("tape", "vnew", "w", "u", "qg", "kg", "aqk", "akk_inv", "gamma"):
        assert torch.equal(a[2][name], b[2][name]), name
    # the final states took the last chunks' U rounding error (a walk of the same stage without it differs)
    prepared = kda.chunk_kda_prepare(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0)
    bare = kda.chunk_kda_walk(prepared, initial_state=h0, output_final_state=True)[1]
    assert not torch.isnan(bare).any() and not torch.equal(bare, a[1])


@pytest.mark.parametrize("lens,deferred,senders", [([300, 129], [0], [1]), ([1, 63, 64, 65, 130, 2], [0, 3, 4], [1, 5]),
                                                   ([40] * 30 + [900, 5], [], [31]),
                                                   ([40] * 30 + [900, 5], [30], [0, 31]), ([700], [], [0]),
                                                   ([2000, 300], [], [1]), ([300, 2000, 300], [0], [2]),
                                                   ([2000, 300, 500, 40], [1], [0, 3]), ([2000], [], [0])],
                         ids=["2-first", "6-three", "32-none", "32-long", "1-sender", "lead-piece", "pieced-middle",
                              "pieced-sender", "lone-sender-pieced"])
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("beside,piece_senders", [("1", "1"), ("0", "0")], ids=["beside", "main-stream"])
@pytest.mark.parametrize("summarised_of", [lambda d: d, lambda d: d[:1], lambda d: []],
                         ids=["summarised-all", "summarised-first", "summarised-none"])
def test_cp_pipelined_forward_gives_the_plain_bits(emulated, kda_options, monkeypatch, lens, deferred, senders, keep,
                                                   beside, piece_senders, summarised_of):
    """The CUDA CP backend's forward_pipelined (Options.cp_pipeline, the default): the walks of the
    segments with a known entering state beside the chunk stage, the senders' first,
    the exchange's run(prepared, final_state) once the chunk stage is queued (called once, also with nothing
    deferred: the exchange is collective) with the senders' final states already there, the deferred
    segments' walks from what it returns; against prepare() then forward() with the same entering
    states. beside: the exchange and the deferred walks on a stream of their own (cp_exchange_beside), the
    sent chains pieced when they are the longest (pieced-sender, lone-sender-pieced: 32 chunks; 1-sender's
    11 are too few to cut); main-stream: neither (the default order). The exchange's reads (the senders'
    final states, the summarised segments' chunk stage; summarised: all, the first or none of the deferred
    segments) and the caller's of the outputs are held to the ordering check too (_Ordering.touch): without
    any one of the exchange node's waits, or the joins, a test here fails."""
    from kda_aot.cp.backends import CudaBackend
    kda_options(cp_exchange_beside=beside == "1")
    kda_options(cp_piece_senders=piece_senders == "1")
    _nan_empty(monkeypatch)
    q, k, v, g, beta, cu, known, _, later = _inputs(lens, 2, ("cp-pipelined-forward", tuple(lens)))
    backend, bounds = CudaBackend(), cu.tolist()
    states = known.clone()
    states[deferred] = later[deferred]
    summarised = summarised_of(deferred)
    # the segments that end their document here: their final states carry the last chunk's U rounding error
    ends = [s for s in range(len(lens)) if s not in senders and s not in summarised]
    plain = backend.forward(q, k, v, g, beta, bounds, states, 0.1, keep=keep,
                            prepared=backend.prepare(q, k, v, g, beta, bounds, 0.1, keep=keep, final_segments=ends))
    bare = backend.forward(q, k, v, g, beta, bounds, states, 0.1, keep=False)[1]
    others = [s for s in range(len(lens)) if s not in ends]
    assert torch.equal(bare[others], plain[1][others]) and (not ends or not torch.equal(bare[ends], plain[1][ends]))
    calls = []

    def entering(prepared, finals):
        calls.append(finals[senders].clone())  # what the exchange would send
        assert not torch.isnan(prepared["w"]).any()  # every chunk stage is queued (here: run, in launch order)
        # what it reads, held to the ordering check: the senders' final states, the summarised segments'
        # chunk stage (the summaries' walks read W, K e^gamma and gamma of those segments)
        chunks, seg = prepared["chunks"], prepared["seg_chunks"].tolist()
        rows = [(seg[s], seg[s + 1]) for s in summarised if seg[s + 1] > seg[s]]
        emulated.touch("the exchange", reads=[finals[s] for s in senders]
                       + [prepared[n][0, int(chunks[a][0]):int(chunks[b - 1][1])] for a, b in rows for n in ("w", "kg")]
                       + [prepared["gamma"][a:b] for a, b in rows])
        return later[deferred]
    poisoned_known = known.clone()
    poisoned_known[deferred] = float("nan")  # the deferred rows must not be read
    got = backend.forward_pipelined(q, k, v, g, beta, bounds, 0.1, keep, poisoned_known, deferred,
                                    SimpleNamespace(run=entering), senders, summarised, final_segments=ends)
    emulated.touch("the caller", reads=[got[0], got[1]] + ([got[2][n] for n in ("tape", "vnew")] if keep else []))
    assert len(calls) == 1 and torch.equal(calls[0], plain[1][senders])
    assert torch.equal(plain[0], got[0]) and torch.equal(plain[1], got[1]) and not torch.isnan(got[1]).any()
    assert (got[2] is None) == (not keep)
    if keep:
        for name in ("tape", "vnew", "w", "u", "qg", "kg", "aqk", "akk_inv", "gamma"):
            assert torch.equal(plain[2][name], got[2][name]), name


@pytest.mark.parametrize("lens,remote", [([300, 129], [0]), ([1, 63, 64, 65, 130, 2], [0, 2, 3]),
                                         ([40] * 30 + [900, 5], [30, 31]), ([40] * 30 + [900, 5], []),
                                         ([300, 2200, 40, 1500], [0]), ([2200, 300], [0]), ([2200], []), ([2200], [0])],
                         ids=["2", "6", "32-long", "32-none", "pieced", "pieced-remote", "lone-pieced", "lone-remote"])
@pytest.mark.parametrize("beside", [False, True], ids=["walk-first", "beside-bwd-chunk"])
@pytest.mark.parametrize("skip", [False, True], ids=["walked", "skip-bwd"])
def test_cp_full_replay_walk_then_rewalk_gives_the_plain_bits(emulated, monkeypatch, lens, remote, beside, skip):
    """The CP replay backward: replay_pipelined (the chunk stage and both walks pipelined, the backward
    walk in full from the exit-state gradients known locally: zero for the `remote` segments), D from
    it; then backward(walk=, rewalk=): the remote segments walked again with their true gradients,
    first or beside kda_bwd_chunk over the others' chunks (fit.rewalk_beside; both forced here: in
    launch order, so a kda_bwd_chunk launch over a remote segment before its walk fails). Against
    prepare(), replay() (D from the offset walk) then backward() with the true gradients: the saved
    context, D and every gradient bitwise. skip: the remote segments' first backward walk left out
    (replay_pipelined(skip_bwd=): what the CP op does for fragments whose D nobody wants; their rows
    stay NaN-poisoned, so a gradient that read them fails). `pieced`: a 35-chunk chain walked in pieces
    (grouping.pieced_group), both walks through them from their ends; `pieced-remote`: that chain remote."""
    monkeypatch.setattr(fit, "rewalk_beside", lambda lengths, rewalk, heads, sms: heads * len(rewalk) if beside else None)
    from kda_aot.cp.backends import CudaBackend
    _nan_empty(monkeypatch)
    q, k, v, g, beta, cu, h0, do, true = _inputs(lens, 2, ("cp-rewalk", tuple(lens)))
    backend, bounds = CudaBackend(), cu.tolist()
    known = true.clone()
    known[remote] = 0
    ctx_a, d_a = backend.replay(backend.prepare(q, k, v, g, beta, bounds, 0.1, keep=True), h0, do, known)
    grads_a = backend.backward(ctx_a, do, true)
    ctx_b, walk = backend.replay_pipelined(q, k, v, g, beta, bounds, 0.1, h0, do, known, remote if skip else ())
    walked = [i for i in range(len(lens)) if not (skip and i in remote)]
    assert torch.equal(walk[1][walked], d_a[walked])
    for name in ("tape", "vnew", "w", "u", "qg", "kg", "aqk", "akk_inv", "gamma", "chunks", "seg_chunks"):
        assert not ctx_b[name].is_floating_point() or not torch.isnan(ctx_b[name]).any(), name
        assert torch.equal(ctx_a[name], ctx_b[name]), name
    assert ctx_b["chain_lengths"] == ctx_a["chain_lengths"]
    grads_b = backend.backward(ctx_b, do, true, walk=walk, rewalk=remote)
    for x, y in zip(grads_a, grads_b):
        assert not torch.isnan(y).any() and torch.equal(x, y)


def test_the_ordering_check_sees_a_missing_wait(emulated, monkeypatch):
    """The ordering check can fail. Without the side streams' wait for the current stream, a pipelined walk
    reads its chunk stage's output unwaited; without the current stream's join of the side streams, the
    replay's kda_bwd_chunk reads the walks' tapes unwaited."""
    q, k, v, g, beta, cu, h0, do, dht = _inputs([300, 129, 700], 2, "missing-wait")
    wait = _Stream.wait_stream
    main = emulated.current[0]
    monkeypatch.setattr(_Stream, "wait_stream", lambda self, other: wait(self, other) if self is main else None)
    with pytest.raises(AssertionError, match="kda_fwd_walk reads .* without waiting for kda_fwd_chunk"):
        kda.chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True, pipeline=True)
    monkeypatch.setattr(_Stream, "wait_stream", lambda self, other: None if self is main else wait(self, other))
    with pytest.raises(AssertionError, match="kda_bwd_chunk reads .* without waiting for kda_(fwd|bwd)_walk"):
        backward._replay_step(q, k, v, g, beta, h0, cu, 0.1, do, dht)


def test_a_failing_launch_still_joins_the_side_streams(emulated, monkeypatch):
    """execute.run: when a node raises, the plan's joins after it still run (the current stream waits for
    every side stream, whose queued walks may still read the caller's tensors), then the error goes on."""
    q, k, v, g, beta, cu, h0, _, _ = _inputs([300, 129, 700], 2, "failing-launch")
    walk, calls, sides = kda.chunk_kda_walk, [], set()

    def second_fails(*args, **kwargs):
        calls.append(emulated.current[-1])
        if len(calls) == 2:
            raise RuntimeError("launch failed")
        sides.add(emulated.current[-1])
        return walk(*args, **kwargs)
    monkeypatch.setattr(kda, "chunk_kda_walk", second_fails)
    with pytest.raises(RuntimeError, match="launch failed"):
        kda.chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True, pipeline=True)
    main = emulated.current[0]
    assert len(calls) == 2 and sides and main not in sides
    for side in sides:
        assert main.clock.get(side.id, 0) >= side.launched > 0


def test_a_failing_launch_inside_forked_still_joins(emulated, monkeypatch):
    """kda.forked, the fork and join of the launches planned outside a PipelinePlan (here the replay's two walks):
    when a launch inside raises, the current stream still waits for the side stream, whose walk may still read
    the caller's tensors, and the error goes on."""
    q, k, v, g, beta, cu, h0, do, dht = _inputs([300, 129, 700], 2, "forked-join")
    prepared = kda.chunk_kda_prepare(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, save_tape=True)

    def fails(*args, **kwargs):
        raise RuntimeError("launch failed")
    monkeypatch.setattr(backward, "chunk_kda_bwd_walk", fails)  # on the current stream, after the side's walk
    with pytest.raises(RuntimeError, match="launch failed"):
        backward.replay_walks(prepared, h0, do, dht)
    main, (side,) = emulated.current[0], kda._side_streams(None, 1, "replay")
    assert side.launched > 0 and main.clock.get(side.id, 0) >= side.launched


def test_a_failing_launch_joins_only_the_streams_it_forked(emulated, monkeypatch):
    """Under CUDA-graph capture the current stream may wait only on streams that waited on it first: the
    error path joins the streams this run forked (the side streams its walks ran on) and no other (the
    CP exchange's, never forked when the failure comes before the exchange node), each join on its own."""
    q, k, v, g, beta, cu, h0, _, _ = _inputs([300, 129, 700, 64], 2, "failing-launch-forked")
    waited, joined = set(), []
    wait_stream = _Stream.wait_stream

    def recorded(self, other):
        if self is emulated.current[0]:
            joined.append(other)
        else:
            waited.add(self)
        wait_stream(self, other)
    monkeypatch.setattr(_Stream, "wait_stream", recorded)

    def first_fails(*args, **kwargs):
        raise RuntimeError("launch failed")
    monkeypatch.setattr(kda, "chunk_kda_walk", first_fails)
    exchange = SimpleNamespace(run=lambda prepared, final_state: pytest.fail("the exchange ran after a failure"))
    with pytest.raises(RuntimeError, match="launch failed"):
        kda.chunk_kda_fwd_deferred(q, k, v, g, beta, cu_seqlens=cu, scale=None, initial_state=h0, deferred=[1, 3],
                                   exchange=exchange, save_tape=False, exchange_beside=True)
    assert joined and all(s in waited for s in joined)


def test_a_call_names_every_buffer_its_plan_reads():
    """A node's Rows name a buffer of the call: None where the call has none (no initial state), an error
    where the call lacks the name (a piece walked from zeros would be wrong bits, not an error)."""
    from kda_aot.schedule import execute
    call = execute.Call(prepared={}, buffers={"initial_state": None, "handoff": torch.arange(6.0).view(3, 2)},
                        outputs={})
    assert call.rows(None) is None
    assert call.rows(plan.Rows("initial_state", 0, 1)) is None
    assert call.rows(plan.Rows("handoff", 1, 2)).tolist() == [[2.0, 3.0]]
    with pytest.raises(KeyError):
        call.rows(plan.Rows("fwd_handoff", 0, 1))


@pytest.mark.parametrize("lens", [[300, 129], [1, 63, 64, 65, 130, 2], [40] * 30 + [900, 5]], ids=["2", "6", "32"])
@pytest.mark.parametrize("dh0", [True, False])
def test_replay_in_tiles_gives_the_one_pass_bits(kda_options, emulated, monkeypatch, lens, dh0):
    """replay_backward a tile at a time against one pass: runs of whole segments over every head (views of
    contiguous token ranges, gradients written in place), head groups over the whole pack and over runs (copies),
    and, from memory alone, the longest segment in head groups beside runs of the others; outputs start as NaN,
    so a row no tile wrote shows."""
    _nan_empty(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    q, k, v, g, beta, cu, h0, do, dht = _inputs(lens, 4, ("replay-tiles", tuple(lens)))
    if not dh0:
        h0 = dht = None
    monkeypatch.setattr(backward, "_available_bytes", lambda device: 1 << 50)
    one = backward.replay_backward(q, k, v, g, beta, h0, cu, 0.1, do, dht)
    step, tile_rule, in_place = backward._replay_step, backward.replay_tiles, []

    def spied(*args):
        got = step(*args)
        if args[-1] is not None:  # a tile over every head: the kernels wrote dq, dk, dv, dg into the gradients
            names = ("dq", "dk", "dv", "dg")
            in_place.append(all(got[i].data_ptr() == args[-1][n].data_ptr() for i, n in enumerate(names)))
        return got
    monkeypatch.setattr(backward, "_replay_step", spied)
    bounds = kda.tables_of(cu, q.shape[1], q.device).bounds
    longest = max(range(len(lens)), key=lambda s: lens[s])

    def short_of_the_longest(bounds, lengths, H, G, available, gradient_bytes, *limits):
        # what is left beside the gradients holds every segment over every head but the longest one
        alone = H * G * backward.replay_bytes_per_head(lens[longest], lengths[longest], 1, grouped=False)
        return tile_rule(bounds, lengths, H, G, gradient_bytes + alone - 1, gradient_bytes, *limits)
    for arm in ({"max_tokens": 130}, {"max_tokens": 1}, {"max_heads": 1}, {"max_heads": 3},
                {"max_tokens": 130, "max_heads": 3}, {"memory": "short of the longest segment"}):
        kda_options(max_tokens=0, max_heads=0)
        if "memory" in arm:
            monkeypatch.setattr(backward, "replay_tiles", short_of_the_longest)
        else:
            kda_options(**arm)
        got = backward.replay_backward(q, k, v, g, beta, h0, cu, 0.1, do, dht)
        tiles = list(backward._LAST_TILES.values())[-1]
        every = [hb - ha == 4 for _, _, ha, hb in tiles]
        assert len(tiles) > 1 and sorted(tiles) == tiles and tiles[-1][1] == len(bounds) - 1, (arm, tiles)
        if "memory" in arm:  # the longest segment alone in head groups, every other one in runs over every head
            assert all(e == (a != longest) for (a, b, _, _), e in zip(tiles, every)), tiles
            assert all(b == a + 1 for a, b, _, _ in tiles if a == longest), tiles
        else:
            assert all(every) == ("max_heads" not in arm), (arm, tiles)
        assert in_place == [True] * sum(every), in_place
        in_place.clear()
        for label, x, y in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), one, got):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (arm, label)
    kda_options(max_tokens=0, max_heads=0)
