"""The custom ops under kda_aot.chunk_kda (namespace kda_aot): forward, backward, saved context, autograd.

The forward and backward are custom ops (namespace kda_aot) with fake implementations and registered
autograd, so torch.compile(fullgraph=True) traces a training step through them and CUDA graphs
capture them. The ops take inputs and incoming gradients of any strides (made contiguous where the
kernels need it) and packs with zero-length documents (the kernels see only the non-empty ones: a
zero-length document's final state is its initial state, its initial-state gradient the final-state
gradient). Shapes the fake implementations give:

    o [1, T, HV, 128] bf16, final_state [N, HV, 128, 128] fp32 ([0] when not asked for); q, k [1, T, H, 128]
    with HV a multiple of H (grouped value heads, served inside the kernels)
    saved context (backward="saved"): the chunk intermediates, chunk-indexed ones over
    max_chunks(T, N) rows (the exact chunk count depends on the values of cu_seqlens)
"""
from typing import Optional

import torch
from torch import Tensor

from ..schedule import backward as kda_backward, kda
from ..schedule.kda import HEAD_DIM
from ..reference.activations import kda_gate
from .._runtime.packing import CHUNK, PLANNED_FROM_HOST
from .._runtime.tensor import require_cuda

# The saved context of backward="saved": the chunk stage's and the forward walk's outputs that the
# backward reads, in the order the saved ops return and take them.
SAVED = ("w", "u", "qg", "kg", "aqk", "gamma", "akk_inv", "tape", "vnew")
# What the forward of backward="replay" keeps beside its inputs, so that the replay's chunk stage forms neither
# Aqk nor (I + L)^-1 again (kda._chunk_stage_tensors): 256 bytes a token-head, FLA's Aqk and Akk.
KEPT = kda.REPLAY_KEPT
_PER_CHUNK_SAVED = ("gamma", "tape")


def max_chunks(T, n_docs):
    """An upper bound of a pack's chunk count that needs only its shape: a document of l tokens has
    ceil(l / 64) <= floor(l / 64) + 1 chunks."""
    return T // CHUNK + n_docs


def _contiguous(*xs):
    return tuple(None if x is None else x.contiguous() for x in xs)


def _state_rows(x: Optional[Tensor], n_docs: int, H: int, name: str):
    if x is not None and tuple(x.shape) != (n_docs, H, HEAD_DIM, HEAD_DIM):
        raise ValueError(f"{name}: expected shape [{n_docs}, {H}, 128, 128], got {list(x.shape)}")


def _no_state(like: Tensor) -> Tensor:
    return like.new_empty((0,), dtype=torch.float32)


def _gate_of(A_log: Optional[Tensor], dt_bias: Optional[Tensor], gate_kind: int, lower_bound: float):
    """The gate's activation inside the kernels (kda.GateActivation), or None: g is the log decay."""
    if gate_kind == kda.GATE_RAW:
        if A_log is not None or dt_bias is not None:
            raise ValueError("A_log, dt_bias: given with gate_kind 0 (g is the log decay)")
        return None
    if gate_kind not in (kda.GATE_SOFTPLUS, kda.GATE_SIGMOID):
        raise ValueError(f"gate_kind: expected 0, 1 (softplus) or 2 (sigmoid), got {gate_kind}")
    return kda.GateActivation(gate_kind, None if A_log is None else A_log.contiguous(),
                              None if dt_bias is None else dt_bias.contiguous(), float(lower_bound))


def _entering(h0: Optional[Tensor], g: Tensor, tables, gate=None):
    """The segments' initial states as the programs take them (with the first token's decay below the
    gate floor applied here: kda.entering_decay) and that factor, which their gradient takes too;
    (None, None) without an initial state. gate: g is the raw gate, activated here for the first tokens."""
    if h0 is None:
        return None, None
    decay = _entering_decay(g, tables, gate)
    return tables.segment_rows(h0) * decay, decay


def _entering_decay(g: Tensor, tables, gate=None) -> Tensor:
    """kda.entering_decay of each segment's first token (activated here when g is the raw gate)."""
    first = kda.first_tokens(g, tables)
    if gate is not None:
        first = kda_gate(first, gate.a_log, gate.dt_bias,
                         gate.lower_bound if gate.kind == kda.GATE_SIGMOID else None)
    return kda.entering_decay(first)


# ------------------------------------------------------------------------------------ forward

def _forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, save, gate,
             beta_kind=kda.BETA_PLAIN, keep=False):
    """o, final_state (or [0]), with save the saved context (SAVED order, per-chunk tensors over
    max_chunks rows), with keep what the replay reads from the forward (KEPT order)."""
    q, k, v, g, beta, h0 = _contiguous(q, k, v, g, beta, initial_state)
    T, H = v.shape[1], v.shape[2]
    tables = kda.tables_of(cu_seqlens, T, q.device)
    _state_rows(h0, tables.n_docs, H, "initial_state")
    out, full = {}, {}
    if save:
        rows, C = max_chunks(T, tables.n_docs), tables.chunks.shape[0]
        f32 = dict(device=q.device, dtype=torch.float32)
        full = {"gamma": torch.empty(rows, H, HEAD_DIM, **f32),
                "tape": torch.empty(rows, H, HEAD_DIM, HEAD_DIM, **f32)}
        out = {name: x[:C] for name, x in full.items()}
        for x in full.values():  # the rows past the pack's chunks hold zeros, not leftover memory
            x[C:].zero_()
    require_cuda(q, "q", "chunk_kda")  # also with nothing to launch: a CPU call fails at T = 0 as at T > 0
    if tables.n_segments == 0:  # T = 0: every document is empty, nothing to launch
        o, final, *context = _fake_forward(v, h0, cu_seqlens, output_final_state, save, keep)
        if output_final_state:
            final = h0.clone() if h0 is not None else final.zero_()
        return (o, final, *(x.zero_() for x in context))
    o, final, saved = kda.chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=tables, scale=scale,
                                        initial_state=_entering(h0, g, tables, gate)[0],
                                        output_final_state=output_final_state, save_tape=save, out=out, gate=gate,
                                        beta_kind=beta_kind, keep=keep)
    if final is not None:
        final = tables.document_rows(final, h0)
    final = _no_state(q) if final is None else final
    if keep:
        return (o, final, *(saved[name] for name in KEPT))
    if not save:
        return o, final, _no_state(q), _no_state(q)
    return (o, final, *(full.get(name, saved[name]) for name in SAVED))


def _fake_forward(v, initial_state, cu_seqlens, output_final_state, save, keep=False):
    """Shapes from v (H: the value heads)."""
    T, H, N = v.shape[1], v.shape[2], cu_seqlens.shape[0] - 1
    o = v.new_empty(v.shape, dtype=torch.bfloat16)
    final = v.new_empty((N, H, HEAD_DIM, HEAD_DIM), dtype=torch.float32) if output_final_state else _no_state(v)
    if keep:
        return (o, final, *(v.new_empty((1, T, H, CHUNK), dtype=torch.bfloat16) for _ in KEPT))
    if not save:
        return o, final, _no_state(v), _no_state(v)
    rows = max_chunks(T, N)
    token = lambda width: v.new_empty((1, T, H, width), dtype=torch.bfloat16)  # noqa: E731
    shapes = {"gamma": v.new_empty((rows, H, HEAD_DIM), dtype=torch.float32),
              "tape": v.new_empty((rows, H, HEAD_DIM, HEAD_DIM), dtype=torch.float32),
              "aqk": token(CHUNK), "akk_inv": token(CHUNK)}
    return (o, final, *(shapes[name] if name in shapes else token(HEAD_DIM) for name in SAVED))


# The ops' gate arguments (last, with defaults): A_log [H] and dt_bias [H, 128] fp32 (contiguous), gate_kind
# (kda.GATE_RAW: g is the log decay; GATE_SOFTPLUS, GATE_SIGMOID: g is the raw gate, activated in the
# kernels) and lower_bound (GATE_SIGMOID). The backward ops return dA_log and ddt_bias after the six
# gradients ([0] without the activation).
# beta_kind (last; kda.BETA_KINDS): BETA_PLAIN: beta is beta (bf16); BETA_SIGMOID, BETA_SIGMOID_2: beta is the
# logits (bf16 or fp32), activated in the kernels, and dbeta their gradient in their dtype.

@torch.library.custom_op("kda_aot::chunk_kda_fwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def chunk_kda_fwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                     cu_seqlens: Tensor, scale: float, output_final_state: bool, A_log: Optional[Tensor] = None,
                     dt_bias: Optional[Tensor] = None, gate_kind: int = 0, lower_bound: float = 0.0,
                     beta_kind: int = 0, keep: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(o, final_state or [0], *KEPT with keep, else two [0]); the backward replays the forward kernels from the
    inputs and what keep kept."""
    return _forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, False,
                    _gate_of(A_log, dt_bias, gate_kind, lower_bound), beta_kind, keep)


@chunk_kda_fwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, A_log=None, dt_bias=None,
      gate_kind=0, lower_bound=0.0, beta_kind=0, keep=False):
    return _fake_forward(v, initial_state, cu_seqlens, output_final_state, False, keep)


@torch.library.custom_op("kda_aot::chunk_kda_fwd_saved", mutates_args=(), tags=PLANNED_FROM_HOST)
def chunk_kda_fwd_saved_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Optional[Tensor], cu_seqlens: Tensor, scale: float,
                           output_final_state: bool, A_log: Optional[Tensor] = None,
                           dt_bias: Optional[Tensor] = None, gate_kind: int = 0, lower_bound: float = 0.0,
                           beta_kind: int = 0
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                      Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o, final_state or [0], *the saved context in SAVED order) for the saved-context backward."""
    return _forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, True,
                    _gate_of(A_log, dt_bias, gate_kind, lower_bound), beta_kind)


@chunk_kda_fwd_saved_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, A_log=None, dt_bias=None,
      gate_kind=0, lower_bound=0.0, beta_kind=0):
    return _fake_forward(v, initial_state, cu_seqlens, output_final_state, True)


# ----------------------------------------------------------------------------------- backward

def _backward_result(q, beta, tables, grads, decay, dfinal_state):
    dq, dk, dv, dg, dbeta, dh0, *gate_grads = grads
    if decay is None:
        dh0 = _no_state(q)
    else:
        dh0 = tables.document_rows(dh0 * decay, dfinal_state)
    da_log, ddt_bias = kda_backward.gate_parameter_grads(*gate_grads) if gate_grads else (_no_state(q), _no_state(q))
    return dq, dk, dv, dg, dbeta.to(beta.dtype), dh0, da_log, ddt_bias


def _empty_backward(q, k, v, g, beta, tables, initial_state, dfinal_state, gate):
    """The gradients of a pack of zero-length documents only (T = 0)."""
    H = v.shape[2]
    dh0 = _no_state(q)
    if initial_state is not None:
        dh0 = dfinal_state.clone() if dfinal_state is not None else torch.zeros(
            tables.n_docs, H, HEAD_DIM, HEAD_DIM, device=q.device)
    da_log, ddt_bias = _zero_gate_grads(v, gate)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0, da_log, ddt_bias)


def _zero_gate_grads(v, gate):
    """dA_log, ddt_bias of a pack with no token: zeros over v's heads ([0] without the gate's activation)."""
    if gate is None:
        return _no_state(v), _no_state(v)
    return (torch.zeros(v.shape[2], device=v.device, dtype=torch.float32),
            torch.zeros(v.shape[2], HEAD_DIM, device=v.device, dtype=torch.float32))


@torch.library.custom_op("kda_aot::chunk_kda_bwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def chunk_kda_bwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                     cu_seqlens: Tensor, scale: float, do: Tensor, dfinal_state: Optional[Tensor],
                     A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None, gate_kind: int = 0,
                     lower_bound: float = 0.0, beta_kind: int = 0, aqk: Optional[Tensor] = None,
                     inv_pack: Optional[Tensor] = None
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Replay backward: the forward kernels again (from aqk and inv_pack when the forward kept them), then the
    backward ones. (dq, dk, dv, dg, dbeta, d_initial_state or [0], dA_log or [0], ddt_bias or [0])."""
    q, k, v, g, beta, h0, do, dht = _contiguous(q, k, v, g, beta, initial_state, do, dfinal_state)
    gate = _gate_of(A_log, dt_bias, gate_kind, lower_bound)
    tables = kda.tables_of(cu_seqlens, q.shape[1], q.device)
    if tables.n_segments == 0:
        return _empty_backward(q, k, v, g, beta, tables, h0, dht, gate)
    h0, decay = _entering(h0, g, tables, gate)
    kept = None if aqk is None else {"aqk": aqk.contiguous(), "inv_pack": inv_pack.contiguous()}
    grads = kda_backward.replay_backward(q, k, v, g, beta, h0, tables, scale, do, tables.segment_rows(dht), gate,
                                         beta_kind=beta_kind, kept=kept)
    return _backward_result(q, beta, tables, grads, decay, dht)


def _fake_backward(q, k, v, g, beta, initial_state, gate_kind):
    dh0 = (_no_state(q) if initial_state is None else
           q.new_empty(initial_state.shape, dtype=torch.float32))
    if gate_kind == kda.GATE_RAW:
        da_log, ddt_bias = _no_state(q), _no_state(q)
    else:
        da_log = q.new_empty((v.shape[2],), dtype=torch.float32)
        ddt_bias = q.new_empty((v.shape[2], HEAD_DIM), dtype=torch.float32)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), dh0, da_log, ddt_bias)


@chunk_kda_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dfinal_state, A_log=None, dt_bias=None,
      gate_kind=0, lower_bound=0.0, beta_kind=0, aqk=None, inv_pack=None):
    return _fake_backward(q, k, v, g, beta, initial_state, gate_kind)


@torch.library.custom_op("kda_aot::chunk_kda_bwd_saved", mutates_args=(), tags=PLANNED_FROM_HOST)
def chunk_kda_bwd_saved_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Optional[Tensor], cu_seqlens: Tensor, scale: float,
                           w: Tensor, u: Tensor, qg: Tensor, kg: Tensor, aqk: Tensor, gamma: Tensor,
                           akk_inv: Tensor, tape: Tensor, vnew: Tensor, do: Tensor, dfinal_state: Optional[Tensor],
                           A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None, gate_kind: int = 0,
                           lower_bound: float = 0.0, beta_kind: int = 0
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Saved-context backward over chunk_kda_fwd_saved's context: bitwise the replay's gradients."""
    q, k, v, g, beta, h0, do, dht = _contiguous(q, k, v, g, beta, initial_state, do, dfinal_state)
    gate = _gate_of(A_log, dt_bias, gate_kind, lower_bound)
    tables = kda.tables_of(cu_seqlens, q.shape[1], q.device)
    if tables.n_segments == 0:
        return _empty_backward(q, k, v, g, beta, tables, h0, dht, gate)
    C = tables.chunks.shape[0]
    context = dict(zip(SAVED, (w, u, qg, kg, aqk, gamma, akk_inv, tape, vnew)))
    saved = {name: x[:C] if name in _PER_CHUNK_SAVED else x for name, x in context.items()}
    saved.update(q=q, k=k, v=v, g=g, beta=beta, chunks=tables.chunks, seg_chunks=tables.seg_chunks,
                 chain_lengths=tables.chain_lengths, scale=scale, gate=gate, beta_kind=beta_kind)
    grads = kda_backward.chunk_kda_bwd(saved, do, tables.segment_rows(dht), release=True)
    decay = None if h0 is None else _entering_decay(g, tables, gate)
    return _backward_result(q, beta, tables, grads, decay, dht)


@chunk_kda_bwd_saved_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, w, u, qg, kg, aqk, gamma, akk_inv, tape, vnew, do,
      dfinal_state, A_log=None, dt_bias=None, gate_kind=0, lower_bound=0.0, beta_kind=0):
    return _fake_backward(q, k, v, g, beta, initial_state, gate_kind)


# ----------------------------------------------------------------------------------- autograd

# The inputs both forward ops take, in this order (chunk_kda_fwd_op adds keep after them).
_COMMON_INPUTS = 14


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, initial_state, cu_seqlens, scale, _, A_log, dt_bias, gate_kind, lower_bound,
     beta_kind) = inputs[:_COMMON_INPUTS]
    ctx.scale, ctx.gate_kind, ctx.lower_bound, ctx.beta_kind = scale, gate_kind, lower_bound, beta_kind
    ctx.has_initial_state = initial_state is not None
    ctx.set_materialize_grads(False)  # unused outputs (final_state, the saved context) get no zero gradient
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, *output[2:])
    ctx.mark_non_differentiable(*output[2:])


def _backward(ctx, do, dfinal_state, *_):
    q, k, v, g, beta, h0, cu_seqlens, A_log, dt_bias, *context = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    if dfinal_state is not None and dfinal_state.numel() == 0:
        dfinal_state = None
    gate = (A_log, dt_bias, ctx.gate_kind, ctx.lower_bound)
    kwargs = kda.beta_launch_args(ctx.beta_kind)  # a keyword only where the call needs it: beta's activation
    if len(context) == len(SAVED):
        grads = chunk_kda_bwd_saved_op(q, k, v, g, beta, h0, cu_seqlens, ctx.scale, *context, do, dfinal_state, *gate,
                                       **kwargs)
    else:  # the replay, from what the forward kept (a call without keep kept two [0])
        if context[0].dim() == 4:
            kwargs.update(zip(KEPT, context))
        grads = chunk_kda_bwd_op(q, k, v, g, beta, h0, cu_seqlens, ctx.scale, do, dfinal_state, *gate, **kwargs)
    dq, dk, dv, dg, dbeta, dh0, da_log, ddt_bias = grads
    gated = ctx.gate_kind != kda.GATE_RAW
    # no gradient for cu_seqlens, scale, output_final_state, gate_kind, lower_bound, beta_kind, nor keep
    return (dq, dk, dv, dg, dbeta, dh0 if ctx.has_initial_state else None, None, None, None,
            da_log if gated and A_log is not None else None, ddt_bias if gated and dt_bias is not None else None,
            None, None, None, *(None,) * (len(ctx.needs_input_grad) - _COMMON_INPUTS))


chunk_kda_fwd_op.register_autograd(_backward, setup_context=_setup_context)
chunk_kda_fwd_saved_op.register_autograd(_backward, setup_context=_setup_context)


