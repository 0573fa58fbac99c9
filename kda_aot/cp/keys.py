"""How the CP custom ops name their Python objects (torch.library ops take tensors, numbers and strings):
plans, process groups, backend objects, and the context a forward leaves for its backward.

- A plan registers itself when it is made (CPPlan.__post_init__) under an integer key, which the ops take
  as an int64 CPU tensor (CPPlan.key_tensor): torch.compile guards no tensor's value, so one compiled
  graph serves every plan - a step may bring a new pack each time.
- A group is named by its group_name; a backend or conv object by its spec (rebuilt inside the op), or,
  when it is not one of ours, by a key it is registered under while it lives.
- A forward's context is held here under the key its handle tensor (int64 [1], on the CPU) carries. In
  eager mode the autograd node adopts it at once (adopt), so it lives exactly as long as the graph and a
  saved-tensor hook that copies the handle cannot lose it; under torch.compile it stays here for as long
  as the handle tensor the compiled graph saved lives. Contexts hold detached tensors only: a reference
  to an output (which carries the node) would keep the node, and so the context, alive forever.
"""
from __future__ import annotations

import itertools
import weakref

import torch

_LIVE: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_CONTEXTS: dict = {}
_NEXT = itertools.count()
_ADOPTED = "kda_aot_cp_context"


def register(obj) -> int:
    """A key for obj (a plan, or a backend or conv object without a spec), valid while obj lives."""
    key = next(_NEXT)
    _LIVE[key] = obj
    return key


def key_tensor(key: int) -> torch.Tensor:
    return torch.tensor([key], dtype=torch.int64, device="cpu")


def lookup(key):
    """The object registered under key (an int or an int64 tensor holding it)."""
    key = int(key[0]) if isinstance(key, torch.Tensor) else int(key)
    obj = _LIVE.get(key)
    if obj is None:
        raise RuntimeError(f"kda_aot.cp: no live object under key {key} (the plan or backend a call named is gone)")
    return obj


def group_of(name: str):
    """The process group named `name` (its group_name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


def detached(obj):
    """obj with every tensor in it (through tuples, lists and dicts) detached: no autograd node kept."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, dict):
        return {k: detached(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(detached(v) for v in obj)
    return obj


def stash(context) -> torch.Tensor:
    """A handle tensor for `context`: context_of(handle) returns it while the handle lives."""
    key = next(_NEXT)
    _CONTEXTS[key] = context
    handle = key_tensor(key)
    weakref.finalize(handle, _CONTEXTS.pop, key, None)
    return handle


def context_of(handle: torch.Tensor):
    context = _CONTEXTS.get(int(handle[0]))
    if context is None:
        raise RuntimeError("kda_aot.cp: the forward's context is gone (its handle was freed before the backward)")
    return context


def adopt(ctx, handle: torch.Tensor) -> None:
    """In setup_context: the autograd node `ctx` takes the context behind a real handle (eager mode; a fake
    one while torch.compile traces carries nothing)."""
    from torch._subclasses.fake_tensor import is_fake
    if not is_fake(handle):
        setattr(ctx, _ADOPTED, _CONTEXTS.pop(int(handle[0]), None))


def handle_for(ctx, saved: torch.Tensor) -> torch.Tensor:
    """In the backward formula: the handle to give the backward op - a fresh one for the context the node
    adopted (eager), else the saved handle (the compiled graph's)."""
    context = getattr(ctx, _ADOPTED, None)
    return saved if context is None else stash(context)
