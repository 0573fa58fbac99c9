"""kda_aot as a backend of flash-linear-attention's chunk_kda (fla-core 0.6.0's backend dispatch).

    import kda_aot.fla      # registers the backend; fla.ops.kda.chunk_kda then runs on kda_aot

FLA's dispatch asks the verifier first and falls back to its Triton path for what kda_aot does not serve:
no CUDA tensor, a GPU kda_aot has no kernels for, head dims other than 128, chunk sizes other than 64,
more than 64 heads, cp_context, return_intermediate_states, use_graph, dtypes the kernels do not take,
unknown keywords. FLA_KDA_AOT=0 (FLA's switch for a backend) turns it off; FLA_DISABLE_BACKEND_DISPATCH=1
turns off every backend.
"""
from __future__ import annotations

import torch

try:
    from fla.backends import BaseBackend, register
    from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda
except ImportError as e:  # FLA absent, one without the backend dispatch (before 0.6.0), or a dependency of FLA absent
    if e.name and e.name.partition(".")[0] != "fla":
        raise ImportError(f"kda_aot.fla: flash-linear-attention is installed but cannot be imported: it needs "
                          f"{e.name!r}, which is missing ({e})") from e
    raise ImportError(f"kda_aot.fla registers kda_aot with flash-linear-attention's backend dispatch, which it "
                      f"could not import ({e}): it needs fla-core 0.6.0 (pip install fla-core==0.6.0)") from e

from ._runtime import registry
from .ops.chunk_kda import chunk_kda
from .schedule.kda import HEAD_DIM, MAX_HEADS

BACKEND_TYPE = "kda_aot"
ENV_VAR = "FLA_KDA_AOT"
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
    if cp_context is not None or return_intermediate_states or use_graph or max_num_seqs is not None:
        return False, "cp_context / return_intermediate_states / use_graph are FLA's own"
    if q.dim() != 4 or v.dim() != 4 or q.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return False, f"head dims {q.shape[-1]}, {v.shape[-1]} (kda_aot: 128)"
    if v.shape[2] > MAX_HEADS or v.shape[2] % q.shape[2]:
        return False, f"{v.shape[2]} value heads over {q.shape[2]} (kda_aot: at most {MAX_HEADS}, a multiple)"
    if any(t.dtype != torch.bfloat16 for t in (q, k, v)):
        return False, "q, k, v not bf16"
    if not use_beta_sigmoid_in_kernel and beta.dtype != torch.bfloat16:
        return False, f"beta in {beta.dtype} (kda_aot's kernels take bf16 beta)"
    if not g.is_floating_point():
        return False, f"g in {g.dtype}"
    if initial_state is not None and initial_state.dtype != torch.float32:
        return False, "initial_state not fp32"
    return True, None


@register(fla_chunk_kda)
class KdaAotBackend(BaseBackend):
    """chunk_kda on kda_aot's ahead-of-time compiled kernels (training: forward and both backward modes)."""

    backend_type = BACKEND_TYPE
    package_name = "kda_aot"
    env_var = ENV_VAR
    default_enable = True
    priority = 4

    def chunk_kda_verifier(self, *args, **kwargs):
        return verify(*args, **kwargs)

    def chunk_kda(self, *args, **kwargs):
        return chunk_kda(*args, **kwargs)
