"""kda_aot.options: changed only by `using`, checked; no environment read on the call path."""
import re
from pathlib import Path

import pytest

import kda_aot
from kda_aot.schedule import fit
from kda_aot import options
from kda_aot.options import Options


def test_defaults_are_the_shipped_choices():
    o = Options()
    assert (o.walk_form, o.pipeline, o.replay_overlap, o.max_heads) == ("auto", True, True, 0)
    assert (o.cp_pipeline, o.cp_batched_summaries) == (True, True)
    assert (o.cp_exchange_beside, o.cp_piece_senders, o.debug_timing) == (False, False, False)
    assert o.gate_form == ""


def test_parse_and_bad_values():
    o = options.parse("walk_form=full, pipeline=0,max_heads=4,cp_exchange_beside=true")
    assert o == Options(walk_form="full", pipeline=False, max_heads=4, cp_exchange_beside=True)
    assert options.parse("") == Options()
    with pytest.raises(ValueError, match="not name=value"):
        options.parse("pipelines=0")
    with pytest.raises(ValueError, match="0/1 or true/false"):
        options.parse("pipeline=yes")
    with pytest.raises(ValueError, match="walk_form must be one of"):
        Options(walk_form="half")
    with pytest.raises(ValueError, match="max_heads"):
        Options(max_heads=-1)


def test_using_nests_and_restores():
    base = options.current()
    with options.using(walk_form="split") as outer:
        assert options.current() is outer and outer.walk_form == "split"
        with options.using(pipeline=False):
            assert options.current() == base.replace(walk_form="split", pipeline=False)
        assert options.current() == outer
        assert fit.plan_walk("kda_fwd_walk", (3, 3), 1, 132) == (("split", 0, 2),)
    assert options.current() == base
    with pytest.raises(RuntimeError):
        with options.using(Options(walk_form="full")):
            raise RuntimeError
    assert options.current() == base


def test_text_form_parses_and_names_a_bad_option():
    """The benchmarks' text form of the options (bench/profile_kda.py's argument)."""
    assert options.parse("walk_form=quarter, pipeline=0") == Options(walk_form="quarter", pipeline=False)
    assert options.parse("") == Options()
    with pytest.raises(ValueError, match="not name=value"):
        options.parse("pipline=0")
    with pytest.raises(ValueError, match="pipeline takes 0/1"):
        options.parse("pipeline=no")


def test_options_are_type_checked():
    """A truthy string for a bool would leave the order on: refused, naming the option."""
    with pytest.raises(TypeError, match="pipeline must be of type bool"):
        options.Options(pipeline="no")
    with pytest.raises(TypeError, match="max_heads must be of type int"):
        options.Options(max_heads=True)
    with pytest.raises(TypeError, match="walk_form must be of type str"):
        with options.using(walk_form=None):
            pass


def test_the_package_reads_no_environment_on_the_call_path():
    """Only the registry (which arch to load without a GPU) and kda_aot.fla (FLA's switches of its backends,
    FLA_KDA_AOT and FLA_KDA_AOT_CONV, which FLA's dispatch reads at every call by its own rule) read the
    environment."""
    pkg = Path(kda_aot.__file__).resolve().parent
    readers = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py")
                     if re.search(r"os\.environ|os\.getenv", p.read_text()))
    assert readers == ["_runtime/registry.py", "fla.py"], readers


def test_other_threads_see_the_options():
    """Autograd runs a backward on a thread of its own: the options set around a step reach it."""
    import threading
    seen = []
    with options.using(walk_form="quarter", pipeline=False):
        t = threading.Thread(target=lambda: seen.append(options.current()))
        t.start()
        t.join()
    assert seen == [options.DEFAULT.replace(walk_form="quarter", pipeline=False)]
    assert options.current() == options.DEFAULT


def test_the_backward_sees_the_options():
    """A CPU autograd Function's backward reads the options of the block the step ran in."""
    import torch

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, dy):
            Probe.seen = options.current().gate_form
            return dy

    x = torch.ones(3, requires_grad=True)
    with options.using(gate_form="full"):
        Probe.apply(x).sum().backward()
    assert Probe.seen == "full"
