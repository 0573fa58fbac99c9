"""kda_aot.fla registers kda_aot with flash-linear-attention's backend dispatch. FLA needs Triton, so on the
CPU its two modules the backend touches (fla.backends: BaseBackend, register; fla.ops.kda.chunk: the
dispatched chunk_kda) are stood in for by minimal copies of their contract (fla-core 0.6.0: a backend
class registered on the entry point, asked `chunk_kda_verifier(*args, **kwargs)` -> (ok, reason) and
then its `chunk_kda` method with the same arguments, else the Triton fallback runs). The GPU test
(tests/test_fla_signature_gpu.py) runs the real FLA."""
import importlib
import sys
import types

import pytest
import torch

import kda_aot


@pytest.fixture
def fake_fla(monkeypatch):
    registered = []

    class BaseBackend:
        backend_type = "base"
        env_var = None
        priority = 5

        def is_enabled(self):
            import os
            return self.env_var is None or os.environ.get(self.env_var, "1") != "0"

        def verify(self, function_name, *args, **kwargs):
            return getattr(self, f"{function_name}_verifier")(*args, **kwargs)

    def register(entry_point, **kw):
        def decorator(cls):
            registered.append((entry_point, cls()))
            return cls
        return decorator

    def fla_chunk_kda(q, k, v, g, beta, *args, **kwargs):
        for _, backend in registered:
            ok, _ = backend.verify("chunk_kda", q, k, v, g, beta, *args, **kwargs)
            if backend.is_enabled() and ok:
                return backend.chunk_kda(q, k, v, g, beta, *args, **kwargs)
        return "triton"

    mods = {"fla": types.ModuleType("fla"), "fla.backends": types.ModuleType("fla.backends"),
            "fla.ops": types.ModuleType("fla.ops"), "fla.ops.kda": types.ModuleType("fla.ops.kda"),
            "fla.ops.kda.chunk": types.ModuleType("fla.ops.kda.chunk")}
    mods["fla.backends"].BaseBackend, mods["fla.backends"].register = BaseBackend, register
    mods["fla.ops.kda.chunk"].chunk_kda = fla_chunk_kda
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.delitem(sys.modules, "kda_aot.fla", raising=False)
    module = importlib.import_module("kda_aot.fla")
    yield module, registered, fla_chunk_kda
    sys.modules.pop("kda_aot.fla", None)


def test_import_registers_the_backend(fake_fla):
    module, registered, fla_chunk_kda = fake_fla
    assert len(registered) == 1
    entry, backend = registered[0]
    assert entry is fla_chunk_kda and backend.backend_type == "kda_aot" and backend.env_var == "FLA_KDA_AOT"
    assert backend.chunk_kda.__func__ is not None and module.chunk_kda is kda_aot.chunk_kda


def _call(D=128, H=2, HV=2, dtype=torch.bfloat16, device="cpu"):
    q = torch.zeros(1, 64, H, D, dtype=dtype, device=device)
    v = torch.zeros(1, 64, HV, D, dtype=dtype, device=device)
    return (q, q, v, torch.zeros(1, 64, HV, D, device=device), torch.zeros(1, 64, HV, dtype=dtype, device=device))


def test_the_verifier_declines_what_kda_aot_does_not_serve(fake_fla, monkeypatch):
    module, _, fla_chunk_kda = fake_fla
    ok, why = module.verify(*_call())
    assert not ok and "not a CUDA device" in why
    assert fla_chunk_kda(*_call()) == "triton"                    # FLA's own path runs instead
    # past the device checks (a served GPU stood in for), every other refusal, by its reason
    monkeypatch.setattr(module.registry, "serves", lambda device: True)
    cuda = torch.device("cuda")

    class OnCuda(torch.Tensor):
        pass

    def on_cuda(args):
        out = []
        for t in args:
            t = t.as_subclass(OnCuda)
            out.append(t)
        return out
    monkeypatch.setattr(OnCuda, "device", property(lambda self: cuda))
    base = on_cuda(_call())
    assert module.verify(*base) == (True, None)
    for args, kw, reason in [
            (on_cuda(_call(D=64)), {}, "head dims 64"),
            (on_cuda(_call(H=2, HV=3)), {}, "3 value heads over 2"),
            (on_cuda(_call(H=65, HV=65)), {}, "65 value heads"),
            (on_cuda(_call(dtype=torch.float16)), {}, "not bf16"),
            (base, {"chunk_size": 32}, "chunk_size 32"),
            (base, {"cp_context": object()}, "cp_context"),
            (base, {"return_intermediate_states": True}, "return_intermediate_states"),
            (base, {"use_graph": True}, "use_graph"),
            (base, {"some_new_flag": 1}, "keywords kda_aot does not take: ['some_new_flag']"),
            (base, {"initial_state": torch.zeros(1, 2, 128, 128, dtype=torch.bfloat16)}, "initial_state not fp32")]:
        ok, why = module.verify(*args, **kw)
        assert not ok and reason in why, (kw, why)
    fp32_beta = base[:4] + [base[4].float().as_subclass(OnCuda)]
    assert not module.verify(*fp32_beta)[0]
    assert module.verify(*fp32_beta, use_beta_sigmoid_in_kernel=True) == (True, None)   # logits: any float
    assert module.verify(*base, A_log=torch.zeros(2), dt_bias=torch.zeros(256), use_gate_in_kernel=True) == (True, None)


def test_the_switch_turns_it_off(fake_fla, monkeypatch):
    module, registered, fla_chunk_kda = fake_fla
    monkeypatch.setattr(module, "verify", lambda *a, **k: (True, None))
    seen = []
    monkeypatch.setattr(module, "chunk_kda", lambda *a, **k: seen.append(1) or "kda_aot")
    assert fla_chunk_kda(*_call()) == "kda_aot" and seen == [1]
    monkeypatch.setenv("FLA_KDA_AOT", "0")
    assert fla_chunk_kda(*_call()) == "triton"


@pytest.mark.parametrize("missing,match", [
    ("triton", r"flash-linear-attention is installed but cannot be imported: it needs 'triton', which is missing"),
    ("fla", r"it needs fla-core 0.6.0 \(pip install fla-core==0.6.0\)"),
])
def test_an_import_failure_names_what_is_missing(monkeypatch, missing, match):
    """FLA absent: install fla-core; FLA present but a dependency of it (Triton) absent: that dependency, not
    fla-core."""
    def find_failing(name, *args, **kwargs):
        if name.partition(".")[0] == "fla":
            raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
        return real_import(name, *args, **kwargs)

    import builtins
    real_import = builtins.__import__
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "kda_aot.fla", raising=False)
    monkeypatch.setattr(builtins, "__import__", find_failing)
    with pytest.raises(ImportError, match=match):
        importlib.import_module("kda_aot.fla")
