"""The CP forward's stream ordering, checked on the CPU: the kernels are the CPU stand-ins of
test_pipeline_emulated (they run in launch order), and every stream and event carries its vector clock
(test_pipeline_emulated._Stream: which launch of which stream it has waited for), so each launch can be
checked against what it
reads: a walk after the chunk stage of its tokens and after the walk that wrote the state it starts
from (the pieces' handoffs), the exchange (entering) after the senders' walks and the chunk stage of
the deferred segments it summarises, the current stream after everything once the forward returns. The GPU tests
check the bits; these check the order the GPU may run things in, which a lucky schedule hides."""
import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

import test_pipeline_emulated as emu
from kda_aot.schedule import fit, kda, plan


def _after(stream, op, what):
    """op = (stream id, launch number) must happen before what `stream` launches next."""
    assert op is not None, f"{what}: nothing wrote it"
    sid, n = op
    assert sid == stream.id or stream.clock.get(sid, 0) >= n, what


class _World:
    def __init__(self):
        self.current = [emu._Stream()]
        self.token_writer, self.state_writer = {}, {}  # token -> chunk stage launch; state row ptr -> walk

    def launch(self, program, desc, stream):
        stream.launched += 1
        me = (stream.id, stream.launched)
        rows = emu._rows(desc)
        if program == "kda_fwd_chunk":
            for t0, t1 in rows:
                for t in range(t0, t1):
                    self.token_writer[t] = me
        elif program == "kda_fwd_walk":
            for a, b in emu._segments(desc):
                for c in range(a, b):
                    for t in (rows[c][0], rows[c][1] - 1):
                        _after(stream, self.token_writer.get(t), f"a walk reads token {t} before its chunk stage")
            h0 = desc.get("initial_state")
            for s in range(0 if h0 is None else h0.shape[0]):
                if h0[s].data_ptr() in self.state_writer:
                    _after(stream, self.state_writer[h0[s].data_ptr()], "a walk starts from a state not yet written")
            fs = desc.get("final_state")
            for s in range(0 if fs is None else fs.shape[0]):
                self.state_writer[fs[s].data_ptr()] = me
        emu._PROGRAMS[program]({name: x for name, x in desc.items()})


@pytest.fixture
def world(monkeypatch):
    w, pools = _World(), {}

    class Library:
        def __init__(self, program):
            self.program = program

        def launch(self, desc, scale, stream):
            w.launch(self.program, desc, stream)

    def side_streams(device, n, pool):
        have = pools.setdefault(pool, [])
        while len(have) < n:
            have.append(emu._Stream())
        return have[:n]

    @contextlib.contextmanager
    def on(stream):
        w.current.append(stream)
        try:
            yield
        finally:
            w.current.pop()
    monkeypatch.setattr(kda, "describe", lambda x, name: x)
    monkeypatch.setattr(kda, "stream_of", lambda x: w.current[-1])
    monkeypatch.setattr(kda.registry, "library", lambda program, form="default", device=None: Library(program))
    monkeypatch.setattr(kda, "device_sms", lambda device: 132)
    monkeypatch.setattr(kda, "_on_gpu", lambda x: True)
    monkeypatch.setattr(kda, "_side_streams", side_streams)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: w.current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    fit.pipelined_walk_sms.cache_clear()
    plan.cache_clear()
    return w


# (lengths, deferred, senders, summarised: the deferred segments whose chunk stage entering reads)
CASES = [([300, 129], [0], [1], [0]), ([1, 63, 64, 65, 130, 2], [0, 3, 4], [1, 5], [0, 3, 4]),
         ([40] * 30 + [900, 5], [30], [0, 31], [30]), ([2000], [], [0], []), ([2000, 300], [], [1], []),
         ([300, 2000, 300], [0], [2], [0]), ([2000, 300, 500, 40], [1], [0, 3], [1]),
         ([500, 2000, 300, 700, 1280], [0, 3], [4], [0, 3]), ([192] * 6 + [2000], [2, 5], [0], [2, 5]),
         ([2000, 320, 2560], [0], [1], [0]), ([700, 300], [], [], []),
         ([25, 800, 6400, 1200], [0], [3], []), ([300, 2000, 300, 700], [0, 3], [2], [3])]
IDS = ["2", "6", "32-long", "lone-sender", "lead-piece", "pieced-middle", "pieced-sender", "deferred-late",
       "deferred-groups", "deferred-first", "nothing-sent", "unsummarised-last", "summarised-some"]


@pytest.mark.parametrize("lens,deferred,senders,summarised", CASES, ids=IDS)
@pytest.mark.parametrize("beside", ["1", "0"], ids=["beside", "main-stream"])
def test_cp_forward_waits_for_what_it_reads(world, kda_options, lens, deferred, senders, summarised, beside):
    kda_options(cp_exchange_beside=beside == "1")
    kda_options(cp_piece_senders=True)  # the sent chains in pieces too: their lead order
    _forward_checked(world, lens, deferred, senders, summarised, beside == "1")


def _forward_checked(world, lens, deferred, senders, summarised, beside):
    """The CP forward under the clocks: every read checked (_World, the exchange's reads, the caller's)."""
    from kda_aot.cp.backends import CudaBackend
    main = world.current[0]
    main.launched = 1
    earlier = (main.id, 1)  # an earlier launch on the current stream (e.g. a collective)
    q, k, v, g, beta, cu, known, _, later = emu._inputs(lens, 2, 7)
    bounds = cu.tolist()
    calls = []

    def entering(prepared, finals):
        here = world.current[-1]
        calls.append(here)
        _after(here, earlier, "the exchange may run before what came before the forward")
        for s in senders:
            _after(here, world.state_writer.get(finals[s].data_ptr()), f"the exchange reads sender {s} early")
        for s in summarised:
            for t in range(bounds[s], bounds[s + 1]):
                _after(here, world.token_writer.get(t), f"a summary reads deferred segment {s}'s token {t} early")
        here.launched += 1  # what it makes (the states, what the caller keeps of it) is made on its stream
        world.state_writer["the exchange"] = (here.id, here.launched)
        return later[deferred]
    CudaBackend().forward_pipelined(q, k, v, g, beta, bounds, 0.1, True, known.clone(), deferred,
                                    SimpleNamespace(run=entering), senders, summarised)
    assert len(calls) == 1 and (calls[0] is main) == (not beside)
    for op in set(world.token_writer.values()) | set(world.state_writer.values()):
        _after(main, op, "the forward returns before a launch it made is joined")


def _clocks(nodes) -> list:
    """Each launch's vector clock (streams by name) when the nodes run, and the current stream's at the end,
    which the caller reads from: what the nodes order. The current stream holds one launch before them."""
    from kda_aot.schedule.plan import MAIN, ChunkStage, Record, RunExchange, Wait, WaitEvent, Walk
    launched, clock, events, seen = {MAIN: 1}, {}, {}, []

    def now(s):
        return {**clock.get(s, {}), s: launched.get(s, 0)}

    def wait(s, other):
        mine = clock.setdefault(s, {})
        for k, v in other.items():
            mine[k] = max(mine.get(k, 0), v)
    for node in nodes:
        if isinstance(node, (ChunkStage, Walk, RunExchange)):
            s = MAIN if isinstance(node, ChunkStage) else node.stream
            launched[s] = launched.get(s, 0) + 1
            seen.append(now(s))
        elif isinstance(node, Wait):
            wait(node.stream, now(node.on))
        elif isinstance(node, Record):
            events[node.event] = now(MAIN)
        elif isinstance(node, WaitEvent):
            wait(node.stream, events[node.event])
    return [{s: n for s, n in c.items() if n} for c in seen + [now(MAIN)]]


def _live_waits(plan) -> list:
    """The indices of the plan's waits that order something: without one, some launch (or the caller, after
    the current stream) would not be after what it is after with it."""
    from kda_aot.schedule.plan import Wait, WaitEvent
    every = _clocks(plan.nodes)
    return [i for i, node in enumerate(plan.nodes) if isinstance(node, (Wait, WaitEvent))
            and _clocks(plan.nodes[:i] + plan.nodes[i + 1:]) != every]


@pytest.mark.parametrize("lens,deferred,senders,summarised", [CASES[i] for i in (1, 5, 8, 10, 12)],
                         ids=[IDS[i] for i in (1, 5, 8, 10, 12)])
@pytest.mark.parametrize("beside", [True, False], ids=["beside", "main-stream"])
def test_every_wait_of_the_cp_forward_plan_is_needed(world, kda_options, monkeypatch, lens, deferred, senders,
                                                    summarised, beside):
    """The plan's waits are data: each one that orders something, taken out of the plan, makes a check fail."""
    kda_options(cp_exchange_beside=beside, cp_piece_senders=True)
    chains = [-(-n // 64) for n in lens]
    plan = kda.forward_plan(chains, 2, 132, first=senders, deferred=deferred, cp=True, summarised=summarised,
                            exchange_beside=beside)
    live = _live_waits(plan)
    assert len(live) >= len(plan.groups)
    for i in live:
        cut = dataclasses.replace(plan, nodes=plan.nodes[:i] + plan.nodes[i + 1:])
        monkeypatch.setattr(kda, "forward_plan", lambda *a, **kw: cut)
        world.current[:] = [emu._Stream()]
        world.token_writer.clear()
        world.state_writer.clear()
        with pytest.raises(AssertionError):
            _forward_checked(world, lens, deferred, senders, summarised, beside)
