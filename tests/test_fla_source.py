"""kda_aot's reading of flash-linear-attention 0.6.0 against FLA's own code, on the CPU. FLA's package imports
Triton, so its files are read, not imported: chunk_kda's signature from chunk.py's syntax tree, and FLA's torch
references (naive_kda_gate and naive_kda_lowerbound_gate in gate.py, naive_recurrent_kda in naive.py) compiled
alone from their source. The other CPU tests check kda_aot against FLA's formulas as we wrote them down
(tests/reftools.py); these check those formulas, and kda_aot.chunk_kda's whole FLA call, against FLA's code.
The source: the installed fla-core when it is 0.6.0, else its wheel in the checkout's .whl/ (scripts/test.sh
downloads it; CI sets KDA_AOT_REQUIRE_FLA=1, which makes a missing source a failure, not a skip)."""
import ast
import importlib.metadata
import importlib.util
import inspect
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kda_aot
from kda_aot.reference import kda_gate

from conftest import REQUIRE_FLA, ROOT
from reftools import fla_gate, rel_rms

FLA_VERSION = "0.6.0"
D = 128


def _installed_fla() -> Path | None:
    try:
        if importlib.metadata.version("fla-core") != FLA_VERSION:
            return None
    except importlib.metadata.PackageNotFoundError:
        return None
    spec = importlib.util.find_spec("fla")  # a top-level package's spec: found, not imported
    return Path(spec.origin).parent if spec and spec.origin else None


def _wheel() -> Path | None:
    found = sorted((ROOT / ".whl").glob(f"fla_core-{FLA_VERSION}-*.whl"))
    return found[0] if found else None


def fla_file(relpath: str) -> str:
    """The text of fla-core 0.6.0's fla/<relpath>."""
    package = _installed_fla()
    if package is not None:
        return (package / relpath).read_text()
    wheel = _wheel()
    if wheel is None:
        missing = f"fla-core {FLA_VERSION} is neither installed nor in .whl/ (scripts/test.sh downloads it)"
        if REQUIRE_FLA:
            pytest.fail(missing + "; KDA_AOT_REQUIRE_FLA=1 asks for it")
        pytest.skip(missing)
    with zipfile.ZipFile(wheel) as z:
        return z.read(f"fla/{relpath}").decode()


def fla_def(relpath: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(fla_file(relpath))
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"fla/{relpath} of fla-core {FLA_VERSION} has no function {name}"
    return found[0]


def fla_function(relpath: str, name: str):
    """FLA's top-level function `name` of fla/<relpath>, compiled alone (its body needs torch and F only)."""
    module = ast.Module(body=[fla_def(relpath, name)], type_ignores=[])
    namespace = {"torch": torch, "F": F}
    exec(compile(module, f"fla/{relpath}", "exec"), namespace)
    return namespace[name]


def test_the_signature_and_defaults_are_flas():
    """chunk_kda's parameters in FLA's order with FLA's defaults, and every keyword FLA's body takes from its
    **kwargs (A_log, dt_bias, chunk_size, transpose_state_layout) a keyword of ours with FLA's default."""
    fn = fla_def("ops/kda/chunk.py", "chunk_kda")
    names = [a.arg for a in fn.args.args]
    defaults = dict(zip(names[len(names) - len(fn.args.defaults):], (ast.literal_eval(d) for d in fn.args.defaults)))
    ours = inspect.signature(kda_aot.chunk_kda).parameters
    assert list(ours)[:len(names)] == names
    for name, default in defaults.items():
        assert ours[name].default == default and type(ours[name].default) is type(default), name
    assert fn.args.kwarg is not None and fn.args.kwarg.arg == "kwargs"
    taken = {}  # kwargs.get("x"), kwargs.pop("x"[, default]), "x" in kwargs
    for node in ast.walk(fn):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "kwargs"):
            taken[ast.literal_eval(node.args[0])] = ast.literal_eval(node.args[1]) if len(node.args) > 1 else None
        elif (isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In)
              and isinstance(node.comparators[0], ast.Name) and node.comparators[0].id == "kwargs"):
            taken.setdefault(ast.literal_eval(node.left), None)
    assert set(taken) == {"A_log", "dt_bias", "chunk_size", "transpose_state_layout"}
    for name, default in taken.items():
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY and ours[name].default == default, name


@pytest.mark.parametrize("kind", ["softplus", "lower_bound", "lower_bound_no_a_log"])
def test_the_gate_is_flas(gen, kind):
    """FLA's torch gates against the formula the other tests take as FLA's (reftools.fla_gate) and against
    kda_aot's own (kda_aot.reference.kda_gate), in fp32 as FLA computes them, over raw values that take the log
    decay to -30 and beyond. Each side is the same few fp32 operations: agreement to fp32 rounding."""
    HV = 4
    g = torch.randn(3, 50, HV, D, generator=gen) * 12
    A_log = torch.rand(HV, generator=gen) * 3 - 1
    dt_bias = torch.randn(HV * D, generator=gen)
    if kind == "softplus":
        want = fla_function("ops/kda/gate.py", "naive_kda_gate")(g, A_log, dt_bias)
        ours, written = kda_gate(g, A_log, dt_bias, None), fla_gate(g, A_log, dt_bias)
        assert want.min() < -30
    else:
        A_log = A_log if kind == "lower_bound" else None
        want = fla_function("ops/kda/gate.py", "naive_kda_lowerbound_gate")(g, A_log, dt_bias, lower_bound=-3.5)
        ours, written = kda_gate(g, A_log, dt_bias, -3.5), fla_gate(g, A_log, dt_bias, -3.5)
    assert want.dtype == ours.dtype == torch.float32
    torch.testing.assert_close(ours, want, rtol=2e-6, atol=0)
    torch.testing.assert_close(written, want, rtol=2e-6, atol=0)


def fla_naive_call(x, *, lower_bound, neg, v_first, heads_map="fla"):
    """FLA's layer call as FLA's torch code runs it: its gate, beta = sigmoid(b) (times 2 with allow_neg_eigval:
    FLA's kernel, as its docstring states it), then naive_recurrent_kda one sequence at a time (it takes no
    cu_seqlens), in fp32 with autograd. heads_map "tile" feeds it q, k heads tiled instead of grouped, the
    mistake its GVA must not match. Returns (o, final state, gradients of the leaves)."""
    leaves = {n: x[n].float().requires_grad_() for n in ("q", "k", "v", "g", "b", "h0", "A_log", "dt_bias")
              if x[n] is not None}
    if lower_bound is None:
        g = fla_function("ops/kda/gate.py", "naive_kda_gate")(leaves["g"], leaves["A_log"], leaves["dt_bias"])
    else:
        g = fla_function("ops/kda/gate.py", "naive_kda_lowerbound_gate")(
            leaves["g"], leaves.get("A_log"), leaves["dt_bias"], lower_bound=lower_bound)
    beta = (2.0 if neg else 1.0) * torch.sigmoid(leaves["b"])
    q, k = leaves["q"], leaves["k"]
    if heads_map == "tile":  # value head j reads q, k head j % H (FLA's: j // (HV / H))
        G = x["v"].shape[2] // q.shape[2]
        q, k = q.repeat(1, 1, G, 1), k.repeat(1, 1, G, 1)
    naive = fla_function("ops/kda/naive.py", "naive_recurrent_kda")
    h0 = leaves["h0"].transpose(-1, -2) if v_first else leaves["h0"]  # naive_recurrent_kda's state is [.., K, V]
    cu = x["cu"].tolist()
    outs, states = [], []
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        o, state = naive(q[:, s:e], k[:, s:e], leaves["v"][:, s:e], g[:, s:e], beta[:, s:e],
                         initial_state=h0[n:n + 1], output_final_state=True)
        outs.append(o)
        states.append(state)
    o, state = torch.cat(outs, 1), torch.cat(states, 0)
    if v_first:
        state = state.transpose(-1, -2)
    ((o.double() * x["do"]).sum() + (state.double() * x["dht"]).sum()).backward()
    return o.detach(), state.detach(), {n: t.grad for n, t in leaves.items()}


def fla_inputs(gen, lens, H, HV):
    T, N = sum(lens), len(lens)
    unit = lambda *shape: F.normalize(torch.randn(*shape, generator=gen), dim=-1).to(torch.bfloat16)  # noqa: E731
    return {"q": unit(1, T, H, D), "k": unit(1, T, H, D), "v": torch.randn(1, T, HV, D, generator=gen).bfloat16(),
            "g": torch.randn(1, T, HV, D, generator=gen) * 4, "b": torch.randn(1, T, HV, generator=gen),
            "h0": torch.randn(N, HV, D, D, generator=gen) * 0.1, "A_log": torch.rand(HV, generator=gen) * 2 - 1,
            "dt_bias": torch.randn(HV * D, generator=gen), "do": torch.randn(1, T, HV, D, generator=gen).double(),
            "dht": torch.randn(N, HV, D, D, generator=gen).double(),
            "cu": torch.tensor([0] + lens).cumsum(0).to(torch.int32)}


@pytest.mark.parametrize("H,HV,lower_bound,neg,v_first", [(2, 2, None, False, True), (2, 4, None, True, False),
                                                          (1, 4, -5.0, False, True), (2, 8, -2.0, True, True)])
def test_the_layer_call_is_flas_naive(reference_op, gen, H, HV, lower_bound, neg, v_first):
    """FLA's layer call (gate and beta's sigmoid in the kernel, grouped value heads, a V-first initial state,
    output_final_state, packed sequences) through kda_aot.chunk_kda on the fp64 reference against the same call
    through FLA's own torch code (fla_naive_call, fp32): the output, the final state and every gradient. FLA's
    side runs in fp32: its rounding over <= 130 recurrent steps is 0.5-2.5e-7 of each output's norm here, so the
    bound is 2e-6; the bf16 leaves' (q, k, v) gradients are rounded to bf16 on our side (autograd rounds a bf16
    leaf's gradient: 2^-9 at most, ~1.7e-3 of the norm measured), so 4e-3. dA_log is one fp32 sum a head of ~26 k
    products on FLA's side, whose terms can cancel: over 32 seeds x these 4 cases its error was 1.7e-7 in the
    median and 2.55e-6 at the worst (a head's sum 0.29 from terms of both signs), so 2e-5. A wrong head map, gate,
    transpose or scale is off by O(1e-2) or more (checked below for the head map)."""
    x = fla_inputs(gen, [70, 1, 130], H, HV)
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "b", "h0", "A_log", "dt_bias")}
    o, s = kda_aot.chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["b"], None, leaves["h0"], True,
                             False, True, True, neg, lower_bound is not None, lower_bound, state_v_first=v_first,
                             cu_seqlens=x["cu"], A_log=leaves["A_log"], dt_bias=leaves["dt_bias"])
    ((o.double() * x["do"]).sum() + (s.double() * x["dht"]).sum()).backward()
    assert reference_op == ["replay"]
    eo, es, egrads = fla_naive_call(x, lower_bound=lower_bound, neg=neg, v_first=v_first)
    assert rel_rms(o, eo) < 2e-6 and rel_rms(s, es) < 2e-6, (rel_rms(o, eo), rel_rms(s, es))
    for n, want in egrads.items():
        bound = 4e-3 if n in ("q", "k", "v") else 2e-5 if n == "A_log" else 2e-6
        assert rel_rms(leaves[n].grad, want) < bound, f"d{n}: {rel_rms(leaves[n].grad, want):.2e}"
    if 1 < H < HV:  # the head map is what this call checks, not a formality: tiled heads miss by far
        to, ts, _ = fla_naive_call(x, lower_bound=lower_bound, neg=neg, v_first=v_first, heads_map="tile")
        assert rel_rms(to, eo) > 0.1 and rel_rms(ts, es) > 0.01
