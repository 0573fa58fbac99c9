"""Context-parallel plan: who holds which tokens, and the fragment table (docs/cp.md).

One implementation used by every path (the reference, the gloo tests, the CUDA backend). A plan
is a pure function of (cu_seqlens, world size, layout, chunk size); the rank only selects which
part of it is "local". Every rank can therefore compute the whole fragment table without
communicating, which is what lets the exchanges pad and unpack without a size round trip.

Layouts (W ranks, T tokens, chunk C = 64):
    contiguous   rank r holds tokens [r*T/W, (r+1)*T/W)                       (T % W == 0)
    zigzag       T in 2W equal parts; rank r holds parts r and 2W-1-r        (T % 2W == 0)
    doc_zigzag   every document's chunks in 2W pieces of whole chunks, as equal as possible
                 (sizes differ by at most one chunk, short documents leave pieces empty);
                 rank r holds pieces r and 2W-1-r of every document.

doc_zigzag remainder rule: a document of n chunks gives every piece n // 2W chunks and hands
the m = n % 2W extra chunks one by one to ranks (c, c+1, ...) mod W, first to the rank's early
piece r, then (when m > W) to its late piece 2W-1-r. The start rank c carries over from one
document to the next (c += m). Why: with a fixed rule every one-chunk document would land on
the same rank; rotating keeps every rank's chunk count over the whole pack within one chunk.

A fragment is the part of one document that one rank holds in one contiguous piece: a rank's
held ranges are cut at document boundaries and adjacent ranges of the same document are merged
(rank W-1 always holds two adjacent pieces; W = 1 gives one fragment per document, exactly the
single-device segmentation). Chunks restart at every fragment start.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .._runtime.packing import CHUNK
from .._runtime.tensor import boundaries_tensor, check_cu_seqlens
from . import keys

__all__ = ["LAYOUTS", "CHUNK", "Fragment", "CPPlan", "make_plan"]

LAYOUTS = ("contiguous", "zigzag", "doc_zigzag")


@dataclass(frozen=True)
class Fragment:
    """One fragment of the table. `start`/`end` are global token indices; `local_start` is the
    offset of its first token in its owner's local tensors; `segment` its index in the owner's
    local cu_seqlens; `position` its place in its document's chain (0 = starts the document)."""
    index: int          # position in the plan's fragment table (global order)
    doc: int
    start: int
    end: int
    rank: int
    segment: int
    local_start: int
    position: int
    needs_state: bool   # position > 0: enters with the state left by the previous fragment
    is_last: bool       # ends its document: nobody waits for its state

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class CPPlan:
    """The context-parallel plan seen from `rank`. Build it with `make_plan`.

    `fragments` lists every fragment of every rank in global token order (so the fragments of
    one document are consecutive and in chain order). Everything else is derived from it.
    """
    cu_seqlens: Tuple[int, ...]
    layout: str
    world_size: int
    rank: int
    chunk_size: int
    fragments: Tuple[Fragment, ...]

    # ------------------------------------------------------------------ derived, computed once
    @functools.cached_property
    def digest(self) -> str:
        """What check_agreement compares of the boundaries (a hash: every call would otherwise hash them)."""
        return (f"sha256 {hashlib.sha256(repr(self.cu_seqlens).encode()).hexdigest()[:12]}"
                f" (T = {self.total_tokens}, {self.num_docs} documents)")

    def __post_init__(self):
        # the key the CP custom ops know this plan by, as the tensor they take (kda_aot.cp.keys); not fields:
        # plans compare by value
        object.__setattr__(self, "key_tensor", keys.key_tensor(keys.register(self)))

    def __getstate__(self):
        # the memo's device tables stay with the process that made them (and its cached digest is cheap)
        return {k: v for k, v in self.__dict__.items() if k not in ("_memo", "digest", "key_tensor")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__post_init__()

    def memo(self, key, make):
        """make() once per key for this plan (the exchanges' device tables, by device): a step under CP
        builds no host table and copies nothing to the device after its first call on a plan."""
        memo = self.__dict__.setdefault("_memo", {})
        if key not in memo:
            memo[key] = make()
        return memo[key]

    # ------------------------------------------------------------------ sizes
    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    def fragments_of(self, rank: int) -> Tuple[Fragment, ...]:
        """The fragments `rank` holds, in its local order (increasing global start)."""
        return tuple(f for f in self.fragments if f.rank == rank)

    @property
    def local_fragments(self) -> Tuple[Fragment, ...]:
        return self.fragments_of(self.rank)

    def num_tokens_of(self, rank: int) -> int:
        return sum(f.length for f in self.fragments_of(rank))

    @property
    def num_local_tokens(self) -> int:
        return self.num_tokens_of(self.rank)

    def doc_fragments(self, doc: int) -> Tuple[Fragment, ...]:
        """The chain of document `doc`, in order."""
        return tuple(f for f in self.fragments if f.doc == doc)

    def previous(self, f: Fragment) -> Optional[Fragment]:
        return self.fragments[f.index - 1] if f.position > 0 else None

    def next(self, f: Fragment) -> Optional[Fragment]:
        return None if f.is_last else self.fragments[f.index + 1]

    # ------------------------------------------------------------------ local segmentation
    def local_cu_seqlens_of(self, rank: int) -> Tuple[int, ...]:
        """[0, len(f0), len(f0)+len(f1), ...]: one local segment per fragment. A rank that
        holds nothing gets (0,), which is not a valid cu_seqlens: callers skip such ranks."""
        cu = [0]
        for f in self.fragments_of(rank):
            cu.append(cu[-1] + f.length)
        return tuple(cu)

    @property
    def local_cu_seqlens(self) -> Tuple[int, ...]:
        return self.local_cu_seqlens_of(self.rank)

    def token_map_of(self, rank: int, device=None) -> torch.Tensor:
        """Global index of each of `rank`'s local tokens, in local order (int64 [T_local])."""
        parts = [torch.arange(f.start, f.end, dtype=torch.int64, device=device)
                 for f in self.fragments_of(rank)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)

    @property
    def token_map(self) -> torch.Tensor:
        return self.token_map_of(self.rank)

    # ------------------------------------------------------------------ shard / unshard
    def shard(self, x: torch.Tensor, rank: Optional[int] = None) -> torch.Tensor:
        """Global [1, T, ...] -> this rank's (or `rank`'s) local [1, T_local, ...].

        Works for values and gradients alike; differentiable (an index_select), so sharding a
        global leaf and back-propagating through the local computation fills the leaf's .grad
        with this rank's contribution only (zeros elsewhere)."""
        r = self.rank if rank is None else rank
        if x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != self.total_tokens:
            raise ValueError(f"shard: expected a global [1, {self.total_tokens}, ...] tensor, "
                             f"got {list(x.shape)}")
        return x.index_select(1, self.token_map_of(r, device=x.device))

    def unshard(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Every rank's local [1, T_r, ...] (a list indexed by rank) -> global [1, T, ...].

        Pure (no communication); see kda_aot.cp.gather for the collective version. Works for
        values and gradients alike (each global token has exactly one owner)."""
        if len(parts) != self.world_size:
            raise ValueError(f"unshard: expected {self.world_size} parts (one per rank), "
                             f"got {len(parts)}")
        ref = next(p for p in parts)
        out = ref.new_zeros((1, self.total_tokens) + tuple(ref.shape[2:]))
        for r, p in enumerate(parts):
            n = self.num_tokens_of(r)
            if p.dim() < 2 or p.shape[0] != 1 or p.shape[1] != n or p.shape[2:] != ref.shape[2:]:
                raise ValueError(f"unshard: rank {r}'s part must be [1, {n}, "
                                 f"{', '.join(map(str, ref.shape[2:]))}], got {list(p.shape)}")
            out[:, self.token_map_of(r, device=p.device)] = p
        return out

    # ------------------------------------------------------------------ misc
    def for_rank(self, rank: int) -> "CPPlan":
        """The same plan seen from another rank (the tests' view of every rank)."""
        _check_rank(rank, self.world_size)
        return dataclasses.replace(self, rank=rank)

    def agreed(self) -> dict:
        """What every rank's plan must agree on (the rank itself excluded): check_agreement compares it."""
        return {"layout": self.layout, "world_size": self.world_size, "chunk_size": self.chunk_size,
                "cu_seqlens": self.digest}


# ---------------------------------------------------------------------------- construction

def _check_rank(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}) for world size {world_size}, got {rank}")


def _as_bounds(cu_seqlens) -> List[int]:
    cu_seqlens = boundaries_tensor(cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected shape [N + 1] with N >= 1, got {list(cu_seqlens.shape)}")
    bounds = check_cu_seqlens(cu_seqlens.cpu(), int(cu_seqlens[-1]))
    for i in range(len(bounds) - 1):
        if bounds[i] == bounds[i + 1]:
            raise ValueError(f"cu_seqlens: zero-length document {i} ({bounds[i]} -> {bounds[i + 1]}): context "
                             f"parallelism takes non-empty documents only (drop it from cu_seqlens)")
    return bounds


def _held_ranges(cu: List[int], W: int, layout: str, chunk: int) -> List[List[Tuple[int, int]]]:
    """Per rank, the global token ranges it holds (possibly touching, possibly empty)."""
    T = cu[-1]
    held: List[List[Tuple[int, int]]] = [[] for _ in range(W)]
    if layout == "contiguous":
        if T % W:
            raise ValueError(f"layout 'contiguous' needs T divisible by the world size: "
                             f"T = {T}, world size = {W} (T % W = {T % W})")
        n = T // W
        for r in range(W):
            held[r].append((r * n, (r + 1) * n))
    elif layout == "zigzag":
        if T % (2 * W):
            raise ValueError(f"layout 'zigzag' needs T divisible by 2 x world size: "
                             f"T = {T}, world size = {W} (T % {2 * W} = {T % (2 * W)})")
        n = T // (2 * W)
        for r in range(W):
            held[r] += [(r * n, (r + 1) * n), ((2 * W - 1 - r) * n, (2 * W - r) * n)]
    else:  # doc_zigzag
        P = 2 * W
        c = 0   # rank that receives the next extra chunk (carried across documents)
        for a, b in zip(cu[:-1], cu[1:]):
            n = -(-(b - a) // chunk)
            sizes = [n // P] * P
            m = n % P
            for j in range(m):
                r = (c + j) % W
                sizes[r if j < W else P - 1 - r] += 1
            c = (c + m) % W
            first = 0
            for p, s in enumerate(sizes):
                lo, hi = a + first * chunk, min(a + (first + s) * chunk, b)
                first += s
                if hi > lo:
                    held[p if p < W else P - 1 - p].append((lo, hi))
    return held


def make_plan(cu_seqlens: Union[torch.Tensor, Sequence[int]], layout: str, *,
              world_size: Optional[int] = None, rank: Optional[int] = None, group=None,
              chunk_size: int = CHUNK) -> CPPlan:
    """Build the plan for (cu_seqlens, layout) on `world_size` ranks seen from `rank`.

    Give either world_size and rank, or a torch.distributed process group (`group`; pass
    group=torch.distributed.group.WORLD for the default group), whose size and rank are used.
    cu_seqlens: global document boundaries, int32/int64 tensor or a sequence of ints.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: valid layouts are {', '.join(LAYOUTS)}")
    if group is not None:
        if world_size is not None or rank is not None:
            raise ValueError("make_plan: give either group or (world_size, rank), not both")
        from .exchange import resolve_group
        group, rank, world_size = resolve_group(group)
    if world_size is None or rank is None:
        raise ValueError("make_plan: give world_size and rank, or a process group")
    world_size, rank = int(world_size), int(rank)
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    _check_rank(rank, world_size)
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    cu = _as_bounds(cu_seqlens)

    # Cut every rank's ranges at document boundaries, merge touching ranges of one document.
    pieces = []  # (start, end, doc, rank)
    for r, ranges in enumerate(_held_ranges(cu, world_size, layout, int(chunk_size))):
        merged: List[List[int]] = []
        for lo, hi in sorted(ranges):
            d = _doc_of(cu, lo)
            while lo < hi:
                cut = min(hi, cu[d + 1])
                if merged and merged[-1][1] == lo and merged[-1][2] == d:
                    merged[-1][1] = cut
                else:
                    merged.append([lo, cut, d])
                lo, d = cut, d + 1
        pieces += [(lo, hi, d, r) for lo, hi, d in merged]
    pieces.sort()

    segment = [0] * world_size
    local_start = [0] * world_size
    fragments = []
    for i, (lo, hi, d, r) in enumerate(pieces):
        position = 0 if lo == cu[d] else fragments[-1].position + 1
        fragments.append(Fragment(index=i, doc=d, start=lo, end=hi, rank=r, segment=segment[r],
                                  local_start=local_start[r], position=position,
                                  needs_state=position > 0, is_last=hi == cu[d + 1]))
        segment[r] += 1
        local_start[r] += hi - lo
    return CPPlan(cu_seqlens=tuple(cu), layout=layout, world_size=world_size, rank=rank,
                  chunk_size=int(chunk_size), fragments=tuple(fragments))


def _doc_of(cu: List[int], t: int) -> int:
    """Index of the document holding token t (binary search over the boundaries)."""
    lo, hi = 0, len(cu) - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cu[mid] <= t:
            lo = mid
        else:
            hi = mid - 1
    return lo
