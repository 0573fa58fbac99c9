"""kda_aot.chunk_kda: flash-linear-attention 0.6.0's chunk_kda (its signature, defaults and flags) on the
kernels. The input checks that need only shapes, dtypes and devices run here, before any op; the ops
themselves (custom ops with fake implementations and autograd: torch.compile and CUDA graphs) are in
chunk_kda_ops.
"""
import inspect
import warnings

import torch
from torch._subclasses.fake_tensor import is_fake

from ..schedule import kda
from ..schedule.kda import HEAD_DIM
from .chunk_kda_ops import _contiguous, chunk_kda_fwd_op, chunk_kda_fwd_saved_op
from .gate import activate, kernel_beta, kernel_gate
from .norm import l2norm
from .._runtime.packing import CHUNK, host_copy
from .._runtime.tensor import (boundaries_tensor, check_cu_seqlens, check_cu_seqlens_cpu, checked_flag, checked_scale,
                               require_cuda)

BACKWARD_MODES = ("replay", "saved")


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, raw_gate=False, beta_logits=False):
    """Checks that need only dtypes and devices, on tensors of checked shapes (kda.check_shapes: chunk_kda's first
    check; the values of cu_seqlens are checked by the op, before any kernel of it runs). raw_gate: g is the raw
    gate the kernels activate, fp32 or bf16; beta_logits: beta is the logits the kernels activate, bf16 or fp32."""
    B = q.shape[0]
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
            hint = "" if dtype != torch.bfloat16 else (
                f" (the kernels compute on bf16 operands: cast with .to(torch.bfloat16), as autocast's projections "
                f"give them; FLA would compute in {str(t.dtype).replace('torch.', '')})")
            raise TypeError(f"{name}: expected dtype {str(dtype).replace('torch.', '')}, got {t.dtype}{hint}")
    if cu_seqlens is not None:
        if cu_seqlens.device.type != "cpu" and cu_seqlens.device != q.device:
            where = "the CPU" if q.device.type == "cpu" else f"the CPU or {q.device}"
            raise ValueError(f"cu_seqlens: on {cu_seqlens.device}; expected {where}")
    check_cu_seqlens_cpu(cu_seqlens, cu_seqlens_cpu)


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
    [N, HV, 128, 128] fp32 ([N, HV, V, K] with state_v_first, and so the final state: the transposed view of the
    kernels' [N, HV, K, V] buffer, not a copy - call .contiguous() before .view(); passed back as the next call's
    initial state it is read with no copy). Packed documents:
    B = 1 and cu_seqlens [N + 1] int32/int64, non-decreasing (zero-length documents are legal), on the
    CPU or q's device, or a list of ints; a device tensor is read to the host once (a sync) and that copy
    reused while the tensor lives unwritten, or give its CPU copy as cu_seqlens_cpu (the two must hold the same values) and no
    call syncs. Without cu_seqlens, B sequences of T tokens (N = B).
    Any strides. Returns (o [B, T, HV, 128] bf16, final_state or None).

    g: the log decay (fp32; a narrower float is widened exactly), or with use_gate_in_kernel the raw
    gate, activated as -exp(A_log) * softplus(g + dt_bias), or lower_bound * sigmoid(exp(A_log) *
    (g + dt_bias)) when lower_bound is set. A_log [HV] is required unless lower_bound is set; dt_bias
    [HV * K] is optional (zero when not given). beta: bf16, or with use_beta_sigmoid_in_kernel the logits b: sigmoid(b) (2 sigmoid(b) with
    allow_neg_eigval). use_qk_l2norm_in_kernel: q and k L2-normalised per head first (differentiably).
    safe_gate: FLA's hint that gates are bounded (with use_gate_in_kernel it needs lower_bound in
    [-5, 0)); our kernels are exact for every g <= 0 and need no hint. Without use_gate_in_kernel, safe_gate
    and lower_bound have nothing to act on and are not used (as in FLA).
    backward (ours): "replay" keeps the inputs and each chunk's tril(Aqk) and (I + L)^-1 (256 bytes a token-head,
    as FLA's default keeps its Aqk and Akk) and reruns the rest of the forward kernels in the backward (a
    head group at a time when memory is short); "saved" keeps the tape and the chunk intermediates,
    as FLA's disable_recompute=True. The two give bitwise equal gradients.
    transpose_state_layout: FLA's deprecated name of state_v_first (a DeprecationWarning; not both).
    Not served, with an error naming them: cp_context (kda_aot.cp.chunk_kda_cp is the context-parallel
    op), return_intermediate_states, use_graph (our ops capture in CUDA graphs as they are), chunk sizes
    other than 64, head dims other than 128."""
    (output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
     safe_gate, disable_recompute, return_intermediate_states, state_v_first, use_graph) = checked_flags(
        output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        safe_gate, disable_recompute, return_intermediate_states, state_v_first, use_graph)
    mode = _backward_mode(backward, disable_recompute)
    if transpose_state_layout is not None:  # FLA's deprecated name of state_v_first
        if state_v_first:
            raise ValueError("state_v_first: give it or the deprecated transpose_state_layout, not both")
        warnings.warn("transpose_state_layout is deprecated: use state_v_first", DeprecationWarning, stacklevel=2)
        state_v_first = checked_flag("transpose_state_layout", transpose_state_layout)
    _refuse_unserved(cp_context, return_intermediate_states, use_graph, max_num_seqs, chunk_size)
    cu_seqlens = boundaries_tensor(cu_seqlens)
    scale = checked_scale(scale, HEAD_DIM)
    kda.check_shapes(q, k, v, g, beta, initial_state, packed=False)  # first: the gate's parameters need g's heads
    # On the GPU the kernels activate the raw gate (kernel_gate); elsewhere activate() does, in torch.
    gate_args = ()
    if use_gate_in_kernel and g.is_cuda:
        g, gate_args = kernel_gate(g, A_log, dt_bias, lower_bound, safe_gate)
        use_gate_in_kernel, A_log, dt_bias = False, None, None
    # beta's activation always runs in the kernels: the op takes the logits and beta_kind
    beta_kind = kda.BETA_PLAIN
    if use_beta_sigmoid_in_kernel:
        beta, beta_kind = kernel_beta(beta, allow_neg_eigval)
    g, beta = activate(g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                       lower_bound=lower_bound, safe_gate=safe_gate, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                       allow_neg_eigval=allow_neg_eigval, beta_dtype=torch.bfloat16, raw_gate_in_kernels=len(gate_args) > 0,
                       beta_logits_in_kernels=beta_kind != kda.BETA_PLAIN)
    if use_gate_in_kernel and g.dtype == torch.float64:  # activated in torch (off the GPU): fp32, as the kernels
        g = g.float()
    if state_v_first and initial_state is not None:
        _check_v_first_state(initial_state, v)
        initial_state = initial_state.transpose(-1, -2)
    o, final = _chunk_kda_packed(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                 cu_seqlens_cpu, mode, gate_args, beta_kind, qk_l2norm=use_qk_l2norm_in_kernel)
    if state_v_first and final is not None:
        final = final.transpose(-1, -2)
    return o, final


# FLA's switches among chunk_kda's parameters (those whose default is False), in the signature's order: each a bool
# (checked_flag), here and in the FLA backend's verifier.
FLAGS = tuple(name for name, p in inspect.signature(chunk_kda).parameters.items() if p.default is False)


def checked_flags(*values) -> tuple:
    """A chunk_kda call's FLAGS, given in FLAGS' order, each checked (values, not the caller's locals(): dynamo
    before torch 2.13 cannot trace locals())."""
    if len(values) != len(FLAGS):
        raise TypeError(f"checked_flags: expected the {len(FLAGS)} values of {FLAGS}, got {len(values)}")
    return tuple(checked_flag(name, value) for name, value in zip(FLAGS, values))


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


def _qk_l2norm(q, k):
    """use_qk_l2norm_in_kernel: q and k normalised per head by the l2norm op, once: its output is what the
    forward, the replay and the backward read (not inside each of them: docs/forward.md says why).
    The norm's kernel is the op's first: the refusal of CPU tensors comes here, naming q, after every other check."""
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


def _chunk_kda_packed(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                      backward, gate_args=(), beta_kind=kda.BETA_PLAIN, qk_l2norm=False):
    """The KDA op on checked inputs (q, k of H heads, the rest of HV); gate_args: the kernels' gate activation
    (kernel_gate), g then the raw gate; beta_kind: beta's (kernel_beta), beta then the logits; qk_l2norm: q and k
    normalised first (after every check, the boundaries' values included: the norm's kernels run first)."""
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, raw_gate=len(gate_args) > 0,
                  beta_logits=beta_kind != kda.BETA_PLAIN)
    B, T = q.shape[0], q.shape[1]
    if cu_seqlens is None:  # B equal-length sequences = B packed documents of T tokens
        cu = torch.arange(B + 1, dtype=torch.int32, device="cpu") * T
        q, k, v, g = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g))
        beta = beta.reshape(1, B * T, beta.shape[2])
    else:
        # a device cu_seqlens read once per tensor (host_copy), not by each op: no host sync in later layers or the
        # backward; under torch.compile the op reads it (a traced op cannot keep a host cache)
        cu = cu_seqlens_cpu if cu_seqlens_cpu is not None else (
            cu_seqlens if torch.compiler.is_compiling() else host_copy(cu_seqlens))
        if qk_l2norm and cu.device.type == "cpu" and not torch.compiler.is_compiling() and not is_fake(cu):
            check_cu_seqlens(cu, T)  # (traced, the op checks it)
    if initial_state is not None and cu.dim() == 1:  # before the norm's kernels run (the op checks cu's rank)
        rows = (cu.shape[0] - 1, v.shape[2], HEAD_DIM, HEAD_DIM)
        if tuple(initial_state.shape) != rows:
            raise ValueError(f"initial_state: expected shape {list(rows)} (a row per document, HV heads), got "
                             f"{list(initial_state.shape)}")
    if qk_l2norm:
        q, k = _qk_l2norm(q, k)
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state, *gate_args[:2]))
    fwd = chunk_kda_fwd_saved_op if backward == "saved" and wants_grad else chunk_kda_fwd_op
    # a keyword only where the call needs it: the plain call passes the op its positional arguments alone
    kwargs = kda.beta_launch_args(beta_kind)
    if wants_grad and backward != "saved":  # the replay's forward keeps tril(Aqk) and inv_pack (chunk_kda_ops.KEPT)
        kwargs["keep"] = True
    o, final = fwd(q, k, v, g, beta, initial_state, cu, scale, bool(output_final_state), *gate_args, **kwargs)[:2]
    return o.reshape(B, T, *o.shape[2:]), (final if output_final_state else None)
