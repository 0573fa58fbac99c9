"""PackedKDA: the KDA token mixer's trainable core over packed documents, one device or CP.

    y_x = silu(causal_conv1d_4(x))            for x in q, k, v (depthwise, per document)
    q, k <- q / |q|, k / |k| per head          (qk_l2norm)
    o    = KDA(q, k, v, g, beta)               (docs/math.md)

Single device: pass cu_seqlens. Context parallel: pass a kda_aot.cp plan (and group) and this
rank's local shards; the conv reads its halo through kda_aot.cp.conv_halo and KDA runs through
kda_aot.cp.chunk_kda_cp. Projections, gates and output norm belong to the caller's layer.
"""
from __future__ import annotations

import math
import operator
from typing import Optional

import torch
from torch import nn

from . import reference
from ._runtime import registry
from ._runtime.tensor import (boundaries_tensor, check_cu_seqlens_cpu, check_kda_shapes, checked_flag, checked_scale,
                              require_cuda)
from .cp.backends import ReferenceBackend
from .cp.exchange import resolve_group
from .cp.halo import CudaConv, ReferenceConv, _conv_cp
from .cp.ops import chunk_kda_cp_agreed, kda_config
from .cp.plan import CPPlan
from .ops.chunk_kda import BACKWARD_MODES, chunk_kda
from .ops.norm import HEAD_DIM
from .reference import activations

__all__ = ["PackedKDA"]

BACKENDS = ("auto", "reference", "cuda")


def resolve_backend(backend: str, x: torch.Tensor, head_dim: int = HEAD_DIM) -> str:
    """The backend a call runs on: "auto" resolves by the inputs and the head dim (kda_aot.registry.auto_backend)."""
    return registry.auto_backend(x, head_dim) if backend == "auto" else backend


def _check_floating(name, x):
    """A tensor of floats: an integer tensor would come back from the reference path cast to its dtype (zeros)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")


class PackedKDA(nn.Module):
    """Causal conv1d + SiLU on q, k, v, optional q/k L2 norm, then KDA.

    Parameters: q_conv_weight, k_conv_weight, v_conv_weight [H * head_dim, 4] (and
    q/k/v_conv_bias [H * head_dim] with conv_bias=True), the layout of
    flash-linear-attention's causal_conv1d.
    backward: "replay" | "saved" (the CP op's backward mode; bitwise-equal gradients).
    backend: "auto" (per call: "cuda" for bf16 inputs on a GPU the kernels serve and head_dim 128, else
    "reference") |
    "reference" (kda_aot.reference, fp32 or fp64 when the inputs are fp64) |
    "cuda" (the conv runs kda_aot.causal_conv1d_silu and KDA the kernels of kda_aot.schedule.kda, single
    device or through the CUDA backend of kda_aot.cp; head_dim must be 128).
    """

    def __init__(self, num_heads: int, head_dim: int = 128, conv_bias: bool = False,
                 qk_l2norm: bool = True, backward: str = "replay", backend: str = "auto"):
        super().__init__()
        if backward not in BACKWARD_MODES:
            raise ValueError(f"backward must be one of {', '.join(BACKWARD_MODES)}, got {backward!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not hasattr(type(value), "__index__"):
                raise TypeError(f"{name}: expected an int, got {value!r}")
            if operator.index(value) < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        conv_bias, qk_l2norm = checked_flag("conv_bias", conv_bias), checked_flag("qk_l2norm", qk_l2norm)
        self.num_heads, self.head_dim = operator.index(num_heads), operator.index(head_dim)
        self.qk_l2norm, self.backward_mode, self.backend = qk_l2norm, backward, backend
        D = self.num_heads * self.head_dim
        width = reference.CONV_WIDTH
        for name in ("q", "k", "v"):
            self.register_parameter(f"{name}_conv_weight", nn.Parameter(torch.empty(D, width)))
            self.register_parameter(f"{name}_conv_bias",
                                    nn.Parameter(torch.empty(D)) if conv_bias else None)
        self.reset_parameters()

    def reset_parameters(self):
        # nn.Conv1d's default for a depthwise width-4 conv: U(-1/sqrt(4), 1/sqrt(4)).
        bound = 1.0 / math.sqrt(reference.CONV_WIDTH)
        for name in ("q", "k", "v"):
            nn.init.uniform_(getattr(self, f"{name}_conv_weight"), -bound, bound)
            b = getattr(self, f"{name}_conv_bias")
            if b is not None:
                nn.init.uniform_(b, -bound, bound)

    # flash-linear-attention's KimiDeltaAttention keeps its convolutions as ShortConvolution (an nn.Conv1d,
    # depthwise, width 4, left-padded): q_conv1d.weight [D, 1, 4] and an optional q_conv1d.bias [D], the
    # same taps in the same order as q_conv_weight [D, 4] (y_t = sum_j w_j x_(t-3+j)).
    FLA_CONV_KEYS = {f"{name}_conv_{part}": f"{name}_conv1d.{part}" for name in "qkv" for part in ("weight", "bias")}

    def load_fla_conv_state_dict(self, state_dict: dict, prefix: str = "") -> None:
        """Load the q, k, v convolutions of a FLA KimiDeltaAttention state dict (keys `prefix` +
        q_conv1d.weight, ...: the mapping FLA_CONV_KEYS); other keys are left alone. A bias FLA has that
        this module has not (or the reverse), or a shape that does not match, is an error."""
        with torch.no_grad():
            for ours, theirs in self.FLA_CONV_KEYS.items():
                mine, key = getattr(self, ours), prefix + theirs
                if (mine is None) != (key not in state_dict):
                    raise ValueError(f"{key}: {'missing from the state dict' if mine is not None else 'present, but this module has no conv bias (conv_bias=False)'}")
                if mine is None:
                    continue
                t = state_dict[key]
                t = t.reshape(t.shape[0], t.shape[-1]) if ours.endswith("weight") and t.dim() == 3 else t
                if tuple(t.shape) != tuple(mine.shape):
                    raise ValueError(f"{key}: expected {list(mine.shape)} (or [D, 1, 4] for a weight), got "
                                     f"{list(state_dict[key].shape)}")
                mine.copy_(t)

    def fla_conv_state_dict(self, prefix: str = "") -> dict:
        """The q, k, v convolutions under FLA's keys and shapes (weights [D, 1, 4])."""
        out = {}
        for ours, theirs in self.FLA_CONV_KEYS.items():
            t = getattr(self, ours)
            if t is not None:
                out[prefix + theirs] = (t.detach().unsqueeze(1) if ours.endswith("weight") else t.detach()).clone()
        return out

    def extra_repr(self):
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"conv_bias={self.q_conv_bias is not None}, qk_l2norm={self.qk_l2norm}, "
                f"backward={self.backward_mode!r}, backend={self.backend!r}")

    # ------------------------------------------------------------------ pieces
    def _fused_norm(self, backend: str) -> bool:
        """q and k normalised inside their conv (the CUDA backend's l2norm conv form, heads of 128)."""
        return backend == "cuda" and self.qk_l2norm and self.head_dim == HEAD_DIM

    def _conv_ops(self, x, backend: str):
        """(single-device conv(x, weight, bias, cu_seqlens, l2norm), the CP conv's ops for q, k, v)."""
        if backend == "cuda":
            from .ops.conv import causal_conv1d_silu

            def conv(x, w, b, cu_seqlens, l2norm):
                return causal_conv1d_silu(x, w, b, cu_seqlens=cu_seqlens, l2norm=l2norm)
            fused = self._fused_norm(backend)
            return conv, [CudaConv(l2norm=fused), CudaConv(l2norm=fused), CudaConv()]
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32

        def conv(x, w, b, cu_seqlens, l2norm):
            return reference.conv1d_silu(x, w, b, cu_seqlens=cu_seqlens, dtype=dtype)
        return conv, ReferenceConv(dtype)

    def _check_call(self, q, k, v, cu_seqlens, plan, group):
        if (cu_seqlens is None) == (plan is None):
            raise ValueError("PackedKDA: give exactly one of cu_seqlens (single device) or "
                             "plan (context parallel)")
        if plan is None and group is not None:
            raise ValueError("PackedKDA: group is only used with a plan")
        D = self.num_heads * self.head_dim
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != 1 \
                    or x.shape[2] != D or x.shape[1] != q.shape[1]:
                raise ValueError(f"{name} must be [1, T, {D}] (H * head_dim, same T as q), got "
                                 f"{list(getattr(x, 'shape', []))}")
            _check_floating(name, x)

    def _check_kda_shapes(self, q, k, v, g, beta, initial_state, cu_seqlens):
        """g, beta and the initial state against q's heads, before the convs run (check_kda_shapes, as chunk_kda)."""
        H, Dh = self.num_heads, self.head_dim
        check_kda_shapes(*(x.unflatten(-1, (H, Dh)) for x in (q, k, v)), g, beta, packed=True)
        N = cu_seqlens.shape[0] - 1 if cu_seqlens.dim() == 1 else None
        if initial_state is not None and N is not None and tuple(initial_state.shape) != (N, H, Dh, Dh):
            raise ValueError(f"initial_state: expected shape {[N, H, Dh, Dh]} ([N, H, head_dim, head_dim], a row per "
                             f"document), got {list(initial_state.shape)}")

    def conv_qkv(self, q, k, v, *, cu_seqlens=None, plan: Optional[CPPlan] = None, group=None):
        """The part before KDA: causal conv1d + SiLU of q, k, v (with the CP halo when a plan
        is given; collective then) and the per-head L2 norm of q and k. Returns q, k, v as
        [1, T, H, head_dim]: fp32 (fp64 for fp64 inputs) on the reference backend, the input
        dtype on the CUDA backend."""
        self._check_call(q, k, v, cu_seqlens, plan, group)
        if plan is not None:
            group, _, _ = resolve_group(group)
        return self._conv_qkv(q, k, v, boundaries_tensor(cu_seqlens), plan, group,
                              resolve_backend(self.backend, q, self.head_dim))

    def _conv_qkv(self, q, k, v, cu_seqlens, plan, group, backend, kda=None, op="PackedKDA.conv_qkv"):
        """conv_qkv (under CP: the agreement check, with the facts of the KDA call `kda` when given, then one
        all_gather each way for the three halos)."""
        H, Dh, T = self.num_heads, self.head_dim, q.shape[1]
        weights = [getattr(self, f"{name}_conv_weight") for name in "qkv"]
        biases = [getattr(self, f"{name}_conv_bias") for name in "qkv"]
        conv, cp_conv = self._conv_ops(q, backend)
        fused = self._fused_norm(backend)
        if plan is None:
            out = [conv(x, w, b, cu_seqlens, fused and name != "v")
                   for x, w, b, name in zip((q, k, v), weights, biases, "qkv")]
        else:
            convs = cp_conv if isinstance(cp_conv, list) else [cp_conv] * 3
            out = _conv_cp([q, k, v], weights, biases, plan, group, convs, op, kda)
        qc, kc, vc = (y.reshape(1, T, H, Dh) for y in out)
        if self.qk_l2norm and not fused:  # else normalised in the conv's pass, saving the norm's own (docs/conv.md)
            qc, kc = activations.l2norm(qc), activations.l2norm(kc)
        return qc, kc, vc

    def forward(self, q, k, v, g, beta, *, cu_seqlens=None, cu_seqlens_cpu=None, plan: Optional[CPPlan] = None,
                group=None, scale: Optional[float] = None,
                initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False):
        """q, k, v [1, T, H * head_dim], g [1, T, H, head_dim] (log decay <= 0), beta [1, T, H], all floating
        point; on the CUDA backend q, k, v and beta bf16, g and initial_state fp32 (chunk_kda's dtypes); with a plan, T is this rank's local token count (plan.token_map order).
        Give cu_seqlens (single device: a tensor or a list; on the GPU, cu_seqlens_cpu, its CPU copy, spares
        the host syncs that read it) or plan (+ group; context parallel), not both.
        Returns (o [1, T, H, head_dim] in q's dtype, final_state [N, H, head_dim, head_dim] or
        None); under CP as kda_aot.cp.chunk_kda_cp returns them (local o; final-state rows
        of the documents that end on this rank, zero elsewhere)."""
        self._check_call(q, k, v, cu_seqlens, plan, group)
        _check_floating("g", g)
        _check_floating("beta", beta)
        if initial_state is not None:
            _check_floating("initial_state", initial_state)
        cu_seqlens = boundaries_tensor(cu_seqlens)
        if plan is None:  # (under CP the one agreement check names them on every rank: no rank raises alone)
            self._check_kda_shapes(q, k, v, g, beta, initial_state, cu_seqlens)
        scale = checked_scale(scale, self.head_dim)
        output_final_state = checked_flag("output_final_state", output_final_state)
        check_cu_seqlens_cpu(cu_seqlens, cu_seqlens_cpu)
        backend = resolve_backend(self.backend, q, self.head_dim)
        if backend == "cuda" and self.head_dim != HEAD_DIM:
            # before the conv and before any collective: every rank raises
            raise ValueError(f"PackedKDA(backend='cuda'): head_dim must be 128, got {self.head_dim}")
        if backend == "cuda":
            require_cuda(q, "q", "PackedKDA(backend='cuda')")
        if plan is not None:
            return self._forward_cp(q, k, v, g, beta, plan, group, scale, initial_state, output_final_state,
                                    backend)
        host = cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu
        qc, kc, vc = self._conv_qkv(q, k, v, host, None, None, backend)
        if backend == "cuda":
            o, final = chunk_kda(qc, kc, vc, g, beta, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, scale=scale,
                                 initial_state=initial_state, output_final_state=output_final_state,
                                 backward=self.backward_mode)
            return o.to(q.dtype), final
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        o, final = reference.kda_chunked(qc, kc, vc, g, beta, cu_seqlens=host,  # the conv's boundaries
                                         scale=scale, initial_state=initial_state,
                                         output_final_state=output_final_state, dtype=dtype)
        return o.to(q.dtype), final

    def _forward_cp(self, q, k, v, g, beta, plan, group, scale, initial_state, output_final_state, backend):
        """Under CP: ONE agreement check for the whole call (the conv's facts and KDA's; each check is
        a host sync, and the GPU idles while the host launches what follows one: docs/cp.md), posted
        first and read once the conv's local work is queued, then the conv with its halos and chunk_kda_cp."""
        H, Dh, T = self.num_heads, self.head_dim, q.shape[1]
        name = backend
        if name == "cuda":
            from .cp.backends import CudaBackend
            backend = CudaBackend()
        else:
            backend = ReferenceBackend(torch.float64 if q.dtype == torch.float64 else torch.float32)
        heads = [x.reshape(1, T, H, Dh) for x in (q, k, v)]  # the shapes KDA gets (views: nothing computed)
        backend, scale = kda_config(heads[0], plan, scale, self.backward_mode, backend)
        group, _, _ = resolve_group(group)
        qc, kc, vc = self._conv_qkv(q, k, v, None, plan, group, name,
                                    (g, beta, initial_state, scale, self.backward_mode, backend), "PackedKDA")
        o, final = chunk_kda_cp_agreed(qc, kc, vc, g, beta, plan=plan, group=group, scale=scale,
                                       initial_state=initial_state, output_final_state=output_final_state,
                                       backward=self.backward_mode, backend=backend)
        return o.to(q.dtype), final
