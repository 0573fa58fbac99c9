"""FLA's own KimiDeltaAttention layer (fla-core 0.6.0, mode="chunk") trained with `import kda_aot.fla`, as a user
of FLA runs it: a padded pack (an empty document, one of a token, one across many chunks), `y.sum().backward()`.
Its chunk_kda call and its three short convolutions run on kda_aot (counted), its output and every gradient agree
with the same layer on FLA's own kernels (FLA_KDA_AOT=0), and the layer under torch.compile (default mode: FLA
wraps its conv and norm ops in torch.compiler.disable, so fullgraph=True stops there with either backend) gives
what the eager layer gives.

Bounds: against FLA's kernels 2e-2 relative RMS (two bf16 pipelines with different roundings, each ~3e-3 off
fp64 per op, through the layer's projections and norm; measured 6.4e-3 on the H200); compiled against eager 5e-3
(inductor fuses FLA's elementwise ops and norm differently; measured 1.0e-3).

On a fresh machine FLA's Triton kernels autotune for these shapes first: ~4 min (carry the Triton cache, as
bench/device_env.sh does)."""
import torch

from conftest import gpu, import_fla, seed_of
from reftools import rel_rms

pytestmark = gpu
AGAINST_FLA = 2e-2
COMPILED = 5e-3


LENS = [1, 63, 64, 65, 2000, 0, 700]  # an empty document, one of a token, one across many chunks


def served_layer(monkeypatch, seed, dtype):
    """FLA's layer (the shapes of bench/device_wheel.sh's layer step: one FLA autotune serves every test) with its
    parameters in dtype, the counts of the calls kda_aot serves, the pack's cu_seqlens and an input x."""
    import_fla("fla")
    import_fla("einops")
    from bench.fla_layer import count_kda_aot_calls, kda_layer_class
    served = count_kda_aot_calls(monkeypatch.setattr)
    monkeypatch.delenv("FLA_KDA_AOT_CONV", raising=False)
    torch.manual_seed(seed)
    layer = kda_layer_class()(hidden_size=1024, head_dim=128, num_heads=8, mode="chunk").cuda().to(dtype)
    cu = torch.tensor([0] + LENS, device="cuda").cumsum(0)
    x = torch.randn(1, sum(LENS), 1024, device="cuda", dtype=dtype, requires_grad=True)
    return layer, served, cu, x


def test_fla_layer_trains_on_kda_aot_eager_and_compiled(monkeypatch):
    layer, served, cu, x = served_layer(monkeypatch, seed_of("fla-layer-bf16"), torch.bfloat16)

    def step(module):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = module(x, cu_seqlens=cu)[0]
        y.sum().backward()
        return {"y": y.detach(), "dx": x.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}

    monkeypatch.setenv("FLA_KDA_AOT", "0")
    fla_own = step(layer)
    assert not any(served.values()), served
    monkeypatch.setenv("FLA_KDA_AOT", "1")
    eager = step(layer)
    assert served == {"chunk_kda": 1, "conv1d_silu_fwd_op": 3, "conv1d_silu_bwd_op": 3}, served
    for name, ref in fla_own.items():
        assert torch.isfinite(eager[name]).all(), name
        e = rel_rms(eager[name], ref)
        assert e < AGAINST_FLA, f"{name}: {e:.2e} from FLA's kernels"
    torch._dynamo.reset()
    compiled = step(torch.compile(layer))
    assert served == {"chunk_kda": 2, "conv1d_silu_fwd_op": 6, "conv1d_silu_bwd_op": 6}, served
    for name, ref in eager.items():
        e = rel_rms(compiled[name], ref)
        assert e < COMPILED, f"{name}: compiled {e:.2e} from eager"
    torch._dynamo.reset()


def test_fla_layer_mixed_precision_checkpointed_on_kda_aot(monkeypatch):
    """The layer as mixed-precision training runs it: fp32 parameters, the step under torch.autocast(bfloat16) and
    activation checkpointing (non-reentrant: the forward runs again in the backward). Every gradient is finite,
    the layer's calls are served (the recomputed forward too), and the output and every gradient agree
    with the same step on FLA's kernels (the bound above: autocast casts the same matmuls in both arms)."""
    from torch.utils.checkpoint import checkpoint
    layer, served, cu, x = served_layer(monkeypatch, seed_of("fla-layer-mixed"), torch.float32)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = checkpoint(lambda h: layer(h, cu_seqlens=cu)[0], x, use_reentrant=False)
        y.float().sum().backward()
        return {"y": y.detach(), "dx": x.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}

    monkeypatch.setenv("FLA_KDA_AOT", "0")
    fla_own = step()
    assert not any(served.values()), served
    monkeypatch.setenv("FLA_KDA_AOT", "1")
    ours = step()
    assert served == {"chunk_kda": 2, "conv1d_silu_fwd_op": 6, "conv1d_silu_bwd_op": 3}, served
    errors = {}
    for name, ref in fla_own.items():
        assert torch.isfinite(ours[name]).all(), name
        errors[name] = rel_rms(ours[name], ref)
    print("relative RMS from FLA's kernels:", {n: f"{e:.1e}" for n, e in errors.items()})
    assert max(errors.values()) < AGAINST_FLA, errors
