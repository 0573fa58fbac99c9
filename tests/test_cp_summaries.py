"""compose_pieces (kda_aot.cp.summaries), CPU: a fragment's summary from the summaries of its
chunk-aligned pieces equals the fragment's own (reference.fragment_summary), in fp64 to rounding
(1e-10) and with the pieces rounded to fp32 within the fp32 summary bound the CP tests use (1e-4).
Fresh random inputs every run (seed printed by conftest)."""
import pytest
import torch

from conftest import SEED
from kda_aot import reference
from kda_aot.cp.summaries import compose_pieces


def fragment(length: int, H: int, K: int, gen):
    k = torch.nn.functional.normalize(torch.randn(length, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(length, H, K, generator=gen, dtype=torch.float64)
    # mild decay (g in [-0.03, -0.001] per token): M keeps entries well inside the fp32 range over
    # the few hundred tokens here, so a relative bound on M means something
    g = -torch.exp(torch.empty(length, H, K, dtype=torch.float64).uniform_(-7, -3.5, generator=gen))
    beta = torch.rand(length, H, generator=gen, dtype=torch.float64)
    return k, v, g, beta


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("chunks_per_piece", [[3], [1, 1, 1], [2, 1, 3], [4, 1]])
def test_pieces_compose_to_the_fragment(chunks_per_piece):
    gen = torch.Generator().manual_seed(SEED + sum(chunks_per_piece) * 131 + len(chunks_per_piece))
    H, K, C = 2, 16, 64
    length = C * (sum(chunks_per_piece) - 1) + 37  # the last chunk partial
    k, v, g, beta = fragment(length, H, K, gen)
    whole_M, whole_B = reference.fragment_summary(k, v, g, beta)
    bounds = [0]
    for n in chunks_per_piece:
        bounds.append(min(length, bounds[-1] + C * n))
    parts = [reference.fragment_summary(k[a:b], v[a:b], g[a:b], beta[a:b]) for a, b in zip(bounds, bounds[1:])]
    for dtype, bound in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        M = torch.stack([m for m, _ in parts]).to(dtype)
        B = torch.stack([b for _, b in parts]).to(dtype)
        (Mf, Bf), = compose_pieces(M, B, [len(parts)])
        assert Mf.dtype == dtype and rel(Mf, whole_M) < bound and rel(Bf, whole_B) < bound, (dtype, SEED)
        (Mo, none), = compose_pieces(M, None, [len(parts)])
        assert none is None and torch.equal(Mo, Mf)


def test_several_fragments_in_one_call():
    """counts splits the stacked pieces between fragments, in order."""
    gen = torch.Generator().manual_seed(SEED + 7)
    H, K = 1, 8
    frags = [fragment(n, H, K, gen) for n in (100, 64, 200)]
    counts = [2, 1, 3]
    pieces, want = [], []
    for (k, v, g, beta), n in zip(frags, counts):
        want.append(reference.fragment_summary(k, v, g, beta))
        cut = [0] + [min(len(k), 64 * (i + 1)) for i in range(n - 1)] + [len(k)]
        pieces += [reference.fragment_summary(k[a:b], v[a:b], g[a:b], beta[a:b]) for a, b in zip(cut, cut[1:])]
    got = compose_pieces(torch.stack([m for m, _ in pieces]), torch.stack([b for _, b in pieces]), counts)
    assert len(got) == 3
    for (M, B), (wM, wB) in zip(got, want):
        assert rel(M, wM) < 1e-10 and rel(B, wB) < 1e-10
