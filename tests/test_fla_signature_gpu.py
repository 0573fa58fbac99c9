"""FLA 0.6.0's chunk_kda call on the kernels: the gate in kernel (with and without safe_gate / lower_bound),
beta sigmoid, allow_neg_eigval, state_v_first, GVA at HV / H = 2 and 4, the positional call; each against
the fp64 reference of FLA's formulas (tests/test_fla_signature.py writes them out), saved == replay
bitwise. With fla-core installed, `import kda_aot.fla` makes fla.ops.kda.chunk_kda run on kda_aot
(bitwise the direct call) and FLA_KDA_AOT=0 switches the backend off.

Bounds: relative RMS error against fp64, 1e-2 (the kernels' bf16 operands: measured ~3e-3 on these
packs, tests/test_kda_numerics_gpu.py); dbeta's logits 5e-2 (dbeta's heavy tail where its terms cancel)."""
import pytest
import torch

from conftest import gpu
from test_fla_signature import expected, inputs  # FLA's formulas, written out
import kda_aot

pytestmark = gpu
REL = 1e-2
BOUND = {"b": 5e-2}
LENS = [1, 63, 64, 65, 700, 37]


def rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def cuda_inputs(H, HV, tag):
    x = inputs(LENS, H, HV, tag)
    return {n: (t.cuda() if n != "cu" else t) for n, t in x.items()}


def run(x, **kw):
    names = ("q", "k", "v", "g", "b", "h0", "A_log", "dt_bias")
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    o, s = kda_aot.chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["b"], None, leaves["h0"],
                             True, True, True, True, cu_seqlens=x["cu"], A_log=leaves["A_log"],
                             dt_bias=leaves["dt_bias"], **kw)
    torch.autograd.backward((o, s), (x["do"].to(torch.bfloat16), x["dht"]))
    return o, s, {n: leaves[n].grad for n in names}


@pytest.mark.parametrize("H,HV,lower_bound,neg,v_first", [
    (4, 4, None, False, False), (4, 8, None, True, True), (2, 8, -5.0, False, True), (4, 4, -2.0, True, False)],
    ids=["layer", "gva2-neg-vfirst", "gva4-safe-vfirst", "safe-neg"])
def test_fla_call_on_the_kernels(H, HV, lower_bound, neg, v_first):
    x = cuda_inputs(H, HV, ("gpu", HV, lower_bound, neg))
    kw = dict(lower_bound=lower_bound, safe_gate=lower_bound is not None, allow_neg_eigval=neg, state_v_first=v_first)
    o, s, grads = run(x, **kw)
    cpu = {n: (t.double().cpu() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    cpu["q"], cpu["k"], cpu["v"] = (x[n].cpu() for n in ("q", "k", "v"))
    eo, es, egrads = expected(cpu, lower_bound=lower_bound, neg=neg, v_first=v_first)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_rms(o.cpu(), eo) < REL and rel_rms(s.cpu(), es) < REL
    for n, want in egrads.items():
        err = rel_rms(grads[n].cpu(), want)
        assert err < BOUND.get(n, REL), f"d{n}: {err:.2e}"
    so, ss, sgrads = run(x, disable_recompute=True, **kw)
    assert torch.equal(so, o) and torch.equal(ss, s)
    for n in grads:
        assert torch.equal(sgrads[n], grads[n]), f"saved and replay differ in d{n}"


def test_fla_dispatch_runs_kda_aot():
    fla_chunk = pytest.importorskip("fla.ops.kda").chunk_kda
    import kda_aot.fla  # noqa: F401  (registers the backend)
    x = cuda_inputs(4, 4, "dispatch")
    args = (x["q"], x["k"], x["v"], x["g"], x["b"])
    kw = dict(initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, cu_seqlens=x["cu"].cuda().long(), A_log=x["A_log"], dt_bias=x["dt_bias"])
    ours, ours_s = kda_aot.chunk_kda(*args, **kw)
    via, via_s = fla_chunk(*args, **kw)
    assert torch.equal(via, ours) and torch.equal(via_s, ours_s)
    # FLA_KDA_AOT=0: FLA's dispatch skips the backend (is_enabled reads the switch at each call)
    import os
    from inspect import unwrap
    from fla import backends
    backend = backends._function_registries[unwrap(fla_chunk)]._backends["kda_aot"]
    assert backend.is_enabled()
    os.environ["FLA_KDA_AOT"] = "0"
    try:
        assert not backend.is_enabled()
    finally:
        del os.environ["FLA_KDA_AOT"]
