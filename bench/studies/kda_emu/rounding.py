"""Rounding points: bf16, tf32 (cvt.rna), ex2.approx.ftz, bf16 hi + lo, and the chunk geometry."""
from __future__ import annotations

import torch

F32, F64, BF = torch.float32, torch.float64, torch.bfloat16
C, K = 64, 128
LOG2E = 1.4426950408889634
TINY = 2.0 ** -126  # ex2.approx.ftz flushes results below the smallest normal


def bf(x):
    return x.to(BF).to(F32)


def tf32(x):
    """Round fp32 to tf32 (10 mantissa bits, to nearest: cvt.rna)."""
    b = x.contiguous().view(torch.int32)
    b = (b + 0x1000) & ~0x1FFF
    return b.view(F32)


def ex2(x):
    """ex2.approx.ftz.f32."""
    y = torch.exp2(x.to(F32))
    return torch.where(y.abs() < TINY, torch.zeros_like(y), y)


def hilo(x):
    hi = bf(x)
    return hi, bf(x - hi)


def rnd(x, how):
    """x rounded as an operand or an intermediate: 'bf16', 'fp32', 'tf32', 'hilo' (bf16 hi + lo)."""
    if how == "bf16":
        return bf(x)
    if how == "tf32":
        return tf32(x)
    if how == "hilo":
        hi, lo = hilo(x)
        return hi + lo  # exact as a sum in fp32; the tensor cores add both products into one accumulator
    return x.to(F32)
