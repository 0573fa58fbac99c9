"""kda_aot as a backend of flash-linear-attention's chunk_kda and causal conv1d (fla-core 0.6.0's backend
dispatch).

    import kda_aot.fla      # registers the backends; FLA's KimiDeltaAttention then runs on kda_aot

chunk_kda: FLA's dispatch asks the verifier first and falls back to its Triton path for what kda_aot does not
serve: no CUDA tensor, a GPU kda_aot has no kernels for, head dims other than 128, chunk sizes other than 64,
more than 64 heads, cp_context, return_intermediate_states, use_graph, dtypes the kernels do not take,
unknown keywords.
causal_conv1d_fwd / causal_conv1d_bwd (what FLA's ShortConvolution runs in training): kda_aot's width-4 conv +
SiLU kernels serve bf16 [B, T, D] inputs (D a multiple of 8; B = 1 with cu_seqlens) with activation "silu" /
"swish" and no residual, initial state or final-state gradient; the rest runs on FLA's kernels.
FLA_KDA_AOT=0 (FLA's switch for a backend) turns every kda_aot backend off, FLA_KDA_AOT_CONV=0 the conv alone
(also with FLA_KDA_AOT=1, which FLA's own rule would read as every kda_aot backend on);
FLA_DISABLE_BACKEND_DISPATCH=1 turns off every backend.
"""
from __future__ import annotations

import inspect
import os
import sys
import warnings

import torch
from torch._subclasses.fake_tensor import is_fake

try:
    from fla.backends import BaseBackend, register
    from fla.modules.causal_conv1d import causal_conv1d_bwd as fla_conv_bwd
    from fla.modules.causal_conv1d import causal_conv1d_fwd as fla_conv_fwd
    from fla.modules.causal_conv1d import causal_conv1d_update_states as fla_conv_final_state
    from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda
except ImportError as e:  # FLA absent, one without the backend dispatch (before 0.6.0), or a dependency of FLA absent
    if e.name and e.name.partition(".")[0] != "fla":
        raise ImportError(f"kda_aot.fla: flash-linear-attention is installed but cannot be imported: it needs "
                          f"{e.name!r}, which is missing ({e})") from e
    raise ImportError(f"kda_aot.fla registers kda_aot with flash-linear-attention's backend dispatch, which it "
                      f"could not import ({e}): it needs fla-core 0.6.0 (pip install 'kda_aot[fla]': fla-core[cuda] "
                      f"0.6.0 and what it imports)") from e

from ._runtime import registry
from ._runtime.packing import host_copy
from ._runtime.tensor import boundaries_tensor, check_cu_seqlens, is_real
from .ops.chunk_kda import checked_flags, chunk_kda
from .ops.conv import CONV_WIDTH, conv1d_silu_bwd_op, conv1d_silu_fwd_op
from .reference.activations import GATE_PARAM_DTYPES
from .schedule.kda import HEAD_DIM, MAX_HEADS

BACKEND_TYPE = "kda_aot"
ENV_VAR = "FLA_KDA_AOT"
CONV_ENV_VAR = "FLA_KDA_AOT_CONV"
# keywords FLA's chunk_kda takes through **kwargs that kda_aot serves
_KEYWORDS = frozenset({"A_log", "dt_bias", "chunk_size", "transpose_state_layout"})


def verify(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
           allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
           return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
           cp_context=None, use_graph=False, max_num_seqs=None, **kwargs) -> tuple[bool, str | None]:
    """(True, None) when kda_aot serves the call, else (False, why): FLA then runs its own kernels."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v, g, beta)):
        return False, "an input is not a tensor"
    if q.device.type != "cuda":
        return False, f"inputs on {q.device}, not a CUDA device"
    if not registry.serves(q.device):
        return False, f"no kda_aot kernels for {torch.cuda.get_device_name(q.device)}"
    unknown = set(kwargs) - _KEYWORDS
    if unknown:
        return False, f"keywords kda_aot does not take: {sorted(unknown)}"
    if kwargs.get("chunk_size", 64) != 64:
        return False, f"chunk_size {kwargs['chunk_size']} (kda_aot: 64)"
    try:  # FLA reads a flag by its truthiness; kda_aot's op refuses what is not a bool
        checked_flags(output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                      allow_neg_eigval, safe_gate, disable_recompute, return_intermediate_states, state_v_first,
                      use_graph)
    except TypeError as refused:
        return False, f"{refused} (kda_aot's op takes a bool)"
    if cp_context is not None or return_intermediate_states or use_graph or max_num_seqs is not None:
        return False, "cp_context / return_intermediate_states / use_graph / max_num_seqs are FLA's own"
    if q.dim() != 4 or v.dim() != 4 or q.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return False, f"head dims {q.shape[-1]}, {v.shape[-1]} (kda_aot: 128)"
    if v.shape[2] > MAX_HEADS or v.shape[2] % q.shape[2]:
        return False, f"{v.shape[2]} value heads over {q.shape[2]} (kda_aot: at most {MAX_HEADS}, a multiple)"
    if any(t.dtype != torch.bfloat16 for t in (q, k, v)):
        return False, "q, k, v not bf16"
    if not use_beta_sigmoid_in_kernel and beta.dtype != torch.bfloat16:
        return False, f"beta in {beta.dtype} (kda_aot's kernels take bf16 beta)"
    if not g.is_floating_point() or (not use_gate_in_kernel and g.dtype == torch.float64):
        return False, f"g in {g.dtype} (kda_aot: a float32 log decay, or a narrower float it widens)"
    if initial_state is not None and initial_state.dtype != torch.float32:
        return False, "initial_state not fp32"
    if use_gate_in_kernel and lower_bound is not None and not is_real(lower_bound):
        return False, f"lower_bound of type {type(lower_bound).__name__} (kda_aot: a real number)"
    for name in ("A_log", "dt_bias"):
        t = kwargs.get(name)
        if use_gate_in_kernel and t is not None and not (isinstance(t, torch.Tensor) and t.dtype in GATE_PARAM_DTYPES):
            return False, f"{name} not a float32, bfloat16, float16 or float64 tensor"
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            return False, f"{q.shape[0]} sequences with cu_seqlens (packed input is [1, T, ...])"
        refused = _boundaries_refused(cu_seqlens, cu_seqlens_cpu, q.shape[1])
        if refused:
            return False, refused
    return True, None


def _boundaries_refused(cu_seqlens, cu_seqlens_cpu, total) -> str | None:
    """Why kda_aot's ops would refuse the boundaries' values, or None (traced, the values are unknown: the op
    checks them). FLA runs a pack padded past cu_seqlens[-1]; kda_aot's ops refuse it. No values in the reason:
    a declined call warns once per reason, and padded packs differ at every step."""
    if torch.compiler.is_compiling() or any(is_fake(t) for t in (cu_seqlens, cu_seqlens_cpu)
                                            if isinstance(t, torch.Tensor)):
        return None
    try:
        check_cu_seqlens(_host_boundaries(boundaries_tensor(cu_seqlens), cu_seqlens_cpu), total)
    except (TypeError, ValueError):
        return "cu_seqlens: not the boundaries of the whole pack (a pack padded past cu_seqlens[-1]?)"
    return None


@register(fla_chunk_kda)
class KdaAotBackend(BaseBackend):
    """chunk_kda on kda_aot's ahead-of-time compiled kernels (training: forward and both backward modes)."""

    backend_type = BACKEND_TYPE
    package_name = "kda_aot"
    env_var = ENV_VAR
    default_enable = True
    priority = 4

    def chunk_kda_verifier(self, *args, **kwargs):
        ok, why = verify(*args, **kwargs)
        if not ok:
            q = _CALL.bind_partial(*args, **kwargs).arguments.get("q")
            if isinstance(q, torch.Tensor) and q.device.type == "cuda" and registry.serves(q.device):
                _warn_declined(why)
        return ok, why

    def chunk_kda(self, *args, **kwargs):
        if "A_log" in kwargs or "dt_bias" in kwargs:
            gate = args[_GATE_ARG] if len(args) > _GATE_ARG else kwargs.get("use_gate_in_kernel", False)
            if not gate:  # FLA reads A_log and dt_bias only with use_gate_in_kernel (kda_aot.chunk_kda refuses them)
                kwargs.pop("A_log", None)
                kwargs.pop("dt_bias", None)
        return chunk_kda(*args, **kwargs)


_CALL = inspect.signature(verify)  # FLA 0.6.0's chunk_kda parameters
_GATE_ARG = list(_CALL.parameters).index("use_gate_in_kernel")
_WARNED: set = set()


def _warn_declined(why: str) -> None:
    """A KDA call on a GPU kda_aot serves that runs on FLA's kernels is a slow step the user did not ask for:
    said once per reason (FLA itself logs it at info level only)."""
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"kda_aot.fla: FLA's chunk_kda runs this call on its own Triton kernels, not on kda_aot's: "
                      f"{why}", stacklevel=_caller_level())


def _caller_level() -> int:
    """warnings.warn's stacklevel of the first frame outside kda_aot, FLA and torch (the dispatch wrapper, its
    compiler.disable frames, nn.Module's call): where the user's code called."""
    skip = tuple(os.path.dirname(f) for f in (torch.__file__, getattr(sys.modules.get("fla"), "__file__", None),
                                              __file__) if f)
    frame, level = sys._getframe(2), 2  # level 2: _warn_declined's caller
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


# ------------------------------------------------------------------ causal conv1d (FLA's ShortConvolution)

def conv_fwd_verify(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
                    activation=None, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64,
                    layout_fallback=False) -> tuple[bool, str | None]:
    """(True, None) when kda_aot's conv kernels serve FLA's causal_conv1d_fwd call, else (False, why)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return False, "x or weight is not a tensor"
    if x.device.type != "cuda":
        return False, f"x on {x.device}, not a CUDA device"
    if not registry.serves(x.device):
        return False, f"no kda_aot kernels for {torch.cuda.get_device_name(x.device)}"
    if activation not in ("silu", "swish"):
        return False, f"activation {activation!r} (kda_aot's conv: silu)"
    if x.dim() != 3 or x.dtype != torch.bfloat16:
        return False, f"x {x.dtype} of shape {list(x.shape)} (kda_aot's conv: bf16 [B, T, D])"
    D = x.shape[-1]
    if D % 8:
        return False, f"D = {D} (kda_aot's conv: a multiple of 8)"
    if tuple(weight.shape) != (D, CONV_WIDTH) or not weight.is_floating_point():
        return False, f"weight {weight.dtype} of shape {list(weight.shape)} (kda_aot's conv: width {CONV_WIDTH}, [D, 4])"
    if bias is not None and (tuple(bias.shape) != (D,) or not bias.is_floating_point()):
        return False, f"bias of shape {list(bias.shape)} (kda_aot's conv: [D])"
    if residual is not None or initial_state is not None:
        return False, "residual / initial_state are FLA's own"
    if cu_seqlens is not None:
        if x.shape[0] != 1:
            return False, f"{x.shape[0]} sequences with cu_seqlens (packed input is [1, T, D])"
        refused = _boundaries_refused(cu_seqlens, cu_seqlens_cpu, x.shape[1])
        if refused:
            return False, refused
    if any(t is not None and t.device != x.device for t in (weight, bias)):
        return False, "weight or bias on another device than x"
    return True, None


def conv_bwd_verify(x, dy, dht, weight=None, bias=None, residual=None, initial_state=None, activation=None,
                    cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64,
                    layout_fallback=False) -> tuple[bool, str | None]:
    """(True, None) when kda_aot's conv kernels serve FLA's causal_conv1d_bwd call, else (False, why)."""
    if dht is not None:
        return False, "a final-state gradient is FLA's own"
    if not isinstance(dy, torch.Tensor) or tuple(dy.shape) != tuple(x.shape) or dy.dtype != x.dtype:
        return False, "dy not of x's shape and dtype (FLA reads a wider dy as it is)"
    return conv_fwd_verify(x, weight, bias, residual, initial_state, False, activation, cu_seqlens, cu_seqlens_cpu)


def _host_boundaries(cu_seqlens, cu_seqlens_cpu):
    """cu_seqlens on the host: a device tensor is copied once while it lives unwritten (host_copy): FLA's layer
    hands its three convs and their backward the same tensor."""
    return cu_seqlens_cpu if cu_seqlens_cpu is not None else host_copy(cu_seqlens)


def _packed(x, cu_seqlens, cu_seqlens_cpu):
    """(x as one [1, B T, D] pack, its document boundaries on the host): B sequences of T tokens without
    cu_seqlens."""
    if cu_seqlens is not None:
        return x, _host_boundaries(cu_seqlens, cu_seqlens_cpu)
    B, T, D = x.shape
    return x.reshape(1, B * T, D), torch.arange(B + 1, dtype=torch.int64) * T


class KdaAotConvBackend(BaseBackend):
    """causal_conv1d_fwd / _bwd on kda_aot's conv + SiLU kernels."""

    backend_type = BACKEND_TYPE
    package_name = "kda_aot"
    env_var = CONV_ENV_VAR
    default_enable = True
    priority = 4

    def is_enabled(self) -> bool:
        # Either switch at 0 turns it off (FLA's own rule would let FLA_KDA_AOT=1 override the conv's 0)
        return os.environ.get(ENV_VAR, "1") != "0" and os.environ.get(CONV_ENV_VAR, "1") != "0"


@register(fla_conv_fwd, backend=KdaAotConvBackend, verifier=conv_fwd_verify)
def conv_fwd(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False, activation=None,
             cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64, layout_fallback=False):
    """FLA's causal_conv1d_fwd on the kernels: (y, the final conv state or None)."""
    packed, cu = _packed(x, cu_seqlens, cu_seqlens_cpu)
    y = conv1d_silu_fwd_op(packed, weight, bias, None, cu, "default").view(x.shape)
    final_state = None
    if output_final_state:  # FLA's state layout: its own helper
        final_state = fla_conv_final_state(x=x, state_len=CONV_WIDTH, initial_state=None, cu_seqlens=cu_seqlens)
    return y, final_state


@register(fla_conv_bwd, backend=KdaAotConvBackend, verifier=conv_bwd_verify)
def conv_bwd(x, dy, dht, weight=None, bias=None, residual=None, initial_state=None, activation=None,
             cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64, layout_fallback=False):
    """FLA's causal_conv1d_bwd on the kernels: (dx, dweight, dbias, dresidual, d initial state), the last two
    None (no residual, no initial state)."""
    packed, cu = _packed(x, cu_seqlens, cu_seqlens_cpu)
    dx, dw, db, _ = conv1d_silu_bwd_op(packed, weight, bias, None, cu, dy.reshape(packed.shape), "default", False)
    return dx.view(x.shape), dw, db if bias is not None else None, None, None
