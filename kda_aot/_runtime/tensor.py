"""Tensors -> the plain descriptors the bindings take, and checks that need torch.

A descriptor is (data_ptr, dtype code, CUDA device index or -1, shape, strides in elements):
bindings check everything about it themselves, so they need no torch headers.
"""
from __future__ import annotations

import math
import numbers
import operator
import reprlib

import torch
from torch._subclasses.fake_tensor import is_fake

# Mirror of templates/common/abi.h (every binding exports DTYPE_CODES; tests compare the two).
DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.int32: 3,
    torch.int64: 4,
    torch.float64: 5,
}


def describe(t: torch.Tensor | None, name: str):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        raise TypeError(f"{name}: unsupported dtype {t.dtype}")
    device = t.device.index if t.is_cuda else -1
    return (t.data_ptr(), code, device, tuple(t.shape), tuple(t.stride()))


# Where each op's math runs on the CPU, for the refusal below.
CPU_COUNTERPARTS = {
    "chunk_kda": "kda_aot.reference.kda_chunked is the same math in fp64, on one packed sequence (B sequences of T "
                 "tokens: x.reshape(1, B * T, ...) with cu_seqlens = arange(B + 1) * T) with K-first states "
                 "[N, HV, K, V] (with state_v_first, pass initial_state.transpose(-1, -2) and transpose the final "
                 "state back); with use_qk_l2norm_in_kernel, use_gate_in_kernel or use_beta_sigmoid_in_kernel, "
                 "apply kda_aot.reference.l2norm, kda_gate(g, A_log, dt_bias, lower_bound) or beta_sigmoid(beta, "
                 "allow_neg_eigval, dtype=torch.float64) to its inputs first",
    "causal_conv1d_silu": "kda_aot.reference.conv1d_silu is the same math in fp64 (with l2norm, apply "
                          "kda_aot.reference.l2norm to y.unflatten(-1, (-1, 128)) after it)",
    # chunk_kda(use_qk_l2norm_in_kernel=True) runs this op first; compiled, its refusal is the one a CPU call meets
    "l2norm": "kda_aot.reference.l2norm is the same math (from chunk_kda with use_qk_l2norm_in_kernel=True: "
              "kda_aot.reference.kda_chunked on reference.l2norm(q), reference.l2norm(k) is the call's)",
    "PackedKDA(backend='cuda')": "PackedKDA(backend='auto') runs the same module on kda_aot.reference",
}


def require_cuda(t: torch.Tensor, name: str, op: str) -> None:
    """The refusal of a tensor off the GPU, made where an op would launch its first kernel (after every check
    that needs none, so bad input is named the same everywhere), naming the op's CPU counterpart. Traced tensors
    pass: a trace on the CPU stands for the GPU call (tests/test_ops_trace.py)."""
    if not t.is_cuda and not torch.compiler.is_compiling() and not is_fake(t):
        raise ValueError(f"{name}: {op} runs its kernels on a CUDA GPU, got a tensor on {t.device}; on the CPU, "
                         f"{CPU_COUNTERPARTS.get(op, 'kda_aot.reference holds the same math')}")


def out_or(out: dict, name: str, make):
    """out[name] when the caller preallocated it, else make() — called only then (a default
    argument would allocate the tensor either way, on whatever stream is current)."""
    return out[name] if name in out else make()


def stream_of(t: torch.Tensor) -> int:
    """Raw handle of the current stream of t's device (0 for a CPU tensor, which bindings refuse)."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def is_real(value) -> bool:
    """A real number, Python's or numpy's as configs carry it (a bool, numpy's too, is not one)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def checked_flag(name: str, value) -> bool:
    """A switch given as a bool or as what configs and FLA's layers carry for one: None (False: FLA's Optional[bool]
    settings), 0 / 1, numpy's bool, a traced SymBool, a 0-d bool or integer tensor holding 0 / 1; nothing else (a
    string such as "no" would be truthy)."""
    if value is None:
        return False
    if isinstance(value, (bool, torch.SymBool)):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if isinstance(value, torch.Tensor):
        held = None if value.dim() or value.is_meta else value.item()  # (one read: a sync for a GPU tensor)
        if held in (0, 1) and not (value.is_floating_point() or value.is_complex()):
            return bool(held)
        raise TypeError(f"{name}: expected a bool, got a tensor of shape {list(value.shape)} and dtype {value.dtype}"
                        + ("" if held is None else f" holding {held}"))
    if not isinstance(value, float) and hasattr(type(value), "__index__") and operator.index(value) in (0, 1):
        return bool(operator.index(value))
    raise TypeError(f"{name}: expected a bool, got {value!r}")


def checked_scale(scale, head_dim: int) -> float:
    """The output scale as the ops take it: head_dim ** -0.5 for None, else a finite real number (a Python or
    numpy number, or a one-element tensor) as a float; anything else raises, naming scale (a NaN scale would
    be a NaN output, not an error)."""
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.is_complex() or scale.dtype == torch.bool:
            raise TypeError(f"scale: expected a real number, got a tensor of shape {list(scale.shape)} and dtype {scale.dtype}")
        scale = scale.item()
    if not is_real(scale):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    return scale


def boundaries_tensor(cu_seqlens, name: str = "cu_seqlens"):
    """Document boundaries given as a tensor (as they are) or a sequence of integers of any kind (Python's,
    numpy's, one-element tensors'): an int64 CPU tensor. Floats and bools are refused, never truncated."""
    if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens
    try:
        if isinstance(cu_seqlens, (str, bytes)):
            raise TypeError
        items = list(cu_seqlens)  # once: an iterator is read here alone
        if any(isinstance(c, bool) for c in items):
            raise TypeError
        values = [operator.index(c) for c in items]
    except TypeError:
        raise TypeError(f"{name}: expected a tensor or a sequence of ints, got "
                        f"{reprlib.repr(cu_seqlens)}") from None
    return torch.tensor(values, dtype=torch.int64)


def check_kda_shapes(q, k, v, g, beta, *, packed: bool, head_dim: int | None = None,
                     max_heads: int | None = None) -> int:
    """The one check of the KDA inputs' types, shapes and devices, for the ops, the programs' callers, the
    activations and the reference alike: q, k [B, T, H, K]; v [B, T, HV, V], g [B, T, HV, K] and beta [B, T, HV],
    HV a multiple of H (grouped value heads); all on q's device. packed: B = 1 (the documents in one sequence);
    head_dim: K = V = head_dim (the kernels'; None: any, the reference's); max_heads: H and HV at most that.
    Returns HV. (Dtypes and states are the callers'.)"""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    dim = "K" if head_dim is None else head_dim
    if q.dim() != 4 or (packed and q.shape[0] != 1):
        shape = f"[1, T, H, {dim}] (packed documents)" if packed else f"[B, T, H, {dim}]"
        raise ValueError(f"q: expected shape {shape}, got {list(q.shape)}")
    B, T, H, K = q.shape
    if head_dim is not None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() == 4 and t.shape[3] != head_dim:
                raise ValueError(f"{name}: head dim must be {head_dim}, got {t.shape[3]}")
    if max_heads is not None and H > max_heads:
        raise ValueError(f"q: at most {max_heads} heads, got {H}")
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {list(q.shape)} (as q), got {list(k.shape)}")
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v: expected shape [{B}, {T}, HV, {'V' if head_dim is None else head_dim}] (HV a multiple "
                         f"of q's H = {H}), got {list(v.shape)}")
    HV = v.shape[2]
    if HV % H != 0:
        raise ValueError(f"v: its heads (HV = {HV}) must be a multiple of q's and k's (H = {H})")
    if max_heads is not None and HV > max_heads:
        raise ValueError(f"v: at most {max_heads} heads, got {HV}")
    if tuple(g.shape) != (B, T, HV, K):
        raise ValueError(f"g: expected shape {[B, T, HV, K]} ([B, T, HV, K]), got {list(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta: expected shape {[B, T, HV]} ([B, T, HV]), got {list(beta.shape)}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device} but q is on {q.device}")
    return HV


def check_cu_seqlens_cpu(cu_seqlens, cu_seqlens_cpu) -> None:
    """cu_seqlens_cpu, when given, is cu_seqlens' copy on the CPU: its shape always, its values when cu_seqlens
    is on the CPU too (a device cu_seqlens is not read back: sparing that sync is what the copy is for)."""
    if cu_seqlens_cpu is None:
        return
    if not isinstance(cu_seqlens_cpu, torch.Tensor):
        raise TypeError(f"cu_seqlens_cpu: expected a torch.Tensor, got {type(cu_seqlens_cpu).__name__}")
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


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, name: str = "cu_seqlens") -> list[int]:
    """Validate document boundaries 0 = c_0 <= c_1 <= ... <= c_N = total; returns them as a list.

    Zero-length documents (c_i = c_{i+1}) are legal: packs padded to a fixed document count have them.
    The values are read on the host (one small device-to-host copy for a CUDA tensor).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name}: expected shape [N + 1] with N >= 1, got {list(cu_seqlens.shape)}")
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}: must start at 0, starts at {values[0]}")
    if values[-1] != total:
        raise ValueError(f"{name}: must end at T = {total}, ends at {values[-1]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(f"{name}: must be non-decreasing (negative document length at index "
                             f"{i - 1}: {values[i - 1]} -> {values[i]})")
    return values


def host_table_to(x: torch.Tensor, device) -> torch.Tensor:
    """A small host table onto the GPU without waiting for the GPU: from pinned memory, non-blocking
    (a pageable copy synchronises the host with the queued work, which then runs without the launches
    queued behind it; the caching host allocator keeps the pinned buffer until the copy is done)."""
    device = torch.device(device)
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)
