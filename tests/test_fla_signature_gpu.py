"""FLA 0.6.0's chunk_kda call on the kernels: the gate in kernel (with and without safe_gate / lower_bound),
beta sigmoid in kernel (fp32 and bf16 logits; bitwise the precomputed call where the sigmoid is exact), allow_neg_eigval, state_v_first, GVA at HV / H = 2 and 4, the positional call; each against
the fp64 reference of FLA's formulas (tests/test_fla_signature.py writes them out), saved == replay
bitwise. With fla-core installed, `import kda_aot.fla` makes fla.ops.kda.chunk_kda run on kda_aot
(bitwise the direct call) and FLA_KDA_AOT=0 switches the backend off.

Bounds: relative RMS error against fp64, 1e-2 (the kernels' bf16 operands: measured ~3e-3 on these
packs, tests/test_kda_numerics_gpu.py); dbeta's logits 5e-2 (dbeta's heavy tail where its terms cancel);
dA_log per head against the scale of its sum (da_log_error)."""
import pytest
import torch

from conftest import gpu, import_fla
from reftools import fla_gate, rel_rms
from test_fla_signature import expected, inputs  # FLA's formulas, written out
import kda_aot

pytestmark = gpu
REL = 1e-2
BOUND = {"b": 5e-2, "A_log": 1e-4}  # dA_log: da_log_error's measure
LENS = [1, 63, 64, 65, 700, 37]


def on_cpu_f64(x: dict) -> dict:
    """x's tensors on the CPU, the floating ones in fp64 (boundaries stay integers)."""
    return {n: ((t.double() if t.is_floating_point() else t).cpu() if isinstance(t, torch.Tensor) else t)
            for n, t in x.items()}


def cuda_inputs(H, HV, tag):
    x = inputs(LENS, H, HV, tag)
    return {n: (t.cuda() if n != "cu" else t) for n, t in x.items()}


def da_log_error(got, want, cpu, lower_bound, activated):
    """dA_log's error per head over the Cauchy-Schwarz scale of its sum, the largest over heads.
    dA_log_h sums dG dG/dA_log_h over the head's N = T x 128 terms (dG: the activated gate's gradient), so an
    error e in the kernels' dG moves it by |e_h| |dG/dA_log_h| at most (REL at most, where dG meets REL) and by
    ~1/sqrt(N) of that where e is rounding, unaligned with dG/dA_log (~1e-5 at dG's measured 3e-3, N ~ 1e5);
    bound 1e-4. A dA_log left at zero scores ~2e-3 here. The relative error of the HV-element vector is no
    measure: its sums cancel (2e-3 to 1.4e-2 over draws of one case, the kernels and torch's activation alike)."""
    _, dg_act = activated
    a_log = cpu["A_log"]
    _, jac = torch.func.jvp(lambda a: fla_gate(cpu["g"], a, cpu["dt_bias"], lower_bound), (a_log,),
                            (torch.ones_like(a_log),))
    scale = (dg_act.square().sum(dim=(0, 1, 3)) * jac.square().sum(dim=(0, 1, 3))).sqrt()
    return ((got.double().cpu() - want).abs() / scale).max().item()


def fp64_error(n, got, want, cpu, lower_bound, activated):
    if n == "A_log":
        return da_log_error(got, want, cpu, lower_bound, activated)
    return rel_rms(got.cpu(), want)


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
    cpu = on_cpu_f64(x)
    cpu["q"], cpu["k"], cpu["v"] = (x[n].cpu() for n in ("q", "k", "v"))
    eo, es, egrads, act = expected(cpu, lower_bound=lower_bound, neg=neg, v_first=v_first, activated=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_rms(o.cpu(), eo) < REL and rel_rms(s.cpu(), es) < REL
    for n, want in egrads.items():
        err = fp64_error(n, grads[n], want, cpu, lower_bound, act)
        assert err < BOUND.get(n, REL), f"d{n}: {err:.2e}"
    so, ss, sgrads = run(x, disable_recompute=True, **kw)
    assert torch.equal(so, o) and torch.equal(ss, s)
    for n in grads:
        assert torch.equal(sgrads[n], grads[n]), f"saved and replay differ in d{n}"


def test_fla_dispatch_runs_kda_aot():
    fla_chunk = import_fla("fla.ops.kda").chunk_kda
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


TORCH_GATE = 1e-3  # the kernels' activation against torch's: see assert_as_the_torch_activation


def assert_as_the_torch_activation(x, o, s, grads, lower_bound):
    """The call on the raw gate (o, s, grads of x's leaves) gives what the same call on the gate activated in
    torch before the op gives (kda_aot.reference.kda_gate; autograd forms dA_log and ddt_bias from the
    kernels' dg), to TORCH_GATE relative RMS: the kernels' hardware ex2 / lg2 activation is an ulp or so off
    torch's libm one (~1e-7 absolute for sigmoid, an ulp of softplus), which moves a few bf16 roundings
    downstream; a dA_log or ddt_bias wrong in its formula or its sum is off by O(1)."""
    from kda_aot.reference import kda_gate
    leaves = {n: x[n].clone().requires_grad_() for n in grads}
    g_act = kda_gate(leaves["g"], leaves.get("A_log"), leaves["dt_bias"], lower_bound)
    to, ts = kda_aot.chunk_kda(leaves["q"], leaves["k"], leaves["v"], g_act, leaves["b"], None, leaves["h0"],
                               True, True, False, True, cu_seqlens=x["cu"])
    torch.autograd.backward((to, ts), (x["do"].to(torch.bfloat16), x["dht"]))
    assert rel_rms(o, to) < TORCH_GATE and rel_rms(s, ts) < TORCH_GATE, (rel_rms(o, to), rel_rms(s, ts))
    for n in grads:
        err = rel_rms(grads[n], leaves[n].grad)
        assert err < TORCH_GATE, f"d{n} against the torch activation: {err:.2e}"


@pytest.mark.parametrize("lower_bound,with_a_log", [(-3.0, True), (-3.0, False)])
def test_sigmoid_gate_in_the_kernels(lower_bound, with_a_log):
    """The sigmoid kind (lower_bound sigmoid(exp(A_log) (g + dt_bias)), A_log optional) against FLA's
    formula in fp64, its dA_log included, and against torch's activation of it; saved == replay bitwise."""
    x = cuda_inputs(4, 4, ("sigmoid-gate", with_a_log))
    names = ("q", "k", "v", "g", "b", "h0", "dt_bias") + (("A_log",) if with_a_log else ())
    leaves = {n: x[n].clone().requires_grad_() for n in names}

    def call(mode):
        for t in leaves.values():
            t.grad = None
        o, s = kda_aot.chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["b"], None, leaves["h0"],
                                 True, True, True, True, lower_bound=lower_bound, cu_seqlens=x["cu"],
                                 A_log=leaves.get("A_log"), dt_bias=leaves["dt_bias"], backward=mode)
        torch.autograd.backward((o, s), (x["do"].to(torch.bfloat16), x["dht"]))
        return o, s, {n: leaves[n].grad.clone() for n in names}
    o, s, grads = call("replay")
    assert_as_the_torch_activation(x, o, s, grads, lower_bound)
    cpu = on_cpu_f64(x)
    cpu["q"], cpu["k"], cpu["v"] = (x[n].cpu() for n in ("q", "k", "v"))
    if not with_a_log:
        cpu["A_log"] = None
    eo, es, egrads, act = expected(cpu, lower_bound=lower_bound, neg=False, v_first=False, activated=True)
    assert rel_rms(o.cpu(), eo) < REL and rel_rms(s.cpu(), es) < REL
    for n in ("g", "dt_bias") + (("A_log",) if with_a_log else ()):
        err = fp64_error(n, grads[n], egrads[n], cpu, lower_bound, act)
        assert err < BOUND.get(n, REL), f"d{n}: {err:.2e}"
    so, ss, sgrads = call("saved")
    assert torch.equal(so, o) and torch.equal(ss, s)
    for n in grads:
        assert torch.equal(sgrads[n], grads[n]), f"saved and replay differ in d{n}"


@pytest.mark.parametrize("strong", [False, True])
def test_gate_in_the_kernels_against_the_torch_activation(strong):
    """The softplus kind, the raw gate activated inside kda_fwd_chunk / kda_bwd_gate, against torch's
    activation (assert_as_the_torch_activation) and the fp64 bounds. strong: A_log such that the gate
    reaches ~-30 (the floor, the first tokens' decay)."""
    from kda_aot.reference import kda_gate
    x = cuda_inputs(4, 4, ("gate-in-kernel", strong))
    if strong:
        x["A_log"] = x["A_log"] + 3.0
    o, s, grads = run(x)
    assert_as_the_torch_activation(x, o, s, grads, None)
    cpu = on_cpu_f64(x)
    cpu["q"], cpu["k"], cpu["v"] = (x[n].cpu() for n in ("q", "k", "v"))
    eo, es, egrads, act = expected(cpu, lower_bound=None, neg=False, v_first=False, activated=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_rms(o.cpu(), eo) < REL and rel_rms(s.cpu(), es) < REL
    for n in ("g", "A_log", "dt_bias"):
        assert torch.isfinite(grads[n]).all()
        err = fp64_error(n, grads[n], egrads[n], cpu, None, act)
        assert err < BOUND.get(n, REL), f"d{n}: {err:.2e}"
    g_min = kda_gate(x["g"].float(), x["A_log"], x["dt_bias"], None).min().item()
    assert not strong or g_min < -25, g_min


@pytest.mark.parametrize("form", ["split_staged", "full"])
@pytest.mark.parametrize("lower_bound", [None, -3.0], ids=["softplus", "sigmoid"])
@pytest.mark.parametrize("mode,groups", [("replay", {}), ("replay", {"max_heads": 1}), ("replay", {"max_tokens": 200}),
                                         ("replay", {"max_heads": 2, "max_tokens": 200}), ("saved", {})],
                         ids=["replay", "replay-head-groups", "replay-segment-runs", "replay-tiles", "saved"])
def test_a_bf16_raw_gate_is_read_as_it_is(kda_options, monkeypatch, form, lower_bound, mode, groups):
    """A bf16 raw gate (as FLA's f_proj gives it) reaches kda_fwd_chunk and kda_bwd_gate as it is, no fp32
    copy (their launches are watched): every output and gradient bitwise what its exact fp32 copy gives, dg in
    bf16 (the fp32 copy's, rounded once), in every kda_bwd_gate form, both gate kinds and both modes; the replay
    in head groups and in runs of whole segments also bitwise the saved mode (dA_log and ddt_bias summed over one
    shape in both)."""
    from kda_aot._runtime import registry
    from kda_aot._runtime.tensor import DTYPE_CODES
    kda_options(gate_form=form, **groups)
    x = cuda_inputs(4, 4, ("bf16-gate", form, lower_bound, mode, tuple(groups.items())))
    raw = x["g"].to(torch.bfloat16)
    names = ("q", "k", "v", "g", "b", "h0", "A_log", "dt_bias")

    def call(g, backward):
        leaves = {n: x[n].clone().requires_grad_() for n in names}
        leaves["g"] = g.clone().requires_grad_()
        o, s = kda_aot.chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["b"], None, leaves["h0"],
                                 True, True, True, True, lower_bound=lower_bound, safe_gate=lower_bound is not None,
                                 cu_seqlens=x["cu"], A_log=leaves["A_log"], dt_bias=leaves["dt_bias"],
                                 backward=backward)
        torch.autograd.backward((o, s), (x["do"].to(torch.bfloat16), x["dht"]))
        return o, s, {n: leaves[n].grad for n in names}

    seen, library = [], registry.library

    class Watched:
        def __init__(self, program, form, device):
            self.program, self.lib = program, library(program, form, device)

        def launch(self, desc, *args, **kw):
            if "g" in desc:
                seen.append((self.program, desc["g"][1]))  # (ptr, dtype code, ...)
            return self.lib.launch(desc, *args, **kw)
    monkeypatch.setattr(registry, "library", lambda program, form="default", device=None: Watched(program, form, device))
    o16, s16, d16 = call(raw, mode)
    monkeypatch.setattr(registry, "library", library)
    bf16_reads = {p for p, code in seen if code == DTYPE_CODES[torch.bfloat16]}
    assert {"kda_fwd_chunk", "kda_bwd_gate"} <= bf16_reads, seen
    o32, s32, d32 = call(raw.float(), mode)
    assert torch.equal(o16, o32) and torch.equal(s16, s32)
    assert d16["g"].dtype == torch.bfloat16 and torch.equal(d16["g"], d32["g"].to(torch.bfloat16))
    for n in names:
        if n != "g":
            assert torch.equal(d16[n], d32[n]), f"d{n}: the bf16 raw gate's differs from its fp32 copy's"
    if groups:
        _, _, saved = call(raw, "saved")
        for n in names:
            assert torch.equal(saved[n], d16[n]), f"d{n}: the replay in {groups} differs from the saved mode"


@pytest.mark.parametrize("neg", [False, True], ids=["sigmoid", "2sigmoid"])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode,groups", [("replay", {}), ("replay", {"max_heads": 1}), ("replay", {"max_tokens": 200}),
                                         ("replay", {"max_heads": 2, "max_tokens": 200}), ("saved", {})],
                         ids=["replay", "replay-head-groups", "replay-segment-runs", "replay-tiles", "saved"])
def test_beta_sigmoid_in_the_kernels(kda_options, monkeypatch, neg, logits_dtype, mode, groups):
    """use_beta_sigmoid_in_kernel: the logits go into the kernels as they are (no activated beta in memory; every
    program that reads beta gets beta_kind), and
    - at logits whose sigmoid is exact (0, +-inf: beta 1/2, 1, 0; 2 sigmoid 1, 2, 0) o, the final state and every
      gradient but beta's are bitwise the precomputed call's on that beta in bf16, the precomputed call's
      launches take no beta_kind (its path is the one it was), and d(logits) = dbeta scale s (1 - s);
    - at random logits, against torch's libm fp32 sigmoid through the fp64 reference (FLA's formulas), REL;
    - saved == replay (and the replay a head at a time, or a segment at a time) bitwise."""
    from kda_aot._runtime import registry
    if groups:
        kda_options(**groups)
    x = cuda_inputs(4, 4, ("beta-in-kernel", neg))
    scale_b = 2.0 if neg else 1.0
    names = ("q", "k", "v", "g", "b", "h0")
    seen, library = [], registry.library

    class Watched:
        def __init__(self, program, form, device):
            self.program, self.lib = program, library(program, form, device)

        def launch(self, desc, *args, **kw):
            seen.append((self.program, kw.get("beta_kind")))
            return self.lib.launch(desc, *args, **kw)
    monkeypatch.setattr(registry, "library", lambda program, form="default", device=None: Watched(program, form, device))

    def call(b, mode, sigmoid):
        leaves = {n: (b if n == "b" else x[n]).clone().requires_grad_() for n in names}
        g = -torch.nn.functional.softplus(leaves["g"])  # a log decay, activated outside the op
        o, s = kda_aot.chunk_kda(leaves["q"], leaves["k"], leaves["v"], g, leaves["b"], None, leaves["h0"], True,
                                 True, False, sigmoid, neg and sigmoid, cu_seqlens=x["cu"], backward=mode)
        torch.autograd.backward((o, s), (x["do"].to(torch.bfloat16), x["dht"]))
        return o, s, {n: leaves[n].grad.clone() for n in names}

    exact = torch.tensor([0.0, float("inf"), float("-inf")], device="cuda")
    logits = exact[torch.randint(0, 3, x["b"].shape, device="cuda")].to(logits_dtype)
    o, s, grads = call(logits, mode, True)
    reads_beta = ("kda_fwd_chunk", "kda_bwd_chunk", "kda_bwd_gate")
    assert {p for p, _ in seen} >= set(reads_beta), seen
    assert all(k == ((2 if neg else 1) if p in reads_beta else None) for p, k in seen), seen
    seen.clear()
    beta = (scale_b * torch.sigmoid(logits.float())).to(torch.bfloat16)  # exact in bf16 at these logits
    po, ps, pgrads = call(beta, mode, False)
    assert all(k is None for _, k in seen), seen
    assert torch.equal(o, po) and torch.equal(s, ps)
    for n in ("q", "k", "v", "g", "h0"):
        assert torch.equal(grads[n], pgrads[n]), f"d{n} differs from the precomputed call's"
    sig = torch.sigmoid(logits.float())
    want = (pgrads["b"].float() * scale_b * sig * (1.0 - sig)).to(logits_dtype)
    assert rel_rms(grads["b"], want) < REL and grads["b"].dtype == logits_dtype

    b = x["b"].to(logits_dtype)
    o, s, grads = call(b, mode, True)
    cpu = on_cpu_f64(x)
    cpu["q"], cpu["k"], cpu["v"] = (x[n].cpu() for n in ("q", "k", "v"))
    cpu["b"] = b.float().cpu()
    eo, es, egrads = expected_precomputed_gate(cpu, neg)
    assert rel_rms(o.cpu(), eo) < REL and rel_rms(s.cpu(), es) < REL
    for n, want in egrads.items():
        assert rel_rms(grads[n].cpu(), want) < BOUND.get(n, REL), f"d{n}: {rel_rms(grads[n].cpu(), want):.2e}"
    other = call(b, "saved" if mode == "replay" else "replay", True)
    assert torch.equal(other[0], o) and torch.equal(other[1], s)
    for n in names:
        assert torch.equal(other[2][n], grads[n]), f"saved and replay differ in d{n}"


def expected_precomputed_gate(cpu, neg):
    """FLA's formulas in fp64 for the call above (l2norm, log decay -softplus(g), beta FLA's fp32 sigmoid of the
    logits): o, the final state and the gradients of q, k, v, g, the logits, h0."""
    from kda_aot import reference
    from test_fla_signature import l2norm_as_the_kernel
    leaves = {n: cpu[n].double().requires_grad_() for n in ("q", "k", "v", "g", "b", "h0")}
    q, k = l2norm_as_the_kernel(leaves["q"]), l2norm_as_the_kernel(leaves["k"])
    beta = (2.0 if neg else 1.0) * torch.sigmoid(leaves["b"])
    in_fp32 = ((2.0 if neg else 1.0) * torch.sigmoid(cpu["b"].float())).double()  # FLA's fp32 beta, unrounded
    beta = beta + (in_fp32 - beta).detach()
    o, s = reference.kda_chunked(q, k, leaves["v"], -torch.nn.functional.softplus(leaves["g"]),
                                 beta, cu_seqlens=cpu["cu"].tolist(), initial_state=leaves["h0"],
                                 output_final_state=True, dtype=torch.float64)
    ((o * cpu["do"]).sum() + (s * cpu["dht"]).sum()).backward()
    return o.detach(), s.detach(), {n: t.grad for n, t in leaves.items()}
