"""compose_pieces (kda_aot.cp.summaries), CPU: a fragment's summary from the summaries of its
chunk-aligned pieces equals the fragment's own (reference.fragment_summary), in fp64 to rounding
(1e-10) and with the pieces rounded to fp32 within the fp32 summary bound the CP tests use (1e-4).
Fresh random inputs every run (seed printed by conftest)."""
import pytest
import torch

from conftest import SEED, generator
from reftools import rel_rms
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


@pytest.mark.parametrize("chunks_per_piece", [[3], [1, 1, 1], [2, 1, 3], [4, 1]])
def test_pieces_compose_to_the_fragment(chunks_per_piece):
    gen = generator(("pieces", tuple(chunks_per_piece)))
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
        assert Mf.dtype == dtype and rel_rms(Mf, whole_M) < bound and rel_rms(Bf, whole_B) < bound, (dtype, SEED)
        (Mo, none), = compose_pieces(M, None, [len(parts)])
        assert none is None and torch.equal(Mo, Mf)


def test_several_fragments_in_one_call():
    """counts splits the stacked pieces between fragments, in order."""
    gen = generator("several-fragments")
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
        assert rel_rms(M, wM) < 1e-10 and rel_rms(B, wB) < 1e-10


def test_batched_summaries_gather_the_pieces(monkeypatch):
    """CudaBackend.summaries_of's bookkeeping on the CPU: the walks are replaced by the fp64
    reference over the tokens of each view segment's chunk rows (which must be consecutive chunks
    of one segment, with gamma rows gathered alongside), so the composed summaries must equal each
    requested segment's own summary to fp64 rounding, for pieces planned on a larger set."""
    from kda_aot.schedule import fit, kda
    from kda_aot.cp.backends import CudaBackend
    from kda_aot._runtime.packing import pack_tables

    gen = generator("batched-pieces")
    H, K = 2, 8
    lens = [130, 5000, 65, 3000, 1]
    T = sum(lens)
    k, v, g, beta = fragment(T, H, K, gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    tables = pack_tables(cu, T, "cpu")
    C = tables.chunks.shape[0]
    prepared = {"q": torch.zeros(1, T, H, K), "v": torch.zeros(1, T, H, K), "chunks": tables.chunks, "seg_chunks": tables.seg_chunks,
                "chain_lengths": tables.chain_lengths,
                "gamma": torch.arange(C, dtype=torch.float64).view(C, 1, 1).expand(C, H, K).contiguous()}
    starts = tables.chunks[:, 0].tolist()

    def walk_pieces(view):
        Ms, Bs = [], []
        seg = view["seg_chunks"].tolist()
        for a, b in zip(seg, seg[1:]):
            rows = view["chunks"][a:b]
            assert torch.equal(view["gamma"][a:b, 0, 0], torch.tensor([starts.index(t) for t in rows[:, 0].tolist()],
                                                                      dtype=torch.float64))
            assert all(rows[i, 1] == rows[i + 1, 0] for i in range(len(rows) - 1))  # consecutive chunks
            lo, hi = int(rows[0, 0]), int(rows[-1, 1])
            M, B = reference.fragment_summary(k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi])
            Ms.append(M)
            Bs.append(B)
        return torch.stack(Ms), torch.stack(Bs)

    monkeypatch.setattr(kda, "device_sms", lambda device: 132)
    monkeypatch.setattr(kda, "chunk_kda_walk", lambda view, **kw: (None, walk_pieces(view)[1], None))
    monkeypatch.setattr(kda, "chunk_kda_transfer", lambda view: walk_pieces(view)[0])
    plan = [0, 1, 3, 4]
    chunks = tuple(int(tables.chain_lengths[s]) for s in plan)
    assert max(fit.summary_pieces(chunks, H, 132)) > 1
    got = CudaBackend().summaries_of(prepared, [(1, True), (3, False), (4, True)], plan)
    for seg, (M, B), want_b in zip((1, 3, 4), got, (True, False, True)):
        lo, hi = int(cu[seg]), int(cu[seg + 1])
        wM, wB = reference.fragment_summary(k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi])
        assert rel_rms(M, wM) < 1e-10, seg
        assert (B is None) if not want_b else rel_rms(B, wB) < 1e-10, seg
