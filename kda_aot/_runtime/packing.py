"""Document boundaries -> the device tables the kernels read, cached by value.

`cu_seqlens` is validated on the host: a CUDA tensor costs one small device-to-host copy (a
sync) the first time the op sees that tensor (host_copy keeps the copy while the tensor lives unwritten),
a CPU tensor costs none. The device-side tables (int32 boundaries, the chunk table and
each segment's first chunk) are built once per (boundaries, device) and reused, so repeated calls
on the same pack copy nothing — pass `cu_seqlens` on the CPU and a step launches no host syncs
(what a CUDA graph capture needs; warm the cache with one call before capturing).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .tensor import check_cu_seqlens, host_table_to

CHUNK = 64  # tokens per chunk; a chunk never crosses a segment, a segment's last chunk may be short
HEAD_DIM = 128  # the KDA kernels' head dim (kda.h's kHeadDim), also the l2norm kernels' row
CONV_WIDTH = 4  # taps of the causal conv (conv1d_silu.h's kConvWidth)

# The tags of the ops that read cu_seqlens' values on the host (their launches are planned from them):
# a CUDA graph would replay one pack's launches for any other, so torch.compile's CUDA graphs
# (mode="reduce-overhead") run these ops between their graphs. A whole step captured by the caller
# (torch.cuda.graph) on one pack replays that pack.
PLANNED_FROM_HOST = (torch.Tag.cudagraph_unsafe,)


# tensor -> (its version counter when copied, its CPU copy); keyed by identity, an entry goes with its tensor
_HOST_COPIES = WeakIdKeyDictionary()


def host_copy(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens on the CPU, copied once per tensor and version: FLA's layers hand every layer's forward and
    backward the same device tensor, and a copy (a host sync) each time would stop the host from running ahead
    of the GPU. Written in place (a new version) or a new tensor: copied again. Tensors without a version
    counter (inference mode) are copied each time."""
    if cu_seqlens.device.type == "cpu":
        return cu_seqlens
    try:
        version = cu_seqlens._version
    except RuntimeError:  # an inference tensor: no version counter to trust a cached copy by
        return cu_seqlens.cpu()
    hit = _HOST_COPIES.get(cu_seqlens)
    if hit is not None and hit[0] == version:
        return hit[1]
    copy = cu_seqlens.cpu()
    _HOST_COPIES[cu_seqlens] = (version, copy)
    return copy


def chunk_table(cu: list[int]) -> tuple[list[int], list[int]]:
    """Chunks of every segment in packed order: flat [(first token, end token), ...] and the first
    chunk of each segment ([N + 1])."""
    chunks, seg_chunks = [], [0]
    for start, end in zip(cu[:-1], cu[1:]):
        for t in range(start, end, CHUNK):
            chunks += (t, min(t + CHUNK, end))
        seg_chunks.append(len(chunks) // 2)
    return chunks, seg_chunks


def end_segment_table(seg_chunks: list[int], segments=None) -> list[int]:
    """[n_chunks]: the segment whose last chunk a chunk is (of `segments` only, when given), else -1."""
    table = [-1] * seg_chunks[-1]
    for n in range(len(seg_chunks) - 1) if segments is None else segments:
        table[seg_chunks[n + 1] - 1] = n
    return table


@dataclass(frozen=True, eq=False)
class PackTables:
    """The tables of a pack's non-empty documents (the kernels' segments: a zero-length document has no
    chunk and no state walk) and the map from documents to segments."""
    bounds: tuple        # host boundaries of the segments (cu_seqlens without its zero-length documents)
    cu: torch.Tensor     # [n_segments + 1] int32 on the device
    chunks: torch.Tensor  # [n_chunks, 2] int32: (first token, end token)
    seg_chunks: torch.Tensor  # [n_segments + 1] int32: first chunk of each segment
    n_docs: int          # documents in cu_seqlens, zero-length ones included
    kept: tuple          # the document of each segment
    kept_index: torch.Tensor | None  # `kept` as int64 on the device; None when no document is empty
    end_segment: torch.Tensor  # [n_chunks] int32: the segment whose last chunk a chunk is, else -1

    @property
    def n_segments(self) -> int:
        return len(self.bounds) - 1

    @functools.cached_property
    def chain_lengths(self) -> tuple:
        """Chunks of each segment: the lengths of the state-walk chains (per head)."""
        return tuple(-(-(e - s) // CHUNK) for s, e in zip(self.bounds[:-1], self.bounds[1:]))

    def end_segment_of(self, segments: tuple) -> torch.Tensor:
        """end_segment with only `segments` marked (the others' last chunks -1), made once per segment set."""
        if segments not in self._end_segment_tables:
            seg_chunks = [0, *itertools.accumulate(self.chain_lengths)]
            self._end_segment_tables[segments] = host_table_to(
                torch.tensor(end_segment_table(seg_chunks, segments), dtype=torch.int32), self.chunks.device)
        return self._end_segment_tables[segments]

    @functools.cached_property
    def _end_segment_tables(self) -> dict:
        return {}

    def segment_rows(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """Rows of a per-document tensor ([n_docs, ...]) for the segments ([n_segments, ...]); x itself when
        no document is empty."""
        return x if x is None or self.kept_index is None else x.index_select(0, self.kept_index)

    def document_rows(self, x: torch.Tensor, empty: torch.Tensor | None = None) -> torch.Tensor:
        """A per-segment tensor as rows of documents: a zero-length document's row is `empty`'s row
        (a per-document tensor) or zeros; x itself when no document is empty."""
        if self.kept_index is None:
            return x
        out = torch.zeros((self.n_docs, *x.shape[1:]), dtype=x.dtype, device=x.device) if empty is None \
            else empty.to(x.dtype, copy=True)
        return out.index_copy_(0, self.kept_index, x)


@functools.lru_cache(maxsize=64)
def _tables(doc_bounds: tuple, device: torch.device) -> PackTables:
    kept = tuple(i for i in range(len(doc_bounds) - 1) if doc_bounds[i + 1] > doc_bounds[i])
    bounds = (0, *(doc_bounds[i + 1] for i in kept))
    chunks, seg_chunks = chunk_table(list(bounds))
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device)  # noqa: E731
    kept_index = None if len(kept) == len(doc_bounds) - 1 else torch.tensor(kept, dtype=torch.int64).to(device)
    return PackTables(bounds, as_i32(list(bounds)), as_i32(chunks).view(-1, 2), as_i32(seg_chunks),
                      len(doc_bounds) - 1, kept, kept_index, as_i32(end_segment_table(seg_chunks)))


def pack_tables(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> PackTables:
    """Validated boundaries (CPU or `device` tensor) -> the cached device tables for `device`."""
    bounds = tuple(check_cu_seqlens(cu_seqlens, total))
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current device: cuda:0 == it
        device = torch.device("cuda", torch.cuda.current_device())
    if cu_seqlens.device.type != "cpu" and cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: on {cu_seqlens.device}; expected the CPU or {device}")
    return _tables(bounds, device)
