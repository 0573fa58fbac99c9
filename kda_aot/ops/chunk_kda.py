"""kda_aot.chunk_kda: flash-linear-attention's chunk_kda on the kernels, as torch.library custom ops.

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
    qk_rstd (last): with qk_l2norm (use_qk_l2norm_in_kernel, normalised inside the kernels) [2, 1, T, H] fp32,
    the rstd of q's and k's rows, else [0]
"""
import warnings
from typing import Optional

import torch
from torch import Tensor

from ..schedule import backward as kda_backward, kda
from ..schedule.kda import HEAD_DIM, MAX_HEADS
from .gate import activate, kda_gate, kernel_beta, kernel_gate
from .norm import L2NORM_EPS, l2norm
from .. import options
from .._runtime.packing import CHUNK, PLANNED_FROM_HOST
from .._runtime.tensor import require_cuda

BACKWARD_MODES = ("replay", "saved")
# The saved context of backward="saved": the chunk stage's and the forward walk's outputs that the
# backward reads, in the order the saved ops return and take them.
SAVED = ("w", "u", "qg", "kg", "aqk", "gamma", "akk_inv", "tape", "vnew")
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


def _no_state(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=torch.float32)


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

def _forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, save, gate, qk_l2norm=False,
             beta_kind=kda.BETA_PLAIN):
    """o, final_state (or [0]), with save the saved context (SAVED order, per-chunk tensors over
    max_chunks rows), then qk_rstd (qk_l2norm: q, k raw, normalised in the kernels; else [0])."""
    q, k, v, g, beta, h0 = _contiguous(q, k, v, g, beta, initial_state)
    T, H = v.shape[1], v.shape[2]
    tables = kda.tables_of(cu_seqlens, T, q.device)
    qk_rstd, qk_norm = _no_state(q), None
    if qk_l2norm:
        qk_rstd = torch.empty(2, *q.shape[:3], device=q.device, dtype=torch.float32)
        qk_norm = kda.QkL2Norm(qk_rstd[0], qk_rstd[1], L2NORM_EPS, write=True)
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
    if tables.n_segments == 0:  # T = 0: every document is empty, nothing to launch
        o, final, *context = _fake_forward(v, h0, cu_seqlens, output_final_state, save)[:-1]
        if output_final_state:
            final = h0.clone() if h0 is not None else final.zero_()
        return (o, final, *(x.zero_() for x in context), qk_rstd)
    require_cuda(q, "q", "chunk_kda")
    o, final, saved = kda.chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=tables, scale=scale,
                                        initial_state=_entering(h0, g, tables, gate)[0],
                                        output_final_state=output_final_state, save_tape=save, out=out, gate=gate,
                                        qk_norm=qk_norm, beta_kind=beta_kind)
    if final is not None:
        final = tables.document_rows(final, h0)
    final = _no_state(q) if final is None else final
    if not save:
        return o, final, qk_rstd
    return (o, final, *(full.get(name, saved[name]) for name in SAVED), qk_rstd)


def _fake_forward(v, initial_state, cu_seqlens, output_final_state, save, qk=None, qk_l2norm=False):
    """Shapes from v (H: the value heads); qk_rstd's from qk (q)."""
    q = v
    T, H, N = q.shape[1], q.shape[2], cu_seqlens.shape[0] - 1
    o = q.new_empty(q.shape, dtype=torch.bfloat16)
    final = q.new_empty((N, H, HEAD_DIM, HEAD_DIM), dtype=torch.float32) if output_final_state else _no_state(q)
    qk_rstd = q.new_empty((2, *qk.shape[:3]), dtype=torch.float32) if qk_l2norm else _no_state(q)
    if not save:
        return o, final, qk_rstd
    rows = max_chunks(T, N)
    token = lambda width: q.new_empty((1, T, H, width), dtype=torch.bfloat16)  # noqa: E731
    shapes = {"gamma": q.new_empty((rows, H, HEAD_DIM), dtype=torch.float32),
              "tape": q.new_empty((rows, H, HEAD_DIM, HEAD_DIM), dtype=torch.float32),
              "aqk": token(CHUNK), "akk_inv": token(CHUNK)}
    return (o, final, *(shapes[name] if name in shapes else token(HEAD_DIM) for name in SAVED), qk_rstd)


# The ops' gate arguments (last, with defaults): A_log [H] and dt_bias [H, 128] fp32 (contiguous), gate_kind
# (kda.GATE_RAW: g is the log decay; GATE_SOFTPLUS, GATE_SIGMOID: g is the raw gate, activated in the
# kernels) and lower_bound (GATE_SIGMOID). The backward ops return dA_log and ddt_bias after the six
# gradients ([0] without the activation).
# qk_l2norm (the forward ops' argument after the gate's): use_qk_l2norm_in_kernel inside kda_fwd_chunk and
# kda_bwd_gate, q and k raw; the forward ops return qk_rstd last, which the backward ops take after the gate's.
# beta_kind (last; kda.BETA_KINDS): BETA_PLAIN: beta is beta (bf16); BETA_SIGMOID, BETA_SIGMOID_2: beta is the
# logits (bf16 or fp32), activated in the kernels, and dbeta their gradient in their dtype.

@torch.library.custom_op("kda_aot::chunk_kda_fwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def chunk_kda_fwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                     cu_seqlens: Tensor, scale: float, output_final_state: bool, A_log: Optional[Tensor] = None,
                     dt_bias: Optional[Tensor] = None, gate_kind: int = 0, lower_bound: float = 0.0,
                     qk_l2norm: bool = False, beta_kind: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """(o, final_state or [0], qk_rstd or [0]); the backward replays the forward kernels from the inputs."""
    return _forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, False,
                    _gate_of(A_log, dt_bias, gate_kind, lower_bound), qk_l2norm, beta_kind)


@chunk_kda_fwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, A_log=None, dt_bias=None,
      gate_kind=0, lower_bound=0.0, qk_l2norm=False, beta_kind=0):
    return _fake_forward(v, initial_state, cu_seqlens, output_final_state, False, q, qk_l2norm)


@torch.library.custom_op("kda_aot::chunk_kda_fwd_saved", mutates_args=(), tags=PLANNED_FROM_HOST)
def chunk_kda_fwd_saved_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Optional[Tensor], cu_seqlens: Tensor, scale: float,
                           output_final_state: bool, A_log: Optional[Tensor] = None,
                           dt_bias: Optional[Tensor] = None, gate_kind: int = 0, lower_bound: float = 0.0,
                           qk_l2norm: bool = False, beta_kind: int = 0
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                      Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o, final_state or [0], *the saved context in SAVED order, qk_rstd or [0]) for the saved-context
    backward."""
    return _forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, True,
                    _gate_of(A_log, dt_bias, gate_kind, lower_bound), qk_l2norm, beta_kind)


@chunk_kda_fwd_saved_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, A_log=None, dt_bias=None,
      gate_kind=0, lower_bound=0.0, qk_l2norm=False, beta_kind=0):
    return _fake_forward(v, initial_state, cu_seqlens, output_final_state, True, q, qk_l2norm)


# ----------------------------------------------------------------------------------- backward

def _backward_result(q, beta, tables, grads, decay, dfinal_state):
    dq, dk, dv, dg, dbeta, dh0, *gate_grads = grads
    if decay is None:
        dh0 = _no_state(q)
    else:
        dh0 = tables.document_rows(dh0 * decay, dfinal_state)
    da_log, ddt_bias = kda_backward.gate_parameter_grads(*gate_grads) if gate_grads else (_no_state(q), _no_state(q))
    return dq, dk, dv, dg, dbeta.to(beta.dtype), dh0, da_log, ddt_bias


def _qk_norm_of(qk_rstd: Optional[Tensor]):
    """The forward's kda.QkL2Norm from its qk_rstd output (None, or [0]: q, k were not normalised in the kernels)."""
    if qk_rstd is None or qk_rstd.numel() == 0 and qk_rstd.dim() == 1:
        return None
    qk_rstd = qk_rstd.contiguous()
    return kda.QkL2Norm(qk_rstd[0], qk_rstd[1], L2NORM_EPS)


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


def _zero_gate_grads(q, gate):
    """dA_log, ddt_bias of a pack with no token: zeros ([0] without the gate's activation); q: v (its heads)."""
    if gate is None:
        return _no_state(q), _no_state(q)
    return (torch.zeros(q.shape[2], device=q.device, dtype=torch.float32),
            torch.zeros(q.shape[2], HEAD_DIM, device=q.device, dtype=torch.float32))


@torch.library.custom_op("kda_aot::chunk_kda_bwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def chunk_kda_bwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                     cu_seqlens: Tensor, scale: float, do: Tensor, dfinal_state: Optional[Tensor],
                     A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None, gate_kind: int = 0,
                     lower_bound: float = 0.0, qk_rstd: Optional[Tensor] = None, beta_kind: int = 0
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Replay backward: the forward kernels again, then the backward ones. (dq, dk, dv, dg, dbeta,
    d_initial_state or [0], dA_log or [0], ddt_bias or [0]). qk_rstd: the forward's (q, k normalised in the
    kernels; dq, dk then raw q's and k's)."""
    q, k, v, g, beta, h0, do, dht = _contiguous(q, k, v, g, beta, initial_state, do, dfinal_state)
    gate = _gate_of(A_log, dt_bias, gate_kind, lower_bound)
    tables = kda.tables_of(cu_seqlens, q.shape[1], q.device)
    if tables.n_segments == 0:
        return _empty_backward(q, k, v, g, beta, tables, h0, dht, gate)
    h0, decay = _entering(h0, g, tables, gate)
    grads = kda_backward.replay_backward(q, k, v, g, beta, h0, tables, scale, do, tables.segment_rows(dht), gate,
                                         _qk_norm_of(qk_rstd), beta_kind)
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
      gate_kind=0, lower_bound=0.0, qk_rstd=None, beta_kind=0):
    return _fake_backward(q, k, v, g, beta, initial_state, gate_kind)


@torch.library.custom_op("kda_aot::chunk_kda_bwd_saved", mutates_args=(), tags=PLANNED_FROM_HOST)
def chunk_kda_bwd_saved_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Optional[Tensor], cu_seqlens: Tensor, scale: float,
                           w: Tensor, u: Tensor, qg: Tensor, kg: Tensor, aqk: Tensor, gamma: Tensor,
                           akk_inv: Tensor, tape: Tensor, vnew: Tensor, do: Tensor, dfinal_state: Optional[Tensor],
                           A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None, gate_kind: int = 0,
                           lower_bound: float = 0.0, qk_rstd: Optional[Tensor] = None, beta_kind: int = 0
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
                 chain_lengths=tables.chain_lengths, scale=scale, gate=gate, qk_norm=_qk_norm_of(qk_rstd),
                 beta_kind=beta_kind)
    grads = kda_backward.chunk_kda_bwd(saved, do, tables.segment_rows(dht), release=True)
    decay = None if h0 is None else _entering_decay(g, tables, gate)
    return _backward_result(q, beta, tables, grads, decay, dht)


@chunk_kda_bwd_saved_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, w, u, qg, kg, aqk, gamma, akk_inv, tape, vnew, do,
      dfinal_state, A_log=None, dt_bias=None, gate_kind=0, lower_bound=0.0, qk_rstd=None, beta_kind=0):
    return _fake_backward(q, k, v, g, beta, initial_state, gate_kind)


# ----------------------------------------------------------------------------------- autograd

def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, _, A_log, dt_bias, gate_kind, lower_bound = inputs[:13]
    beta_kind = inputs[14]  # after qk_l2norm (inputs[13]), which the backward reads off qk_rstd
    ctx.scale, ctx.gate_kind, ctx.lower_bound, ctx.beta_kind = scale, gate_kind, lower_bound, beta_kind
    ctx.has_initial_state = initial_state is not None
    ctx.set_materialize_grads(False)  # unused outputs (final_state, the saved context, qk_rstd) get no zero gradient
    # raw q, k and qk_rstd (the last output) with qk_l2norm: the backward normalises in the kernels again
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, *output[2:])
    ctx.mark_non_differentiable(*output[2:])


def _backward(ctx, do, dfinal_state, *_):
    q, k, v, g, beta, h0, cu_seqlens, A_log, dt_bias, *context, qk_rstd = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    if dfinal_state is not None and dfinal_state.numel() == 0:
        dfinal_state = None
    gate = (A_log, dt_bias, ctx.gate_kind, ctx.lower_bound)
    # keywords only where the call needs them: the forward's rstd (qk_l2norm), beta's activation
    kwargs = {"qk_rstd": qk_rstd} if qk_rstd.dim() > 1 else {}
    if ctx.beta_kind != kda.BETA_PLAIN:
        kwargs["beta_kind"] = ctx.beta_kind
    if context:
        grads = chunk_kda_bwd_saved_op(q, k, v, g, beta, h0, cu_seqlens, ctx.scale, *context, do, dfinal_state, *gate,
                                       **kwargs)
    else:
        grads = chunk_kda_bwd_op(q, k, v, g, beta, h0, cu_seqlens, ctx.scale, do, dfinal_state, *gate, **kwargs)
    dq, dk, dv, dg, dbeta, dh0, da_log, ddt_bias = grads
    gated = ctx.gate_kind != kda.GATE_RAW
    return (dq, dk, dv, dg, dbeta, dh0 if ctx.has_initial_state else None, None, None, None,
            da_log if gated and A_log is not None else None, ddt_bias if gated and dt_bias is not None else None,
            None, None, None, None)  # gate_kind, lower_bound, qk_l2norm, beta_kind


chunk_kda_fwd_op.register_autograd(_backward, setup_context=_setup_context)
chunk_kda_fwd_saved_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------- public op

def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, raw_gate=False, beta_logits=False):
    """Checks that need only shapes, dtypes and devices (the values of cu_seqlens are checked by the op,
    before any kernel of it runs). raw_gate: g is the raw gate the kernels activate, fp32 or bf16; beta_logits:
    beta is the logits the kernels activate, bf16 or fp32."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, t in (("initial_state", initial_state), ("cu_seqlens", cu_seqlens),
                    ("cu_seqlens_cpu", cu_seqlens_cpu)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q: expected shape [B, T, H, 128], got {list(q.shape)}")
    B, T, H = q.shape[:3]
    if q.shape[3] != HEAD_DIM:
        raise ValueError(f"q: head dim must be 128, got {q.shape[3]}")
    if H > MAX_HEADS:
        raise ValueError(f"q: at most {MAX_HEADS} heads, got {H}")
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {list(q.shape)} (as q), got {list(k.shape)}")
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, T) or v.shape[3] != HEAD_DIM:
        raise ValueError(f"v: expected shape [{B}, {T}, HV, 128] (HV a multiple of q's H = {H}), got "
                         f"{list(v.shape)}")
    HV = v.shape[2]
    if HV % H != 0:
        raise ValueError(f"v: its heads (HV = {HV}) must be a multiple of q's and k's (H = {H})")
    if HV > MAX_HEADS:
        raise ValueError(f"v: at most {MAX_HEADS} heads, got {HV}")
    if g.shape != v.shape:
        raise ValueError(f"g: expected shape {list(v.shape)} (as v), got {list(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta: expected shape [{B}, {T}, {HV}], got {list(beta.shape)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"q: with cu_seqlens the documents are packed in one sequence (B = 1), got B = {B}")
    for name, t, dtype in (("q", q, torch.bfloat16), ("k", k, torch.bfloat16), ("v", v, torch.bfloat16),
                           ("g", g, torch.float32), ("beta", beta, torch.bfloat16),
                           ("initial_state", initial_state, torch.float32)):
        if name == "g" and raw_gate and t.dtype == torch.bfloat16:
            continue
        if name == "beta" and beta_logits and t.dtype == torch.float32:
            continue
        if t is not None and t.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {str(dtype).replace('torch.', '')}, got {t.dtype}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name}: on {t.device} but q is on {q.device}")
    if cu_seqlens is not None:
        if cu_seqlens.device.type != "cpu" and cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens: on {cu_seqlens.device}; expected the CPU or {q.device}")
    if cu_seqlens_cpu is not None:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens_cpu: give cu_seqlens too (cu_seqlens_cpu is its copy on the CPU)")
        if cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu: expected a CPU tensor, got one on {cu_seqlens_cpu.device}")
        if cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cpu: expected shape {list(cu_seqlens.shape)} (as cu_seqlens), got "
                             f"{list(cu_seqlens_cpu.shape)}")
        if cu_seqlens.device.type == "cpu" and not torch.equal(cu_seqlens_cpu.long(), cu_seqlens.long()):
            raise ValueError("cu_seqlens_cpu: must hold cu_seqlens' values (both are on the CPU here, so it is "
                             "checked; a device cu_seqlens is not read back for it)")


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, chunk_size=64,
              backward=None, transpose_state_layout=None):
    """Chunked KDA, differentiable, with flash-linear-attention 0.6.0's chunk_kda signature: the same
    parameters in the same order and the same meaning, A_log and dt_bias as keywords.

    q, k [B, T, H, 128] bf16; v [B, T, HV, 128] bf16 and g [B, T, HV, 128], beta [B, T, HV] with HV a
    multiple of H (grouped value heads: value head j reads q, k head j // (HV / H)); initial_state
    [N, HV, 128, 128] fp32 ([N, HV, V, K] with state_v_first, and so the final state). Packed documents:
    B = 1 and cu_seqlens [N + 1] int32/int64, non-decreasing (zero-length documents are legal), on the
    CPU or q's device; on the device, give its CPU copy as cu_seqlens_cpu to spare the host sync that
    reads it (the two must hold the same values). Without cu_seqlens, B sequences of T tokens (N = B).
    Any strides. Returns (o [B, T, HV, 128] bf16, final_state or None).

    g: the log decay (fp32; a narrower float is widened exactly), or with use_gate_in_kernel the raw
    gate, activated as -exp(A_log) * softplus(g + dt_bias), or lower_bound * sigmoid(exp(A_log) *
    (g + dt_bias)) when lower_bound is set (A_log [HV], dt_bias [HV * K], optional with lower_bound /
    always). beta: bf16, or with use_beta_sigmoid_in_kernel the logits b: sigmoid(b) (2 sigmoid(b) with
    allow_neg_eigval). use_qk_l2norm_in_kernel: q and k L2-normalised per head first (differentiably).
    safe_gate: FLA's hint that gates are bounded (with use_gate_in_kernel it needs lower_bound in
    [-5, 0)); our kernels are exact for every g <= 0 and need no hint.
    backward (ours): "replay" keeps only the inputs and reruns the forward kernels in the backward (a
    head group at a time when memory is short); "saved" keeps the tape and the chunk intermediates,
    as FLA's disable_recompute=True. The two give bitwise equal gradients.
    Not served, with an error naming them: cp_context (kda_aot.cp.chunk_kda_cp is the context-parallel
    op), return_intermediate_states, use_graph (our ops capture in CUDA graphs as they are), chunk sizes
    other than 64, head dims other than 128."""
    mode = _backward_mode(backward, disable_recompute)
    if transpose_state_layout is not None:  # FLA's deprecated name of state_v_first
        if state_v_first:
            raise ValueError("state_v_first: give it or the deprecated transpose_state_layout, not both")
        warnings.warn("transpose_state_layout is deprecated: use state_v_first", DeprecationWarning, stacklevel=2)
        state_v_first = bool(transpose_state_layout)
    _refuse_unserved(cp_context, return_intermediate_states, use_graph, max_num_seqs, chunk_size)
    if not isinstance(k, torch.Tensor):
        raise TypeError(f"k: expected a torch.Tensor, got {type(k).__name__}")
    # On the GPU the kernels activate the raw gate (kernel_gate); elsewhere activate() does, in torch.
    gate_args = ()
    if use_gate_in_kernel and isinstance(g, torch.Tensor) and g.is_cuda:
        g, gate_args = kernel_gate(g, A_log, dt_bias, lower_bound, safe_gate)
        use_gate_in_kernel, A_log, dt_bias = False, None, None
    # beta's activation always runs in the kernels: the op takes the logits and beta_kind
    beta_kind = kda.BETA_PLAIN
    if use_beta_sigmoid_in_kernel and isinstance(beta, torch.Tensor):
        beta, beta_kind = kernel_beta(beta, allow_neg_eigval)
    g, beta = activate(q, v, g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                       lower_bound=lower_bound, safe_gate=safe_gate, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                       allow_neg_eigval=allow_neg_eigval, beta_dtype=torch.bfloat16, raw_gate_in_kernels=bool(gate_args),
                       beta_logits_in_kernels=beta_kind != kda.BETA_PLAIN)
    if state_v_first and initial_state is not None:
        _check_v_first_state(initial_state, v)
        initial_state = initial_state.transpose(-1, -2)
    fused_norm = False
    if use_qk_l2norm_in_kernel:
        _check_head_dim(q, "q")
        fused_norm = _qk_l2norm_in_kernels(q)
        if not fused_norm:
            q, k = _qk_l2norm(q, k)
    o, final = _chunk_kda_packed(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                 cu_seqlens_cpu, mode, gate_args, fused_norm, beta_kind)
    if state_v_first and final is not None:
        final = final.transpose(-1, -2)
    return o, final


def _backward_mode(backward, disable_recompute) -> str:
    if backward is None:
        return "saved" if disable_recompute else "replay"
    if backward not in BACKWARD_MODES:
        raise ValueError(f"backward: expected one of {BACKWARD_MODES}, got {backward!r}")
    if disable_recompute and backward != "saved":
        raise ValueError(f"disable_recompute=True is backward='saved'; got backward={backward!r} as well")
    return backward


def _refuse_unserved(cp_context, return_intermediate_states, use_graph, max_num_seqs, chunk_size):
    if cp_context is not None:
        raise NotImplementedError("cp_context: kda_aot's context parallelism is kda_aot.cp.chunk_kda_cp "
                                  "(a CPPlan over a torch.distributed group), not FLA's FLACPContext")
    if return_intermediate_states:
        raise NotImplementedError("return_intermediate_states: the per-chunk states for inference are not "
                                  "served by kda_aot")
    if use_graph or max_num_seqs is not None:
        raise NotImplementedError("use_graph, max_num_seqs: not needed: kda_aot's ops capture in CUDA graphs as "
                                  "they are (warm up eagerly first)")
    if chunk_size != CHUNK:
        raise NotImplementedError(f"chunk_size: kda_aot's kernels run chunks of {CHUNK} tokens, got {chunk_size}")


def _qk_l2norm_in_kernels(q) -> bool:
    """use_qk_l2norm_in_kernel inside kda_fwd_chunk and kda_bwd_gate (q, k read raw, their normalised copies
    never written): on the GPU unless Options.qk_l2norm_fused is off (the l2norm op first, bitwise the same)."""
    return isinstance(q, torch.Tensor) and q.is_cuda and options.current().qk_l2norm_fused


def _qk_l2norm(q, k):
    """use_qk_l2norm_in_kernel: q and k normalised per head (the norm's kernel is the op's first: the refusal of
    CPU tensors comes here, naming q)."""
    require_cuda(q, "q", "chunk_kda")
    return l2norm(q), l2norm(k)


def _check_v_first_state(h0, v):
    """A V-first initial state's heads and (V, K) as the caller gave them (the checks after it see it transposed;
    they check N, which the transpose keeps)."""
    if not isinstance(h0, torch.Tensor):
        raise TypeError(f"initial_state: expected a torch.Tensor, got {type(h0).__name__}")
    if h0.dim() != 4 or tuple(h0.shape[1:]) != (v.shape[2], HEAD_DIM, HEAD_DIM):
        raise ValueError(f"initial_state: expected shape [N, {v.shape[2]}, {HEAD_DIM}, {HEAD_DIM}] ([N, HV, V, K] "
                         f"with state_v_first=True), got {list(h0.shape)}")


def _check_head_dim(x, name):
    if x.dim() == 4 and x.shape[3] != HEAD_DIM:
        raise ValueError(f"{name}: head dim must be 128, got {x.shape[3]}")


def _chunk_kda_packed(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                      backward, gate_args=(), qk_l2norm=False, beta_kind=kda.BETA_PLAIN):
    """The KDA op on checked inputs (q, k of H heads, the rest of HV; q and k already normalised when asked, or
    with qk_l2norm normalised in the kernels); gate_args: the kernels' gate activation (kernel_gate), g then the
    raw gate; beta_kind: beta's (kernel_beta), beta then the logits."""
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, raw_gate=bool(gate_args),
                  beta_logits=beta_kind != kda.BETA_PLAIN)
    B, T = q.shape[0], q.shape[1]
    if cu_seqlens is None:  # B equal-length sequences = B packed documents of T tokens
        cu = torch.arange(B + 1, dtype=torch.int32, device="cpu") * T
        q, k, v, g = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g))
        beta = beta.reshape(1, B * T, beta.shape[2])
    else:
        cu = cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    scale = HEAD_DIM ** -0.5 if scale is None else float(scale)
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state, *gate_args[:2]))
    fwd = chunk_kda_fwd_saved_op if backward == "saved" and wants_grad else chunk_kda_fwd_op
    # keywords only where the call needs them: the plain call's op call as it was
    kwargs = {"qk_l2norm": True} if qk_l2norm else {}
    if beta_kind != kda.BETA_PLAIN:
        kwargs["beta_kind"] = beta_kind
    o, final = fwd(q, k, v, g, beta, initial_state, cu, scale, bool(output_final_state), *gate_args, **kwargs)[:2]
    return o.reshape(B, T, *o.shape[2:]), (final if output_final_state else None)
