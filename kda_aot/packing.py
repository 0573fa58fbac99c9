"""Document boundaries -> the device tables the kernels read, cached by value.

`cu_seqlens` is validated on the host: a CUDA tensor costs one small device-to-host copy (a
sync), a CPU tensor costs none. The device-side tables (int32 boundaries, the chunk table and
each segment's first chunk) are built once per (boundaries, device) and reused, so repeated calls
on the same pack copy nothing — pass `cu_seqlens` on the CPU and a step launches no host syncs
(what a CUDA graph capture needs; warm the cache with one call before capturing).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._tensor import check_cu_seqlens

CHUNK = 64  # tokens per chunk; a chunk never crosses a segment, a segment's last chunk may be short


def chunk_table(cu: list[int]) -> tuple[list[int], list[int]]:
    """Chunks of every segment in packed order: flat [(first token, end token), ...] and the first
    chunk of each segment ([N + 1])."""
    chunks, seg_chunks = [], [0]
    for start, end in zip(cu[:-1], cu[1:]):
        for t in range(start, end, CHUNK):
            chunks += (t, min(t + CHUNK, end))
        seg_chunks.append(len(chunks) // 2)
    return chunks, seg_chunks


@dataclass(frozen=True, eq=False)
class PackTables:
    bounds: tuple        # host copy of cu_seqlens
    cu: torch.Tensor     # [N + 1] int32 on the device
    chunks: torch.Tensor  # [n_chunks, 2] int32: (first token, end token)
    seg_chunks: torch.Tensor  # [N + 1] int32: first chunk of each segment

    @property
    def n_segments(self) -> int:
        return len(self.bounds) - 1

    @functools.cached_property
    def chain_lengths(self) -> tuple:
        """Chunks of each segment: the lengths of the state-walk chains (per head)."""
        return tuple(-(-(e - s) // CHUNK) for s, e in zip(self.bounds[:-1], self.bounds[1:]))


@functools.lru_cache(maxsize=64)
def _tables(bounds: tuple, device: torch.device) -> PackTables:
    chunks, seg_chunks = chunk_table(list(bounds))
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device)  # noqa: E731
    return PackTables(bounds, as_i32(list(bounds)), as_i32(chunks).view(-1, 2), as_i32(seg_chunks))


def pack_tables(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> PackTables:
    """Validated boundaries (CPU or `device` tensor) -> the cached device tables for `device`."""
    bounds = tuple(check_cu_seqlens(cu_seqlens, total))
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current device: cuda:0 == it
        device = torch.device("cuda", torch.cuda.current_device())
    if cu_seqlens.device.type != "cpu" and cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: on {cu_seqlens.device}; expected the CPU or {device}")
    return _tables(bounds, device)
