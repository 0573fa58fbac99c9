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
import struct
from typing import Callable, Dict, Optional

import torch

from .plan import CPPlan, Fragment

__all__ = ["resolve_group", "check_agreement", "exchange", "gather", "gather_flat"]


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


def check_agreement(op: str, plan: CPPlan, group, facts: Dict[str, object],
                    local_error: Optional[str] = None, like: Optional[torch.Tensor] = None):
    """Collective: every rank of `group` must call this with the same `op` and plan-level
    `facts` (dict of name -> value that must agree, e.g. head count, dtype). `local_error`
    is this rank's own validation message (wrong local shape, plan built for another rank...).

    Raises ValueError on every rank if any rank reported an error or the fingerprints differ;
    the message names the ranks and what differs. Returns (group, rank, world size).
    """
    import torch.distributed as dist
    group, rank, world = resolve_group(group)
    if local_error is None and (plan.world_size != world or plan.rank != rank):
        local_error = (f"the plan was built for rank {plan.rank} of {plan.world_size} but this is "
                       f"rank {rank} of a group of {world}")
    described = {"op": op, "layout": plan.layout, "world_size": plan.world_size,
                 "chunk_size": plan.chunk_size,
                 "cu_seqlens": f"sha256 {hashlib.sha256(repr(plan.cu_seqlens).encode()).hexdigest()[:12]}"
                               f" (T = {plan.total_tokens}, {plan.num_docs} documents)"}
    described.update({k: repr(v) for k, v in sorted(facts.items())})
    digest = hashlib.sha256(repr(sorted(described.items())).encode()).digest()
    words = [1 if local_error else 0] + list(struct.unpack("<4q", digest))
    device = _device_for(group, like)
    mine = torch.tensor(words, dtype=torch.int64, device=device)
    table = gather_flat(mine, world, group).view(world, -1).cpu()
    if bool(table[:, 0].any()) or bool((table[:, 1:] != table[0, 1:]).any()):
        # Every rank sees the same table, so every rank takes this branch: the object gather
        # below cannot hang.
        reports = [None] * world
        dist.all_gather_object(reports, (local_error, described), group=group)
        lines = [f"rank {r}: {err}" for r, (err, _) in enumerate(reports) if err]
        for key in described:
            values = [d.get(key) for _, d in reports]
            if any(v != values[0] for v in values):
                lines.append(f"ranks disagree on {key}: "
                             + ", ".join(f"rank {r} {v}" for r, v in enumerate(values)))
        raise ValueError(f"kda_aot.cp.{op}: the ranks of the process group cannot run this call "
                         f"together (raised on every rank):\n  " + "\n  ".join(lines))
    return group, rank, world


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
    world = plan.world_size
    per_rank = [[f for f in plan.fragments_of(r) if size_of(f) > 0] for r in range(world)]
    totals = [sum(size_of(f) for f in fs) for fs in per_rank]
    width = max(totals)
    if width == 0:
        return {}
    device = _device_for(group, like)
    mine = torch.full((width,), float("nan"), dtype=dtype, device=device)
    if packed is not None or not items:
        n = 0 if packed is None else packed.numel()
        if n != totals[plan.rank]:
            raise AssertionError(f"rank {plan.rank}: packed payload of {n} elements, the plan says {totals[plan.rank]}")
        if n:
            mine[:n] = packed.reshape(-1).to(device=device, dtype=dtype)
        per_rank_items = []
    else:
        per_rank_items = per_rank[plan.rank]
    offset = 0
    for f in per_rank_items:
        n = size_of(f)
        payload = items[f.index].reshape(-1)
        if payload.numel() != n:
            raise AssertionError(f"fragment {f.index}: payload of {payload.numel()} elements, "
                                 f"the plan says {n}")
        mine[offset:offset + n] = payload.to(device=device, dtype=dtype)
        offset += n
    everyone = gather_flat(mine, world, group).view(world, width)
    out = {}
    for r, fs in enumerate(per_rank):
        offset = 0
        for f in fs:
            n = size_of(f)
            out[f.index] = everyone[r][offset:offset + n]
            offset += n
    return out


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
