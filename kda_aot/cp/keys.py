"""The strings by which the CP custom ops name their Python objects (torch.library ops take tensors,
numbers and strings): plans, process groups, and the context a forward leaves for its backward.

A plan registers itself when it is made (CPPlan.op_key), so torch.compile reads the key as an
attribute; a group is named by its group_name; a forward's context is held here under the key its
handle tensor (int64 [1], on the CPU) carries, for as long as that tensor lives (autograd keeps it until
the backward has run or the graph is freed).
"""
from __future__ import annotations

import itertools
import weakref

import torch

_PLANS: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()
_CONTEXTS: dict = {}
_NEXT = itertools.count()


def register_plan(plan) -> str:
    key = f"plan{next(_NEXT)}"
    _PLANS[key] = plan
    return key


def plan_of(key: str):
    plan = _PLANS.get(key)
    if plan is None:
        raise RuntimeError(f"kda_aot.cp: no live plan {key!r} (the plan a compiled graph was traced with is gone)")
    return plan


def group_of(name: str):
    """The process group named `name` (its group_name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


def stash(context) -> torch.Tensor:
    """A handle tensor for `context`: context_of(handle) returns it while the handle lives."""
    key = next(_NEXT)
    _CONTEXTS[key] = context
    handle = torch.tensor([key], dtype=torch.int64)
    weakref.finalize(handle, _CONTEXTS.pop, key, None)
    return handle


def context_of(handle: torch.Tensor):
    context = _CONTEXTS.get(int(handle[0]))
    if context is None:
        raise RuntimeError("kda_aot.cp: the forward's context is gone (its handle was freed before the backward)")
    return context
