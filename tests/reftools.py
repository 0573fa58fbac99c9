"""Helpers shared by the tests: the error measures, and the reference-math tests' inputs (CPU, fp64 by default)."""
import torch
import torch.nn.functional as F

F64 = torch.float64


def floor_of(got) -> float:
    """The reference scale below which an error is taken as absolute: for a result narrower than fp64, 1e-30 - there
    it sits at the bottom of fp32's range (a long document's decay products underflow to 0), where a relative error
    measures the format, not the kernel; for an fp64 result, 1e-300."""
    return 1e-300 if got.dtype == torch.float64 else 1e-30


def rel_rms(got, want) -> float:
    """||got - want|| / max(||want||, floor_of(got)), in fp64: the normwise relative error the bounds are stated in."""
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(floor_of(got))).item()


def rel_err(got, want) -> float:
    """max |got - want| / max(max |want|, floor_of(got)), in fp64: the elementwise measure of the reference-math
    tests."""
    want = want.double()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(floor_of(got))).item()


def rand_lens(gen, fixed=(1, 2, 63, 64, 65, 130), n_random=2, hi=200):
    lens = list(fixed) + torch.randint(1, hi, (n_random,), generator=gen).tolist()
    return [lens[i] for i in torch.randperm(len(lens), generator=gen).tolist()]


def cu_of(lens, dtype=torch.int32):
    return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(dtype)


def make_inputs(gen, lens, H, K, V, g_mode="rand", init=False, dtype=F64):
    T = sum(lens)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen, dtype=dtype)
    if g_mode == "neg5":
        g = torch.full((1, T, H, K), -5.0, dtype=dtype)
    elif g_mode == "zero":
        g = torch.zeros(1, T, H, K, dtype=dtype)
    elif g_mode == "mild":  # long memory: states many chunks back still matter
        g = -0.05 * torch.rand(1, T, H, K, generator=gen, dtype=dtype)
    else:
        g = -5.0 * torch.rand(1, T, H, K, generator=gen, dtype=dtype)
    beta = 0.01 + 0.98 * torch.rand(1, T, H, generator=gen, dtype=dtype)
    h0 = torch.randn(len(lens), H, K, V, generator=gen, dtype=dtype) if init else None
    return q, k, v, g, beta, h0


def fla_gate(g, A_log, dt_bias, lower_bound=None):
    """FLA 0.6.0's gate activation written out (independently of kda_aot.ops.gate): g, dt_bias [.., HV, K],
    A_log [HV] (None with lower_bound: exp(A_log) = 1)."""
    HV, K = g.shape[-2], g.shape[-1]
    raw = g + dt_bias.view(HV, K)
    if lower_bound is None:
        return -A_log.exp().view(HV, 1) * F.softplus(raw)
    return lower_bound * torch.sigmoid(raw if A_log is None else A_log.exp().view(HV, 1) * raw)


def fla_beta(b, allow_neg_eigval=False):
    """FLA's beta from its logits: sigmoid, times 2 with allow_neg_eigval."""
    return (2.0 if allow_neg_eigval else 1.0) * torch.sigmoid(b)


def fla_heads(x, value_heads):
    """q or k [.., H, K] per value head (value head j reads head j // (HV / H))."""
    return x[:, :, torch.arange(value_heads) // (value_heads // x.shape[2])]
