"""chunk_kda_cp: KDA over a packed sequence split across the ranks of a process group, as torch.library
custom ops with autograd (the collective forward and backward: kda_aot.cp.collective), the agreement check
and the public entry points."""
from __future__ import annotations

from typing import Optional

import torch
from ..ops.chunk_kda import BACKWARD_MODES
from ..ops.gate import activate
from .._runtime.packing import PLANNED_FROM_HOST
from .._runtime.tensor import check_kda_shapes, checked_scale
from . import keys
from .backends import backend_name, get_backend
from .collective import _Context, _cp_backward, _cp_forward, phase_times
from .exchange import check_agreement, resolve_group
from .plan import CPPlan

__all__ = ["chunk_kda_cp", "chunk_kda_cp_agreed", "kda_facts", "BACKWARD_MODES", "phase_times"]

INFERENCE = "inference"  # the forward op's mode when no backward will come (what the user's modes keep, kept by none)


def _validate(q, k, v, g, beta, initial_state, plan: CPPlan) -> Optional[str]:
    """This rank's input problems as one message (None: fine). Never raises: a rank that
    raised here alone would leave the others waiting in the agreement collective."""
    try:
        try:
            H = check_kda_shapes(q, k, v, g, beta, packed=True)
        except (TypeError, ValueError) as e:
            return str(e)
        T, K, V = q.shape[1], q.shape[3], v.shape[3]
        if T != plan.num_local_tokens:
            return (f"q holds {T} local tokens but the plan gives rank {plan.rank} "
                    f"{plan.num_local_tokens} (layout {plan.layout})")
        if initial_state is not None:
            shape = (plan.num_docs, H, K, V)
            if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != shape:
                return (f"initial_state: expected a tensor of shape {list(shape)} (one row per global document), "
                        f"got {getattr(initial_state, 'shape', initial_state)}")
    except Exception as e:  # pragma: no cover - defensive: report instead of raising alone
        return f"invalid input: {type(e).__name__}: {e}"
    return None

# ---------------------------------------------------------------------------- the custom ops
# kda_aot::chunk_kda_cp_fwd / _bwd: the op's forward and backward as torch.library custom ops (so that
# torch.compile traces a CP step into one graph); the plan travels as its key tensor, the group and the
# backend as strings (kda_aot.cp.keys), the forward's context as a handle tensor. The implementations run
# with autocast off: the summaries' compositions are fp32 products by design.

@torch.library.custom_op("kda_aot::chunk_kda_cp_fwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def chunk_kda_cp_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        initial_state: Optional[torch.Tensor], plan: torch.Tensor, num_docs: int, group: str,
                        scale: float, output_final_state: bool, backward: str, backend: str, agree: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collective: (o, final_state [num_docs, H, K, V] or [0], the context handle). agree: check the ranks'
    agreement first (else the caller did: PackedKDA's one check)."""
    plan_obj, group_obj, backend_obj = keys.lookup(plan), keys.group_of(group), get_backend(backend)
    with torch.autocast(q.device.type, enabled=False):
        if agree:
            _, facts, problem, _ = kda_facts(q, k, v, g, beta, initial_state, plan_obj, scale,
                                             "replay" if backward == INFERENCE else backward, backend_obj)
            check_agreement("chunk_kda_cp", plan_obj, group_obj, facts, problem, q)
        ctx = _Context()
        o, final = _cp_forward(ctx, q, k, v, g, beta, initial_state, plan_obj, group_obj, scale,
                               output_final_state, backward, backend_obj)
    return o.contiguous(), final, keys.stash(ctx)


@chunk_kda_cp_fwd_op.register_fake
def _(q, k, v, g, beta, initial_state, plan, num_docs, group, scale, output_final_state, backward, backend, agree):
    H, K, V = v.shape[2], q.shape[3], v.shape[-1]  # H: the value heads
    sd = get_backend(backend).state_dtype
    final = q.new_empty((num_docs, H, K, V), dtype=sd) if output_final_state else q.new_empty((0,), dtype=sd)
    return q.new_empty((1, q.shape[1], H, V)), final, torch.empty(1, dtype=torch.int64, device="cpu")


@torch.library.custom_op("kda_aot::chunk_kda_cp_bwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def chunk_kda_cp_bwd_op(handle: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, initial_state: Optional[torch.Tensor], do: torch.Tensor,
                        dfinal_state: Optional[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collective: (dq, dk, dv, dg, dbeta, d_initial_state or [0]) of the forward behind `handle`
    (q ... initial_state: the forward's inputs, for the gradients' shapes)."""
    with torch.autocast(q.device.type, enabled=False):
        grads = _cp_backward(keys.context_of(handle), do, dfinal_state)
    return (*(x.contiguous() for x in grads[:5]), q.new_empty((0,)) if grads[5] is None else grads[5].contiguous())


@chunk_kda_cp_bwd_op.register_fake
def _(handle, q, k, v, g, beta, initial_state, do, dfinal_state):
    dh0 = q.new_empty((0,)) if initial_state is None else initial_state.new_empty(initial_state.shape)
    return (*(x.new_empty(x.shape) for x in (q, k, v, g, beta)), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state = inputs[:6]
    ctx.has_initial_state = initial_state is not None
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(output[2], q, k, v, g, beta, initial_state)
    ctx.mark_non_differentiable(output[2])
    keys.adopt(ctx, output[2])


def _backward(ctx, do, dfinal_state, _):
    handle, q, k, v, g, beta, h0 = ctx.saved_tensors
    if do is None:
        do = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    grads = chunk_kda_cp_bwd_op(keys.handle_for(ctx, handle), q, k, v, g, beta, h0, do, dfinal_state)
    return (*grads[:5], grads[5] if ctx.has_initial_state else None) + (None,) * 8


chunk_kda_cp_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def chunk_kda_cp(q, k, v, g, beta, *, plan: CPPlan, group=None, scale: Optional[float] = None,
                 initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                 backward: str = "replay", backend="auto", use_gate_in_kernel: bool = False, A_log=None,
                 dt_bias=None, lower_bound: Optional[float] = None, safe_gate: bool = False,
                 use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False):
    """Context-parallel KDA on this rank's LOCAL shards. Collective: every rank of `group`
    calls it with the same plan (built for its rank), in the same order; so is the backward.

    q, k [1, T_local, H, K], v [1, T_local, HV, V], g [1, T_local, HV, K] (log decay, <= 0),
    beta [1, T_local, HV] (HV = H without grouped value heads); T_local = plan.num_local_tokens, tokens in plan.token_map order.
    initial_state: [N, H, K, V] (one row per global document) or None; only the rows of the
    documents whose first fragment is on this rank are read.
    scale: defaults to K ** -0.5. backward: "replay" | "saved" (bitwise-equal gradients).
    backend: "auto" (kda_aot.registry.auto_backend: the kernels for bf16 tensors on a GPU they serve) | "reference"
    (kda_aot.reference in fp32) | "cuda" (the kernels) | a backend object.

    Returns (o [1, T_local, H, V] in q's dtype, final_state or None). final_state is
    [N, H, K, V] fp32 holding the final states of the documents whose last fragment is on this
    rank, zero rows elsewhere (all_reduce(SUM) over the group gives all of them). Likewise the
    gradient of initial_state has the rows of the documents that start on this rank.

    FLA's per-token activations, as kda_aot.chunk_kda takes them (no communication: each rank activates
    its own tokens): use_gate_in_kernel with A_log, dt_bias, lower_bound, safe_gate (g the raw gate);
    use_beta_sigmoid_in_kernel, allow_neg_eigval (beta the logits); grouped value heads (v, g, beta and
    the states with HV heads, a multiple of q's and k's H).

    Inputs, agreement: all ranks must agree on the plan, H, K, V and scale; a rank whose local
    shapes do not match the plan, or a disagreement, raises a ValueError on every rank.
    The backward is collective too: every rank must back-propagate through its o (or
    final_state), including a rank that holds no token (its o is [1, 0, H, V]), in the same
    order as the other ranks' CP calls.
    """
    backend, scale = kda_config(q, plan, scale, backward, backend)
    group, _, _ = resolve_group(group)
    try:
        check_kda_shapes(q, k, v, g, beta, packed=True)
    except (TypeError, ValueError):  # a rank must not raise alone: the op's agreement reports it on every rank
        return _apply(q, k, v, g, beta, plan, group, scale, initial_state, output_final_state, backward, backend,
                      agree=True)
    g, beta = activate(g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                       lower_bound=lower_bound, safe_gate=safe_gate, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                       allow_neg_eigval=allow_neg_eigval,
                       beta_dtype=beta.dtype if beta.dtype in (torch.float32, torch.float64) else torch.bfloat16)
    return _apply(q, k, v, g, beta, plan, group, scale, initial_state, output_final_state, backward, backend,
                  agree=True)


def kda_config(q, plan: CPPlan, scale, backward: str, backend):
    """(backend object, scale) of a chunk_kda_cp call, raising on arguments that are wrong on every rank alike
    (mode, plan type, backend); reads nothing of the plan (torch.compile would guard on it): its facts are
    checked inside the op (kda_facts, check_agreement)."""
    if backward not in BACKWARD_MODES:
        raise ValueError(f"backward must be one of {', '.join(BACKWARD_MODES)}, got {backward!r}")
    if not isinstance(plan, CPPlan):
        raise TypeError(f"plan: expected a kda_aot.cp.CPPlan (see kda_aot.cp.make_plan), "
                        f"got {type(plan).__name__}")
    backend = get_backend(backend, like=q)
    K = q.shape[3] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
    return backend, (checked_scale(scale, K) if K else scale)


def kda_facts(q, k, v, g, beta, initial_state, plan: CPPlan, scale, backward: str, backend):
    """(backend object, facts every rank must agree on, this rank's problem or None, scale) of a
    chunk_kda_cp call (kda_config, then the plan's checks); raises as kda_config does."""
    backend, scale = kda_config(q, plan, scale, backward, backend)
    problem = _validate(q, k, v, g, beta, initial_state, plan)
    shape = tuple(q.shape) if isinstance(q, torch.Tensor) else ()
    facts = {"H": shape[2] if len(shape) == 4 else None, "K": shape[3] if len(shape) == 4 else None,
             "HV": v.shape[2] if isinstance(v, torch.Tensor) and v.dim() == 4 else None,
             "V": v.shape[-1] if isinstance(v, torch.Tensor) and v.dim() else None,
             "scale": float(scale) if scale is not None else None,
             "state dtype": backend.state_dtype, "backend": backend.name}
    return backend, facts, problem, scale


def chunk_kda_cp_agreed(q, k, v, g, beta, *, plan: CPPlan, group, scale: float, initial_state, output_final_state,
                        backward: str, backend):
    """chunk_kda_cp once the ranks have agreed (check_agreement on kda_facts, e.g. PackedKDA's one
    check for its whole call): group resolved, scale set, backend an object."""
    return _apply(q, k, v, g, beta, plan, group, scale, initial_state, output_final_state, backward, backend,
                  agree=False)


def _apply(q, k, v, g, beta, plan, group, scale, initial_state, output_final_state, backward, backend, agree):
    # Without a backward to come (inference, no_grad), "saved" would keep a graph for nothing, and "replay" what
    # its replay reads back.
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    o, final, _ = chunk_kda_cp_fwd_op(q, k, v, g, beta, initial_state, plan.key_tensor, plan.num_docs,
                                      group.group_name, float(scale), bool(output_final_state),
                                      backward if needs_grad else INFERENCE, backend_name(backend), agree)
    return o, (final if output_final_state else None)
