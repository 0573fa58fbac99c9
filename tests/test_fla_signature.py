"""kda_aot.chunk_kda takes flash-linear-attention 0.6.0's chunk_kda call: its parameters in its order, the
gate and beta activations, grouped value heads, V-first states, and clear errors for what it does not
serve. On the CPU the KDA op itself is replaced by the fp64 reference (the GPU tests run the kernels:
tests/test_fla_signature_gpu.py); what is checked here is everything chunk_kda does around it, against
FLA's formulas written out independently, values and gradients."""
import inspect
import math
from fractions import Fraction

import pytest
import torch

import kda_aot
from kda_aot import reference
from kda_aot.ops import chunk_kda as op
from kda_aot.reference import l2norm
from kda_aot.schedule import kda

from conftest import generator
from reftools import fla_beta, fla_gate, fla_heads, rel_rms

FLA_PARAMETERS = ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                  "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                  "safe_gate", "lower_bound", "disable_recompute", "return_intermediate_states", "state_v_first",
                  "cu_seqlens", "cu_seqlens_cpu", "cp_context", "use_graph", "max_num_seqs"]
D = 128


def l2norm_as_the_kernel(x):
    """The norm's bf16 values, with the gradient of the fp64 formula."""
    exact = l2norm(x.double())
    return exact + (l2norm(x.detach().to(torch.bfloat16)).double() - exact).detach()


def gen(*key):
    return generator(key)


def inputs(lens, H, HV, seed):
    g_ = gen("fla", seed)
    T, N = sum(lens), len(lens)
    x = {"q": torch.randn(1, T, H, D, generator=g_), "k": torch.randn(1, T, H, D, generator=g_),
         "v": torch.randn(1, T, HV, D, generator=g_), "g": torch.randn(1, T, HV, D, generator=g_),
         "b": torch.randn(1, T, HV, generator=g_), "h0": torch.randn(N, HV, D, D, generator=g_) * 0.1,
         "A_log": torch.rand(HV, generator=g_) * 2, "dt_bias": torch.randn(HV * D, generator=g_),
         "do": torch.randn(1, T, HV, D, generator=g_), "dht": torch.randn(N, HV, D, D, generator=g_)}
    for n in ("q", "k", "v"):
        x[n] = x[n].to(torch.bfloat16)
    x["cu"] = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    return x


def expected(x, *, lower_bound=None, neg=False, v_first=False, l2=True, activated=False):
    """FLA's formulas, independently: l2norm, the gate, sigmoid beta, GVA by head index, V-first states.
    activated: also the activated gate and its gradient, (o, s, grads, (g, dg))."""
    HV = x["v"].shape[2]
    leaves = {n: x[n].double().requires_grad_() for n in ("q", "k", "v", "g", "b", "h0", "A_log", "dt_bias")
              if x[n] is not None}
    q, k = leaves["q"], leaves["k"]
    if l2:
        q, k = l2norm_as_the_kernel(q), l2norm_as_the_kernel(k)
    q, k = fla_heads(q, HV), fla_heads(k, HV)
    g = fla_gate(leaves["g"], leaves.get("A_log"), leaves["dt_bias"], lower_bound)
    if activated:
        g.retain_grad()
    beta = fla_beta(leaves["b"], neg)
    # the kernels' beta: FLA's fp32 sigmoid of the logits, never rounded to bf16, with the fp64 gradient
    in_fp32 = fla_beta(x["b"].float(), neg).double()
    beta = beta + (in_fp32 - beta).detach()
    h0 = leaves["h0"].transpose(-1, -2) if v_first else leaves["h0"]
    o, s = reference.kda_chunked(q, k, leaves["v"], g, beta, cu_seqlens=x["cu"].tolist(), initial_state=h0,
                                 output_final_state=True, dtype=torch.float64)
    if v_first:
        s = s.transpose(-1, -2)
    ((o * x["do"]).sum() + (s * x["dht"]).sum()).backward()
    grads = {n: t.grad for n, t in leaves.items()}
    if activated:
        return o.detach(), s.detach(), grads, (g.detach(), g.grad)
    return o.detach(), s.detach(), grads


def run_ours(x, **kw):
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "b", "h0", "A_log", "dt_bias")
              if x[n] is not None}
    o, s = kda_aot.chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["b"], None, leaves["h0"],
                             True, True, True, True, cu_seqlens=x["cu"], A_log=leaves.get("A_log"),
                             dt_bias=leaves["dt_bias"], **kw)
    ((o.double() * x["do"]).sum() + (s.double() * x["dht"]).sum()).backward()
    return o.detach(), s.detach(), {n: t.grad for n, t in leaves.items()}


def test_the_signature_is_flas():
    params = list(inspect.signature(kda_aot.chunk_kda).parameters)
    assert params[:len(FLA_PARAMETERS)] == FLA_PARAMETERS
    kw = inspect.signature(kda_aot.chunk_kda).parameters
    assert kw["A_log"].kind is inspect.Parameter.KEYWORD_ONLY and kw["dt_bias"].kind is inspect.Parameter.KEYWORD_ONLY
    assert kw["scale"].default is None and kw["disable_recompute"].default is False
    # the switches chunk_kda and FLA's verifier check, in the order chunk_kda passes and unpacks them
    assert op.FLAGS == ("output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                        "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "disable_recompute",
                        "return_intermediate_states", "state_v_first", "use_graph")
    source = " ".join(inspect.getsource(kda_aot.chunk_kda).split())
    listed = ", ".join(op.FLAGS)
    assert f"({listed}) = checked_flags( {listed})" in source


def test_each_flag_is_checked_under_its_own_name():
    """Every one of FLAGS given a string is refused naming that flag (checked_flags pairs values with names by
    position), and checked_flags refuses a call with a flag missing."""
    x = inputs([32], 2, 2, "flag-names")
    q, k, v, g, b = (x[n] for n in ("q", "k", "v", "g", "b"))
    for name in op.FLAGS:
        with pytest.raises(TypeError, match=f"^{name}: expected a bool, got 'maybe'$"):
            kda_aot.chunk_kda(q, k, v, g, b, cu_seqlens=x["cu"], **{name: "maybe"})
    with pytest.raises(TypeError, match="checked_flags: expected the 10 values"):
        op.checked_flags(*([False] * 9))


@pytest.mark.parametrize("HV,lower_bound,neg,v_first", [(4, None, False, False), (8, None, True, True),
                                                        (16, -5.0, False, True), (4, -2.0, True, False)])
def test_fla_layer_call_matches_flas_formulas(reference_op, HV, lower_bound, neg, v_first):
    """FLA's layer call (l2norm, gate and beta sigmoid in kernel, positional order), with GVA at HV / H = 1,
    2, 4: the output, the final state and every gradient (raw g, A_log, dt_bias, beta logits, q, k summed
    over their value heads, the V-first initial state) as FLA's formulas give them. Values to fp32
    rounding (the gate and beta are activated in fp32, as the kernels do); gradients of the fp32 tensors (g, A_log,
    dt_bias, beta's logits, the states) to fp32 rounding, of the bf16 ones (q, k, v) to bf16 rounding (autograd
    rounds a bf16 leaf's gradient to bf16); a wrong head map, gate or transpose is off by O(1)."""
    x = inputs([70, 1, 130], 4, HV, (HV, lower_bound, neg))
    o, s, grads = run_ours(x, lower_bound=lower_bound, safe_gate=lower_bound is not None, allow_neg_eigval=neg,
                           state_v_first=v_first)
    eo, es, egrads = expected(x, lower_bound=lower_bound, neg=neg, v_first=v_first)
    assert reference_op == ["replay"]
    assert rel_rms(o, eo) < 1e-6 and rel_rms(s, es) < 1e-6
    for n, want in egrads.items():
        bound = 1e-2 if n in ("q", "k", "v") else 1e-5
        assert rel_rms(grads[n], want) < bound, f"d{n}: {rel_rms(grads[n], want):.2e}"


def test_sigmoid_gate_without_a_log(reference_op):
    """lower_bound sigmoid(g + dt_bias): A_log left out (exp(A_log) = 1), as FLA allows with lower_bound."""
    x = dict(inputs([70, 1, 130], 4, 4, "sigmoid-no-a-log"), A_log=None)
    o, s, grads = run_ours(x, lower_bound=-3.0)
    eo, es, egrads = expected(x, lower_bound=-3.0)
    assert rel_rms(o, eo) < 1e-6 and rel_rms(s, es) < 1e-6
    assert "A_log" not in grads and rel_rms(grads["g"], egrads["g"]) < 1e-5 and rel_rms(grads["dt_bias"], egrads["dt_bias"]) < 1e-5


def test_fp64_gate_inputs_are_served_as_fp32(reference_op):
    """An fp64 raw gate, A_log and dt_bias (FLA's gate reads them as fp32): served as the fp32 call is, their
    gradients in their own dtype, as on the GPU (kernel_gate) - off the GPU too, where the torch activation runs."""
    x = inputs([70, 1, 130], 2, 4, "fp64-gate")
    o, s, grads = run_ours(x)
    x64 = dict(x, **{n: x[n].double() for n in ("g", "A_log", "dt_bias")})
    o64, s64, grads64 = run_ours(x64)
    assert rel_rms(o64, o) < 1e-6 and rel_rms(s64, s) < 1e-6
    for n in ("g", "A_log", "dt_bias"):
        assert grads64[n].dtype == torch.float64 and rel_rms(grads64[n], grads[n]) < 1e-5, n


def test_a_lower_bound_from_numpy_is_a_number(reference_op):
    """A config's numpy scalar (not a float) is taken as its value."""
    np = pytest.importorskip("numpy", reason="numpy's scalars need numpy (the installed run has none)")
    x = dict(inputs([70, 1], 2, 2, "numpy-lower-bound"), A_log=None)
    o, s, _ = run_ours(x, lower_bound=-3.0)
    o32, s32, _ = run_ours(x, lower_bound=np.float32(-3.0))
    assert torch.equal(o32, o) and torch.equal(s32, s)


def test_disable_recompute_is_the_saved_mode(reference_op):
    x = inputs([65], 2, 2, "modes")
    run_ours(x, disable_recompute=True)
    run_ours(x, backward="saved")
    run_ours(x)
    assert reference_op == ["saved", "saved", "replay"]
    with pytest.raises(ValueError, match="disable_recompute=True is backward='saved'"):
        run_ours(x, disable_recompute=True, backward="replay")


def test_precomputed_gate_and_bf16_g(reference_op):
    """Without use_gate_in_kernel g is the log decay; a bf16 g is widened exactly."""
    x = inputs([40, 24], 2, 2, "plain")
    g = -torch.rand(1, 64, 2, D).to(torch.bfloat16)
    q, k, v = x["q"], x["k"], x["v"]
    beta = torch.rand(1, 64, 2).to(torch.bfloat16)
    o, _ = kda_aot.chunk_kda(q, k, v, g, beta, cu_seqlens=x["cu"])
    want, _ = reference.kda_chunked(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                    cu_seqlens=x["cu"].tolist(), dtype=torch.float64)
    assert rel_rms(o, want) < 1e-12
    o_list, _ = kda_aot.chunk_kda(q, k, v, g, beta, cu_seqlens=x["cu"].tolist())  # boundaries as a list, as PackedKDA
    assert torch.equal(o_list, o)
    with pytest.raises(TypeError, match="cu_seqlens: expected a tensor or a sequence of ints"):
        kda_aot.chunk_kda(q, k, v, g, beta, cu_seqlens=[0.0, 40.0, 64.0])


def test_unserved_arguments_raise(reference_op):
    x = inputs([64], 2, 2, "refuse")
    q, k, v, g, b = x["q"], x["k"], x["v"], -torch.rand(1, 64, 2, D), torch.rand(1, 64, 2).to(torch.bfloat16)
    cases = [(dict(cp_context=object()), NotImplementedError, "cp_context"),
             (dict(return_intermediate_states=True), NotImplementedError, "return_intermediate_states"),
             (dict(use_graph=True), NotImplementedError, "use_graph"),
             (dict(chunk_size=32), NotImplementedError, "chunk_size"),
             (dict(allow_neg_eigval=True), ValueError, "allow_neg_eigval: needs use_beta_sigmoid_in_kernel"),
             (dict(A_log=x["A_log"]), ValueError, "A_log: only used with use_gate_in_kernel"),
             (dict(use_gate_in_kernel=True), ValueError, "A_log: required with use_gate_in_kernel"),
             (dict(use_gate_in_kernel=True, A_log=x["A_log"][:1]), ValueError,
              r"A_log: expected 2 elements \(\[HV\] for HV = 2\), got shape \[1\]"),
             (dict(use_gate_in_kernel=True, A_log=x["A_log"].long()), TypeError, "A_log: expected float32, bfloat16, float16 or float64"),
             (dict(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"][:5]), ValueError,
              r"dt_bias: expected 256 elements"),
             (dict(use_gate_in_kernel=True, A_log=x["A_log"], safe_gate=True), ValueError,
              "lower_bound: required with safe_gate"),
             (dict(use_gate_in_kernel=True, A_log=x["A_log"], safe_gate=True, lower_bound=-6.0), ValueError,
              r"lower_bound: must lie in \[-5, 0\)"),
             (dict(use_gate_in_kernel=True, A_log=x["A_log"], safe_gate=True, lower_bound=0.0), ValueError,
              r"lower_bound: must lie in \[-5, 0\)"),
             (dict(use_gate_in_kernel=True, A_log=x["A_log"], lower_bound=0.5), ValueError,
              r"lower_bound: must be a finite number < 0"),
             (dict(use_gate_in_kernel=True, lower_bound=float("-inf")), ValueError,
              r"lower_bound: must be a finite number < 0 .*got -inf"),
             (dict(use_gate_in_kernel=True, A_log=x["A_log"], lower_bound=float("nan")), ValueError,
              r"lower_bound: must be a finite number < 0 .*got nan"),
             (dict(backward="checkpoint"), ValueError, "backward: expected one of"),
             (dict(state_v_first=True, initial_state=torch.zeros(1, 2, D, 64)), ValueError,
              r"initial_state: expected shape \[N, 2, 128, 128\] \(\[N, HV, V, K\] with state_v_first=True\), "
              r"got \[1, 2, 128, 64\]"),
             # the state's rows are checked before the norm's kernels (on the CPU: before the GPU's refusal)
             (dict(use_qk_l2norm_in_kernel=True, initial_state=torch.zeros(3, 2, D, D)), ValueError,
              r"initial_state: expected shape \[1, 2, 128, 128\] \(a row per document, HV heads\), got \[3, 2, 128, 128\]"),
             (dict(cu_seqlens_cpu=torch.tensor([0, 32], dtype=x["cu"].dtype)), ValueError,
              "cu_seqlens_cpu: must hold cu_seqlens' values"),
             (dict(scale="x"), TypeError, "scale: expected a real number or None, got str"),
             (dict(scale=True), TypeError, "scale: expected a real number or None, got bool"),
             (dict(scale=float("nan")), ValueError, "scale: expected a finite number, got nan"),
             (dict(scale=float("inf")), ValueError, "scale: expected a finite number, got inf"),
             (dict(scale=torch.ones(2)), TypeError, r"scale: expected a real number, got a tensor of shape \[2\]"),
             # a flag is a bool (or 0 / 1, numpy's bool, None as False): a string such as "no" would be truthy
             (dict(output_final_state="no"), TypeError, "output_final_state: expected a bool, got 'no'"),
             (dict(use_qk_l2norm_in_kernel="yes"), TypeError, "use_qk_l2norm_in_kernel: expected a bool, got 'yes'"),
             (dict(use_gate_in_kernel=2), TypeError, "use_gate_in_kernel: expected a bool, got 2"),
             (dict(state_v_first=1.0), TypeError, "state_v_first: expected a bool, got 1.0"),
             (dict(disable_recompute="False"), TypeError, "disable_recompute: expected a bool, got 'False'"),
             (dict(safe_gate=torch.tensor([True])), TypeError,
              r"safe_gate: expected a bool, got a tensor of shape \[1\] and dtype torch.bool"),
             (dict(safe_gate=torch.tensor(1.0)), TypeError,
              r"safe_gate: expected a bool, got a tensor of shape \[\] and dtype torch.float32 holding 1.0"),
             (dict(safe_gate=torch.tensor(2)), TypeError, r"safe_gate: expected a bool, got a tensor .* holding 2")]
    for kw, err, match in cases:
        with pytest.raises(err, match=match):
            kda_aot.chunk_kda(q, k, v, g, b, cu_seqlens=x["cu"], **kw)
    with pytest.raises(ValueError, match=r"HV = 3\) must be a multiple of q's and k's \(H = 2\)"):
        kda_aot.chunk_kda(q, k, torch.zeros(1, 64, 3, D, dtype=torch.bfloat16), g[:, :, :1].expand(1, 64, 3, D),
                          b[:, :, :1].expand(1, 64, 3), cu_seqlens=x["cu"])
    with pytest.raises(TypeError, match="unexpected keyword"):
        kda_aot.chunk_kda(q, k, v, g, b, cu_seqlens=x["cu"], gate_in_kernel=True)
    # a head dim other than 128 is named on q before the gate's shapes are checked against it
    for args in ((q[..., :64], k[..., :64], v, g, b), (q[..., :64], k[..., :64], v[..., :64], g[..., :64], b)):
        with pytest.raises(ValueError, match="q: head dim must be 128, got 64"):
            kda_aot.chunk_kda(*args, cu_seqlens=x["cu"], use_gate_in_kernel=True, A_log=x["A_log"],
                              dt_bias=x["dt_bias"], use_qk_l2norm_in_kernel=True)
    assert reference_op == []  # no error reached the op


def test_optional_flags_given_as_none_are_false(reference_op):
    """FLA's layers pass their Optional[bool] settings as they are (output_final_state=use_cache, None by default
    in some): None is False, as FLA reads it."""
    x = inputs([64], 2, 2, "none-flags")
    g, b = -torch.rand(1, 64, 2, D), torch.rand(1, 64, 2).to(torch.bfloat16)
    o, s = kda_aot.chunk_kda(x["q"], x["k"], x["v"], g, b, output_final_state=None, use_qk_l2norm_in_kernel=None,
                             safe_gate=None, state_v_first=None, cu_seqlens=x["cu"])
    want, _ = reference.kda_chunked(*(t.double() for t in (x["q"], x["k"], x["v"], g, b)), cu_seqlens=x["cu"].tolist())
    assert s is None and rel_rms(o, want) < 1e-12
    # what else a config or a trace carries for a bool: 0 / 1, a 0-d bool tensor, a SymBool from a traced shape
    _, s = kda_aot.chunk_kda(x["q"], x["k"], x["v"], g, b, output_final_state=torch.tensor(True), safe_gate=0,
                             cu_seqlens=x["cu"])
    assert s is not None and s.shape == (1, 2, D, D)
    from torch.fx.experimental.proxy_tensor import make_fx
    from kda_aot._runtime.tensor import checked_flag
    traced = make_fx(lambda t: t * 2 if checked_flag("output_final_state", t.shape[0] > 1) else t,
                     tracing_mode="symbolic")(torch.zeros(3))
    assert "mul" in traced.code


def test_scale_and_initial_state_positionally(reference_op):
    x = inputs([64, 3], 2, 2, "positional")
    g, b = -torch.rand(1, 67, 2, D), torch.rand(1, 67, 2).to(torch.bfloat16)
    o, s = kda_aot.chunk_kda(x["q"], x["k"], x["v"], g, b, 0.05, x["h0"], True, cu_seqlens=x["cu"])
    want, ws = reference.kda_chunked(*(t.double() for t in (x["q"], x["k"], x["v"], g, b)), cu_seqlens=x["cu"].tolist(),
                                     scale=0.05, initial_state=x["h0"].double(), output_final_state=True,
                                     dtype=torch.float64)
    assert rel_rms(o, want) < 1e-12 and rel_rms(s, ws) < 1e-12
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        _, sv = kda_aot.chunk_kda(x["q"], x["k"], x["v"], g, b, 0.05, x["h0"].transpose(-1, -2), True,
                                  cu_seqlens=x["cu"], transpose_state_layout=True)
    assert rel_rms(sv.transpose(-1, -2), ws) < 1e-12
    assert not math.isnan(o.double().sum().item())
    for scale in (torch.tensor(0.05, dtype=torch.float64), Fraction(1, 20)):  # a one-element tensor, any real number
        o2, _ = kda_aot.chunk_kda(x["q"], x["k"], x["v"], g, b, scale, x["h0"], True, cu_seqlens=x["cu"])
        assert rel_rms(o2, want) < 1e-12


def test_beta_logits_go_to_the_op(monkeypatch):
    """use_beta_sigmoid_in_kernel: the op gets the logits as the kernels read them (bf16 as they are, other
    floats as fp32) and beta_kind; the precomputed call passes no beta_kind; bad logits raise before the op."""
    got = []

    def fake(q, k, v, g, beta, h0, cu, scale, output_final_state, **kw):
        got.append((beta.dtype, kw.get("beta_kind")))
        return torch.zeros(q.shape, dtype=torch.bfloat16), torch.zeros(0)
    monkeypatch.setattr(op, "chunk_kda_fwd_op", fake)
    x = inputs([64], 2, 2, "beta-logits")
    q, k, v, g = x["q"], x["k"], x["v"], -torch.rand(1, 64, 2, D)
    for b, kw, want in ((x["b"], dict(use_beta_sigmoid_in_kernel=True), (torch.float32, kda.BETA_SIGMOID)),
                        (x["b"].bfloat16(), dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
                         (torch.bfloat16, kda.BETA_SIGMOID_2)),
                        (x["b"].half(), dict(use_beta_sigmoid_in_kernel=True), (torch.float32, kda.BETA_SIGMOID)),
                        (torch.rand(1, 64, 2).bfloat16(), {}, (torch.bfloat16, None))):
        kda_aot.chunk_kda(q, k, v, g, b, cu_seqlens=x["cu"], **kw)
        assert got.pop() == want
    with pytest.raises(TypeError, match="beta: the raw beta must be floating point"):
        kda_aot.chunk_kda(q, k, v, g, torch.ones(1, 64, 2, dtype=torch.int32), cu_seqlens=x["cu"],
                          use_beta_sigmoid_in_kernel=True)
    with pytest.raises(ValueError, match=r"beta: expected shape \[1, 64, 2\]"):
        kda_aot.chunk_kda(q, k, v, g, x["b"][:, :, :1], cu_seqlens=x["cu"], use_beta_sigmoid_in_kernel=True)
    with pytest.raises(TypeError, match="beta: expected dtype bfloat16"):  # fp32 beta is the logits' only
        kda_aot.chunk_kda(q, k, v, g, x["b"], cu_seqlens=x["cu"])
    assert not got


def test_beta_logits_grad_is_flas():
    """d(logits) from dbeta: FLA's fused_beta_sigmoid_bwd (dbeta scale s (1 - s), s the fp32 sigmoid), against
    autograd through the fp64 formula."""
    b = torch.randn(1000, dtype=torch.float64) * 4
    dbeta = torch.randn(1000)
    for kind, scale in ((kda.BETA_SIGMOID, 1.0), (kda.BETA_SIGMOID_2, 2.0)):
        x = b.clone().requires_grad_()
        (scale * torch.sigmoid(x) * dbeta.double()).sum().backward()
        assert rel_rms(kda.beta_logits_grad(dbeta, b.float(), kind), x.grad) < 1e-6
