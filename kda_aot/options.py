"""Options of the launch path: which forms and orders the ops run.

The shipped choice of every option is its default. Benchmarks and tests pass other values with
`using(Options(...))` around the calls they make. The options are process-wide, not per thread: the ops
read them when they run, and autograd runs a backward on a thread of its own (a compiled graph called
inside the block sees them too). The package reads no environment for them (kda_aot.fla reads FLA's switches of its backends, at each
dispatch by FLA's rule).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass

WALK_FORMS = ("auto", "full", "split", "quarter")


@dataclass(frozen=True)
class Options:
    # the state walks: "auto" (the fit rule picks per launch) or one form for every walk launch
    walk_form: str = "auto"
    # kda_bwd_gate's form ("": the shipped one; "full" checks its channel split bitwise)
    gate_form: str = ""
    # The orders below are shipped on; each off-setting is the plain order that a bitwise test compares
    # the shipped one with (the test named beside it), so it stays.
    # the chunk stage a segment group at a time beside the walks (False: one launch, then the walks;
    # tests/test_graph_gpu.py, test_kda_fwd_gpu.py)
    pipeline: bool = True
    # the unpipelined replay's (pipeline off, and CP's) forward walks beside its backward walks
    # (test_kda_bwd_gpu.py::test_replay_walks_side_by_side_are_bitwise_the_sequential_replay, test_cp_cuda.py)
    replay_overlap: bool = True
    # at most this many heads per replay-backward group (0: as many as memory holds)
    max_heads: int = 0
    # at most this many tokens per replay-backward group of whole segments, where the segments allow (0: as many
    # as memory holds); tests/test_kda_bwd_gpu.py forces such groups with it
    max_tokens: int = 0
    # context parallelism: the pipelined orders, the summaries batched (test_cp_cuda_ranks.py)
    cp_pipeline: bool = True
    cp_batched_summaries: bool = True
    # context parallelism, off until a two-GPU A/B decides them (docs/cp.md): the exchange beside the walks, and the
    # last group of the senders in pieces
    cp_exchange_beside: bool = False
    cp_piece_senders: bool = False
    # record the CP phases' device times (kda_aot.cp.phase_times)
    debug_timing: bool = False

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value, kind = getattr(self, field.name), _TYPES[field.type]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise TypeError(f"kda_aot Options: {field.name} must be of type {field.type}, got {value!r}")
        if self.walk_form not in WALK_FORMS:
            raise ValueError(f"kda_aot Options: walk_form must be one of {WALK_FORMS}, got {self.walk_form!r}")
        for name in ("max_heads", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"kda_aot Options: {name} must be an int >= 0, got {value!r}")

    def replace(self, **changes) -> "Options":
        return dataclasses.replace(self, **changes)


_TYPES = {"str": str, "bool": bool, "int": int}


def parse(text: str) -> Options:
    """Options from `name=value,name=value` (booleans as 0/1, true/false)."""
    fields = {f.name: f.type for f in dataclasses.fields(Options)}
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or name not in fields:
            raise ValueError(f"kda_aot options {text!r}: {item!r} is not name=value for one of {sorted(fields)}")
        kind = fields[name]
        if kind == "bool":
            if value.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"kda_aot options: {name} takes 0/1 or true/false, got {value!r}")
            values[name] = value.lower() in ("1", "true")
        elif kind == "int":
            values[name] = int(value)
        else:
            values[name] = value
    return Options(**values)


DEFAULT = Options()
_current = DEFAULT
_lock = threading.Lock()


def current() -> Options:
    """The options in force for this call."""
    return _current


def swap(options: Options) -> Options:
    """Make `options` current; returns the ones it replaced (for a caller that restores them itself)."""
    global _current
    if not isinstance(options, Options):
        raise TypeError(f"kda_aot options: expected an Options, got {type(options).__name__}")
    with _lock:
        previous, _current = _current, options
    return previous


@contextlib.contextmanager
def using(options: Options | None = None, **changes):
    """Run the block with `options` (or the current ones with `changes`); restored on exit."""
    previous = swap((options or current()).replace(**changes))
    try:
        yield current()
    finally:
        swap(previous)
