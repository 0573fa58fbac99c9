"""Collectives of the context-parallel path over a torch.distributed process group.

Two building blocks:
  * `check_agreement`: one small all_gather of a fingerprint before an op's first collective,
    so that ranks which disagree (cu_seqlens, layout, world size, shapes, ...) or which found a
    bad argument locally all raise the same ValueError instead of one raising and the others
    hanging in the next collective.
  * `exchange`: every rank publishes a flat fp tensor per selected fragment; one all_gather
    gives every rank every published tensor. The per-rank payload sizes follow from the plan
    (which every rank computes identically), so no size round trip is needed: payloads are
    padded to the largest rank's size. Padding is NaN on purpose, so that unpacking that read
    a slot it should not would poison the result visibly instead of silently adding zeros.

Every function here must be called by all ranks of the group, in the same order.
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Callable, Dict, Optional, Tuple

import torch

from .plan import CPPlan, Fragment

__all__ = ["resolve_group", "check_agreement", "post_agreement", "Agreement", "exchange", "exchange_flat",
           "payload_layout", "gather", "gather_flat", "gather_json"]


def resolve_group(group=None):
    """(group, rank, world size) of `group` (None: the default group). Raises a RuntimeError
    if torch.distributed is unavailable or not initialised."""
    import torch.distributed as dist
    if not dist.is_available():
        raise RuntimeError("kda_aot.cp: torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        raise RuntimeError("kda_aot.cp: the torch.distributed process group is not initialised: "
                           "call torch.distributed.init_process_group(...) on every rank first "
                           "(or use the single-device path without a plan)")
    if group is None:
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _device_for(group, like: Optional[torch.Tensor]) -> torch.device:
    """Where collective buffers live: NCCL only moves CUDA tensors, gloo any CPU tensor."""
    import torch.distributed as dist
    if like is not None and like.is_cuda:
        return like.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_flat(mine: torch.Tensor, world: int, group) -> torch.Tensor:
    """Collective: every rank's `mine` (same shape everywhere) one after the other in one flat tensor
    (one output buffer: no per-rank tensors to allocate and copy out, as the list all_gather does)."""
    import torch.distributed as dist
    out = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
    # all_gather_single (torch >= 2.13) is all_gather_into_tensor renamed; the older name is deprecated there
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    gather(out, mine.reshape(-1), group=group)
    return out


def gather_json(obj, world: int, group, device: torch.device) -> list:
    """Collective: every rank's JSON-serialisable `obj`, in rank order, through two gather_flat calls
    (the byte counts, then the bytes padded to the longest); all_gather_object would need numpy to
    unpickle."""
    data = json.dumps(obj, sort_keys=True).encode()
    sizes = gather_flat(torch.tensor([len(data)], dtype=torch.int64, device=device), world, group).tolist()
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    mine[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    everyone = gather_flat(mine.to(device), world, group).view(world, -1).cpu()
    return [json.loads(bytes(row[:n].tolist())) for row, n in zip(everyone, sizes)]


class Agreement:
    """A posted agreement check (post_agreement): the fingerprints' all_gather is queued; wait() reads
    it. In between the caller may queue LOCAL work only (no collective; nothing that a bad local
    argument makes unsafe): the GPU runs it while the host would otherwise sit in a sync and then
    launch it into an idle GPU before the first conv of every step (docs/cp.md)."""

    def __init__(self, op, group, rank, world, device, local_error, described, table, ready):
        self.op, self.group, self.rank, self.world, self.device = op, group, rank, world, device
        self.local_error, self.described = local_error, described
        self._table, self._ready = table, ready  # host table (pinned, filled when `ready` fires)

    @property
    def locally_ok(self) -> bool:
        """This rank found nothing wrong with its own arguments (local work may be queued)."""
        return self.local_error is None

    def wait(self):
        """Raises ValueError on every rank if any rank reported an error or the fingerprints differ
        (the message names the ranks and what differs). Returns (group, rank, world size)."""
        if self._ready is not None:
            self._ready.synchronize()  # the gather and its copy only, not the work queued after them
        rows, world = self._table.tolist(), self.world  # plain ints: torch ops on a CPU tensor cost host time here (docs/cp.md)
        if any(r[0] for r in rows) or any(r[1:] != rows[0][1:] for r in rows):
            # Every rank sees the same table, so every rank takes this branch: the reports' gather
            # below cannot hang.
            reports = gather_json([self.local_error, self.described], world, self.group, self.device)
            lines = [f"rank {r}: {err}" for r, (err, _) in enumerate(reports) if err]
            for key in self.described:
                values = [d.get(key) for _, d in reports]
                if any(v != values[0] for v in values):
                    lines.append(f"ranks disagree on {key}: "
                                 + ", ".join(f"rank {r} {v}" for r, v in enumerate(values)))
            raise ValueError(f"kda_aot.cp.{self.op}: the ranks of the process group cannot run this call "
                             f"together (raised on every rank):\n  " + "\n  ".join(lines))
        return self.group, self.rank, self.world


def post_agreement(op: str, plan: CPPlan, group, facts: Dict[str, object],
                   local_error: Optional[str] = None, like: Optional[torch.Tensor] = None) -> Agreement:
    """Collective: check_agreement in two halves - the fingerprints' all_gather queued now, read by
    the returned Agreement's wait(). Every rank must call wait() before its next collective."""
    group, rank, world = resolve_group(group)
    if local_error is None and (plan.world_size != world or plan.rank != rank):
        local_error = (f"the plan was built for rank {plan.rank} of {plan.world_size} but this is "
                       f"rank {rank} of a group of {world}")
    described = {"op": op, **plan.agreed()}
    described.update({k: repr(v) for k, v in sorted(facts.items())})
    digest = hashlib.sha256(repr(sorted(described.items())).encode()).digest()
    words = [1 if local_error else 0] + list(struct.unpack("<4q", digest))
    device = _device_for(group, like)
    table = gather_flat(torch.tensor(words, dtype=torch.int64).to(device), world, group).view(world, -1)
    ready = None
    if table.is_cuda:
        host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
        host.copy_(table, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(table.device))  # the copy's stream (like's device)
        table = host
    return Agreement(op, group, rank, world, device, local_error, described, table, ready)


def check_agreement(op: str, plan: CPPlan, group, facts: Dict[str, object],
                    local_error: Optional[str] = None, like: Optional[torch.Tensor] = None):
    """Collective: every rank of `group` must call this with the same `op` and plan-level
    `facts` (dict of name -> value that must agree, e.g. head count, dtype). `local_error`
    is this rank's own validation message (wrong local shape, plan built for another rank...).

    Raises ValueError on every rank if any rank reported an error or the fingerprints differ;
    the message names the ranks and what differs. Returns (group, rank, world size).
    """
    return post_agreement(op, plan, group, facts, local_error, like).wait()


def payload_layout(plan: CPPlan, size_of: Callable[[Fragment], int]) -> Tuple[int, Dict[int, int], int]:
    """(width, {fragment index: offset}, this rank's total) of an exchange: every rank's payloads one after
    the other in table order, each rank's padded to `width` elements (the largest rank's), ranks one
    after the other; offset is where a publishing fragment's payload starts in the gathered flat buffer."""
    world = plan.world_size
    offsets, totals = {}, [0] * world
    for f in plan.fragments:  # global order = every rank's local order
        n = size_of(f)
        if n > 0:
            offsets[f.index] = (f.rank, totals[f.rank])
            totals[f.rank] += n
    width = max(totals)
    return width, {i: r * width + o for i, (r, o) in offsets.items()}, totals[plan.rank]


def exchange_flat(plan: CPPlan, group, width: int, mine_total: int, packed, dtype: torch.dtype,
                  like: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Collective: the gathered flat buffer [world * width] of an exchange whose payload_layout gives
    `width` and this rank's `mine_total` (where each payload is; padding is NaN). packed: this rank's
    payloads one after the other in table order - one tensor or a list of them, each copied once into
    the send buffer (None or [] when this rank publishes nothing). None when nobody publishes anything."""
    if width == 0:
        return None
    parts = [] if packed is None else [packed] if isinstance(packed, torch.Tensor) else list(packed)
    n = sum(p.numel() for p in parts)
    if n != mine_total:
        raise AssertionError(f"rank {plan.rank}: packed payload of {n} elements, the plan says {mine_total}")
    mine = torch.full((width,), float("nan"), dtype=dtype, device=_device_for(group, like))
    offset = 0
    for p in parts:
        mine[offset:offset + p.numel()] = p.reshape(-1).to(device=mine.device, dtype=dtype)
        offset += p.numel()
    return gather_flat(mine, plan.world_size, group)


def exchange(plan: CPPlan, group, size_of: Callable[[Fragment], int],
             items: Dict[int, torch.Tensor], dtype: torch.dtype,
             like: Optional[torch.Tensor] = None, packed: Optional[torch.Tensor] = None) -> Dict[int, torch.Tensor]:
    """Collective all-gather of per-fragment payloads.

    size_of(f) is the number of elements fragment f publishes (0: nothing), a pure function of
    the plan so that all ranks agree on every rank's payload layout. `items` maps the index of
    each of this rank's publishing fragments to its payload (any shape, `size_of` elements).
    packed: instead of `items`, this rank's payloads already laid out one after the other in table
    order (one copy instead of one per fragment; None when this rank publishes nothing).
    Returns {fragment index: flat payload} for the publishing fragments of every rank.
    """
    if packed is None and items:
        packed = []
        for f in plan.local_fragments:
            n = size_of(f)
            if n > 0:
                if items[f.index].numel() != n:
                    raise AssertionError(f"fragment {f.index}: payload of {items[f.index].numel()} elements, "
                                         f"the plan says {n}")
                packed.append(items[f.index])
    width, offsets, mine_total = payload_layout(plan, size_of)
    everyone = exchange_flat(plan, group, width, mine_total, packed, dtype, like)
    if everyone is None:
        return {}
    return {i: everyone[o:o + size_of(plan.fragments[i])] for i, o in offsets.items()}


def gather(x_local: torch.Tensor, plan: CPPlan, group=None) -> torch.Tensor:
    """Collective: every rank's local [1, T_r, ...] -> the global [1, T, ...] on every rank.

    For tests and for collecting outputs or gradients; not differentiable (the result is
    detached). Ranks hold different token counts, so parts are padded to the largest one."""
    n = plan.num_local_tokens
    problem = None
    if x_local.dim() < 2 or x_local.shape[0] != 1 or x_local.shape[1] != n:
        problem = f"x_local must be [1, {n}, ...] for this rank, got {list(x_local.shape)}"
    group, _, world = check_agreement(
        "gather", plan, group,
        {"trailing shape": tuple(x_local.shape[2:]), "dtype": x_local.dtype}, problem, x_local)
    width = max(plan.num_tokens_of(r) for r in range(world))
    device = _device_for(group, x_local)
    x = x_local.detach().to(device)
    padded = x.new_zeros((1, width) + tuple(x.shape[2:]))
    padded[:, :n] = x
    everyone = gather_flat(padded.contiguous(), world, group).view(world, *padded.shape)
    parts = [p[:, :plan.num_tokens_of(r)] for r, p in enumerate(everyone)]
    return plan.unshard(parts).to(x_local.device)
