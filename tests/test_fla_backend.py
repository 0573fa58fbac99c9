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
        default_enable = True
        priority = 5
        implementation = None
        verifier = None

        def is_enabled(self):  # fla.backends.BaseBackend's rule
            import os
            if self.env_var is None:
                return True
            if os.environ.get(f"FLA_{self.backend_type.upper()}", "0") != "0":
                return True
            return os.environ.get(self.env_var, "1" if self.default_enable else "0") != "0"

        def verify(self, function_name, *args, **kwargs):
            verifier = self.verifier or getattr(self, f"{function_name}_verifier")
            return verifier(*args, **kwargs)

    def register(entry_point, *, backend=None, verifier=None, env_var=None):
        def decorator(implementation):
            if isinstance(implementation, type):
                registered_backend = implementation()
            else:
                registered_backend = backend() if backend is not None else BaseBackend()
                registered_backend.implementation = implementation
            registered_backend.verifier = verifier
            registered.append((entry_point, registered_backend))
            return implementation
        return decorator

    def dispatched(name):
        """FLA's dispatch: the first enabled backend whose verifier accepts the call, else FLA's own."""
        def entry(*args, **kwargs):
            for point, backend in registered:
                if point is entry and backend.is_enabled() and backend.verify(name, *args, **kwargs)[0]:
                    return (backend.implementation or getattr(backend, name))(*args, **kwargs)
            return "triton"
        entry.__name__ = name
        return entry

    mods = {name: types.ModuleType(name) for name in (
        "fla", "fla.backends", "fla.ops", "fla.ops.kda", "fla.ops.kda.chunk", "fla.modules",
        "fla.modules.causal_conv1d")}
    mods["fla.backends"].BaseBackend, mods["fla.backends"].register = BaseBackend, register
    fla_chunk_kda = mods["fla.ops.kda.chunk"].chunk_kda = dispatched("chunk_kda")
    conv = mods["fla.modules.causal_conv1d"]
    conv.causal_conv1d_fwd, conv.causal_conv1d_bwd = dispatched("causal_conv1d_fwd"), dispatched("causal_conv1d_bwd")
    conv.causal_conv1d_update_states = lambda **kw: "fla's final state"
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.delitem(sys.modules, "kda_aot.fla", raising=False)
    module = importlib.import_module("kda_aot.fla")
    yield module, registered, fla_chunk_kda
    sys.modules.pop("kda_aot.fla", None)


def test_import_registers_the_backend(fake_fla):
    module, registered, fla_chunk_kda = fake_fla
    conv = sys.modules["fla.modules.causal_conv1d"]
    assert [entry for entry, _ in registered] == [fla_chunk_kda, conv.causal_conv1d_fwd, conv.causal_conv1d_bwd]
    backend = registered[0][1]
    assert backend.backend_type == "kda_aot" and backend.env_var == "FLA_KDA_AOT"
    assert backend.chunk_kda.__func__ is not None and module.chunk_kda is kda_aot.chunk_kda
    for _, conv_backend in registered[1:]:
        assert conv_backend.backend_type == "kda_aot" and conv_backend.env_var == "FLA_KDA_AOT_CONV"
    assert (registered[1][1].implementation, registered[2][1].implementation) == (module.conv_fwd, module.conv_bwd)


def _call(D=128, H=2, HV=2, dtype=torch.bfloat16, device="cpu", B=1):
    q = torch.zeros(B, 64, H, D, dtype=dtype, device=device)
    v = torch.zeros(B, 64, HV, D, dtype=dtype, device=device)
    return (q, q, v, torch.zeros(B, 64, HV, D, device=device), torch.zeros(B, 64, HV, dtype=dtype, device=device))


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
    assert module.verify(*base, output_final_state=None, safe_gate=0, state_v_first=None) == (True, None)  # bools
    for args, kw, reason in [
            (on_cuda(_call(D=64)), {}, "head dims 64"),
            (on_cuda(_call(H=2, HV=3)), {}, "3 value heads over 2"),
            (on_cuda(_call(H=65, HV=65)), {}, "65 value heads"),
            (on_cuda(_call(dtype=torch.float16)), {}, "not bf16"),
            (base, {"chunk_size": 32}, "chunk_size 32"),
            (base, {"cp_context": object()}, "cp_context"),
            (base, {"return_intermediate_states": True}, "return_intermediate_states"),
            (base, {"use_graph": True}, "use_graph"),
            (base, {"max_num_seqs": 4}, "max_num_seqs are FLA's own"),
            (base, {"output_final_state": "no"}, "output_final_state: expected a bool, got 'no' (kda_aot's op takes a bool)"),
            (base, {"use_qk_l2norm_in_kernel": 1.0}, "use_qk_l2norm_in_kernel: expected a bool, got 1.0"),
            (base, {"some_new_flag": 1}, "keywords kda_aot does not take: ['some_new_flag']"),
            (base, {"initial_state": torch.zeros(1, 2, 128, 128, dtype=torch.bfloat16)}, "initial_state not fp32"),
            (base[:3] + [base[3].double()] + base[4:], {}, "g in torch.float64"),
            (base[:3] + [base[3].long()] + base[4:], {"use_gate_in_kernel": True}, "g in torch.int64"),
            (base, {"use_gate_in_kernel": True, "lower_bound": torch.tensor(-1.0)}, "lower_bound of type Tensor"),
            (base, {"use_gate_in_kernel": True, "lower_bound": True}, "lower_bound of type bool"),
            (base, {"use_gate_in_kernel": True, "A_log": torch.zeros(2, dtype=torch.int64)}, "A_log not a float32"),
            (base, {"use_gate_in_kernel": True, "A_log": torch.zeros(2, dtype=torch.float8_e4m3fn)}, "A_log not a float32"),
            (base, {"use_gate_in_kernel": True, "A_log": torch.zeros(2), "dt_bias": [0.0] * 256}, "dt_bias not a float32"),
            # a pack padded past cu_seqlens[-1] (FLA runs it; kda_aot.chunk_kda refuses it) and broken boundaries
            (base, {"cu_seqlens": torch.tensor([0, 30, 60])}, "not the boundaries of the whole pack"),
            (base, {"cu_seqlens": torch.tensor([0, 20, 60])}, "not the boundaries of the whole pack"),
            (base, {"cu_seqlens": [0, 40, 30, 64]}, "not the boundaries"),
            (base, {"cu_seqlens": [0, 10.5, 64]}, "not the boundaries"),
            (on_cuda(_call(B=2)), {"cu_seqlens": torch.tensor([0, 64])}, "2 sequences with cu_seqlens")]:
        ok, why = module.verify(*args, **kw)
        assert not ok and reason in why, (kw, why)
    # one reason whatever the padding (a declined call warns once per reason)
    assert module.verify(*base, cu_seqlens=[0, 30, 60]) == module.verify(*base, cu_seqlens=[0, 20, 50])
    for cu in (torch.tensor([0, 30, 30, 64]), [0, 64]):
        assert module.verify(*base, cu_seqlens=cu) == (True, None)
    assert module.verify(*base, cu_seqlens=torch.tensor([0, 64]), cu_seqlens_cpu=torch.tensor([0, 64])) == (True, None)
    from fractions import Fraction  # a real number that is not a float, as numpy's float32 is
    assert module.verify(*base, use_gate_in_kernel=True, lower_bound=Fraction(-3)) == (True, None)
    # what the op serves: an fp64 raw gate (the kernels read it as fp32), a lower_bound the call does not use
    assert module.verify(*base[:3], base[3].double(), base[4], use_gate_in_kernel=True) == (True, None)
    assert module.verify(*base, lower_bound="unused without the gate") == (True, None)
    fp32_beta = base[:4] + [base[4].float().as_subclass(OnCuda)]
    assert not module.verify(*fp32_beta)[0]
    assert module.verify(*fp32_beta, use_beta_sigmoid_in_kernel=True) == (True, None)   # logits: any float
    assert module.verify(*base, A_log=torch.zeros(2), dt_bias=torch.zeros(256), use_gate_in_kernel=True) == (True, None)
    # fp64 gate parameters, as FLA's gate reads them (as fp32): served (the kernels read them as fp32 too)
    assert module.verify(*base, A_log=torch.zeros(2, dtype=torch.float64), dt_bias=torch.zeros(256, dtype=torch.float64),
                         use_gate_in_kernel=True) == (True, None)


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
    ("fla", r"it needs fla-core 0.6.0 \(pip install 'kda_aot\[fla\]': fla-core\[cuda\] 0\.6\.0"),
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


class _OnCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device: the verifiers' checks past the device, without a GPU."""
    device = property(lambda self: torch.device("cuda"))


def _conv_call(B=1, T=70, D=64, dtype=torch.bfloat16, width=4):
    x = torch.randn(B, T, D).to(dtype).as_subclass(_OnCuda)
    weight = torch.randn(D, width).as_subclass(_OnCuda)
    return x, weight


def test_the_conv_verifiers_decline_what_the_kernels_do_not_serve(fake_fla, monkeypatch):
    module, _, _ = fake_fla
    conv = sys.modules["fla.modules.causal_conv1d"]
    x = torch.randn(1, 70, 64).to(torch.bfloat16)
    ok, why = module.conv_fwd_verify(x, torch.randn(64, 4), activation="silu")
    assert not ok and "not a CUDA device" in why
    assert conv.causal_conv1d_fwd(x=x, weight=torch.randn(64, 4), activation="silu") == "triton"
    monkeypatch.setattr(module.registry, "serves", lambda device: True)
    x, w = _conv_call()
    cu = torch.tensor([0, 30, 30, 70])
    for activation in ("silu", "swish"):
        assert module.conv_fwd_verify(x, w, activation=activation, cu_seqlens=cu) == (True, None)
    assert module.conv_fwd_verify(x, w, torch.zeros(64).as_subclass(_OnCuda), activation="silu") == (True, None)
    assert module.conv_fwd_verify(*_conv_call(B=3), activation="silu") == (True, None)  # B sequences, no cu_seqlens
    dy = torch.zeros(x.shape, dtype=torch.bfloat16).as_subclass(_OnCuda)
    assert module.conv_bwd_verify(x, dy, None, w, activation="silu") == (True, None)
    ok, why = module.conv_bwd_verify(x, dy.float(), None, w, activation="silu")
    assert not ok and "dy not of x's shape and dtype" in why
    for args, kw, reason in [
            (_conv_call(), {"activation": None}, "activation None"),
            (_conv_call(dtype=torch.float16), {"activation": "silu"}, "torch.float16"),
            (_conv_call(D=60), {"activation": "silu"}, "D = 60"),
            (_conv_call(width=3), {"activation": "silu"}, "width 4"),
            ((x, w), {"activation": "silu", "bias": torch.zeros(32)}, "bias of shape [32]"),
            ((x, w), {"activation": "silu", "residual": x}, "residual"),
            ((x, w), {"activation": "silu", "initial_state": torch.zeros(3, 64, 4)}, "initial_state"),
            (_conv_call(B=2), {"activation": "silu", "cu_seqlens": cu}, "2 sequences with cu_seqlens"),
            ((x, w), {"activation": "silu", "cu_seqlens": torch.tensor([0, 30, 60])}, "not the boundaries of the whole pack"),
            ((x, w), {"activation": "silu", "cu_seqlens": torch.tensor([0, 40, 30, 70])}, "not the boundaries")]:
        ok, why = module.conv_fwd_verify(*args, **kw)
        assert not ok and reason in why, (kw, why)
    ok, why = module.conv_bwd_verify(x, x, torch.zeros(3, 64, 4), w, activation="silu")
    assert not ok and "final-state gradient" in why


def test_the_conv_runs_each_sequence_apart(fake_fla, monkeypatch):
    """FLA's [B, T, D] call without cu_seqlens is B documents of one pack: the kernels' ops stood in for by the
    fp64 reference, each sequence's output and gradients are the reference's on that sequence alone."""
    from kda_aot import reference
    module, registered, _ = fake_fla
    conv = sys.modules["fla.modules.causal_conv1d"]
    for _, backend in registered[1:]:  # past the device checks
        monkeypatch.setattr(backend, "verifier", lambda *a, **k: (True, None))

    def fwd_op(x, weight, bias, halo, cu, form):
        return reference.conv1d_silu(x, weight, bias, cu_seqlens=cu).to(x.dtype)

    def bwd_op(x, weight, bias, halo, cu, dy, form, need_dhalo):
        dx, dw, db, _ = reference.conv1d_silu_bwd(x, weight, bias, dy, cu_seqlens=cu)
        return dx.to(x.dtype), dw.to(weight.dtype), db.to(bias.dtype), None
    monkeypatch.setattr(module, "conv1d_silu_fwd_op", fwd_op)
    monkeypatch.setattr(module, "conv1d_silu_bwd_op", bwd_op)
    B, T, D = 3, 9, 16
    x, w, b, dy = torch.randn(B, T, D).double(), torch.randn(D, 4).double(), torch.randn(D).double(), \
        torch.randn(B, T, D).double()
    y, final = conv.causal_conv1d_fwd(x=x, weight=w, bias=b, activation="silu")
    dx, dw, db, dr, dh0 = conv.causal_conv1d_bwd(x=x, dy=dy, dht=None, weight=w, bias=b, activation="silu")
    assert final is None and dr is None and dh0 is None and y.shape == dx.shape == x.shape
    dw_sum, db_sum = torch.zeros_like(w), torch.zeros_like(b)
    for i in range(B):
        one = torch.tensor([0, T])
        torch.testing.assert_close(y[i], reference.conv1d_silu(x[i:i + 1], w, b, cu_seqlens=one)[0])
        rdx, rdw, rdb, _ = reference.conv1d_silu_bwd(x[i:i + 1], w, b, dy[i:i + 1], cu_seqlens=one)
        torch.testing.assert_close(dx[i], rdx[0])
        dw_sum, db_sum = dw_sum + rdw, db_sum + rdb
    torch.testing.assert_close(dw, dw_sum)
    torch.testing.assert_close(db, db_sum)
    # a final state asked for: FLA's own helper forms it (its layout)
    assert conv.causal_conv1d_fwd(x=x, weight=w, activation="silu", output_final_state=True)[1] == "fla's final state"


def test_the_conv_switches(fake_fla, monkeypatch):
    module, registered, fla_chunk_kda = fake_fla
    conv = sys.modules["fla.modules.causal_conv1d"]
    monkeypatch.setattr(registered[1][1], "verifier", lambda *a, **k: (True, None))
    monkeypatch.setattr(module, "verify", lambda *a, **k: (True, None))
    monkeypatch.setattr(module, "conv1d_silu_fwd_op", lambda x, *a: x)
    monkeypatch.setattr(module, "chunk_kda", lambda *a, **k: "kda_aot")
    x = torch.zeros(1, 8, 16)

    def conv_on():
        return conv.causal_conv1d_fwd(x=x, weight=None, activation="silu") != "triton"
    assert conv_on() and fla_chunk_kda(*_call()) == "kda_aot"
    monkeypatch.setenv("FLA_KDA_AOT_CONV", "0")          # the conv alone off
    assert not conv_on() and fla_chunk_kda(*_call()) == "kda_aot"
    monkeypatch.setenv("FLA_KDA_AOT", "1")               # FLA's rule would read this as every kda_aot backend on
    assert not conv_on() and fla_chunk_kda(*_call()) == "kda_aot"
    monkeypatch.delenv("FLA_KDA_AOT_CONV")
    monkeypatch.setenv("FLA_KDA_AOT", "0")               # every kda_aot backend off
    assert not conv_on() and fla_chunk_kda(*_call()) == "triton"


def test_a_log_without_the_gate_flag_is_ignored_as_fla_does(fake_fla, monkeypatch):
    """FLA reads A_log and dt_bias only with use_gate_in_kernel: the backend drops them without it (kda_aot's own
    chunk_kda refuses them there), so a call FLA takes is not refused once kda_aot serves it."""
    module, registered, _ = fake_fla
    seen = []
    monkeypatch.setattr(module, "chunk_kda", lambda *a, **k: seen.append(k))
    backend = registered[0][1]
    params = {"A_log": torch.zeros(2), "dt_bias": torch.zeros(256)}
    backend.chunk_kda(*_call(), **params)
    backend.chunk_kda(*_call(), None, None, False, False, True, **params)  # use_gate_in_kernel, positionally
    backend.chunk_kda(*_call(), use_gate_in_kernel=True, **params)
    assert [sorted(k) for k in seen] == [[], ["A_log", "dt_bias"], ["A_log", "dt_bias", "use_gate_in_kernel"]]


def test_a_declined_call_on_a_served_gpu_warns_once(fake_fla, monkeypatch):
    """On a GPU kda_aot serves, a call its verifier declines runs on FLA's kernels: a slow step, said once per
    reason; a CPU call (FLA's own business) says nothing."""
    import warnings
    module, _, fla_chunk_kda = fake_fla
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fla_chunk_kda(*_call()) == "triton"               # CPU tensors: no warning
    monkeypatch.setattr(module.registry, "serves", lambda device: True)
    fp16 = [t.as_subclass(_OnCuda) for t in _call(dtype=torch.float16)]
    with pytest.warns(UserWarning, match="runs this call on its own Triton kernels.*not bf16"):
        assert fla_chunk_kda(*fp16) == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fla_chunk_kda(*fp16) == "triton"                  # once per reason
