"""Affine summaries of fragments and their composition along document chains (docs/math.md, docs/cp.md).

Forward. Per head, a fragment f maps its entering state to its exit state affinely:
    S_out(f) = M_f S_in(f) + B_f          (M_f, B_f = reference.fragment_summary of f's tokens)
so the state entering fragment f+1 of a document is composed in chain order
    S_in(f+1) = M_f S_in(f) + B_f.
What each fragment publishes (the exchange payload, a pure function of the plan):
    * the last fragment of a document: nothing (nobody waits for its state);
    * a document's first fragment (position 0): only its exit state E = M h0 + B (h0 = the
      initial state, or zero: then E = B). Its entering state is known locally, so M would be
      dead weight on the wire, and the initial state is needed on that one rank only;
    * any other fragment: (M, B).

Backward. The walk is affine in S, so the Jacobian of S_out(f) with respect to S_in(f) is M_f
and the state gradient flows back as
    dS_in(f) = M_f^T dS_out(f) + D_f,      dS_out(f) = dS_in(f+1),
where D_f is the gradient reaching f's entering state from f's own outputs (its local backward
run with dS_out = 0). Published, mirroring the forward:
    * a document's first fragment: nothing (nobody before it waits);
    * a document's last fragment (if not also first): dS_in directly. Its dS_out is known
      locally (the final-state gradient, or zero), so its backward pass gives dS_in outright;
    * any other fragment: (M, D).

Why no gradient through M or B is needed: the loss depends on the inputs (q, k, v, g, beta) of
fragment f only through f's outputs o_f and its exit state S_out(f). Once dS_out(f) is known
(composed above), f's local backward run with that true dS_out gives exactly d loss / d inputs
of f, both paths included. M and B are only a re-parametrisation of S_out(f) used to move
states and their gradients across ranks; differentiating them as well would count the path
through S_out(f) twice. M enters the backward only as the (constant) Jacobian M_f^T.

All composition runs in the state dtype (fp32 for the kernels; never TF32, see _ieee_fp32).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, Optional

import torch

from .plan import CPPlan, Fragment

__all__ = ["forward_payload_size", "backward_payload_size", "compose_entering_states",
           "compose_exit_grads", "compose_pieces", "ieee_fp32"]


@contextlib.contextmanager
def ieee_fp32(device: torch.device):
    """fp32 matrix products in full fp32 on CUDA: products of M lose accuracy fast in TF32
    (docs/math.md). A no-op on CPU."""
    if torch.device(device).type != "cuda":
        yield
        return
    mm = torch.backends.cuda.matmul
    if hasattr(mm, "fp32_precision"):
        old = mm.fp32_precision
        mm.fp32_precision = "ieee"
        try:
            yield
        finally:
            mm.fp32_precision = old
    else:  # older torch
        old = mm.allow_tf32
        mm.allow_tf32 = False
        try:
            yield
        finally:
            mm.allow_tf32 = old


def forward_payload_size(H: int, K: int, V: int):
    """size_of(fragment) for the forward exchange (see the module docstring)."""
    def size_of(f: Fragment) -> int:
        if f.is_last:
            return 0
        return H * K * K + H * K * V if f.needs_state else H * K * V
    return size_of


def backward_payload_size(H: int, K: int, V: int):
    """size_of(fragment) for the backward exchange (see the module docstring)."""
    def size_of(f: Fragment) -> int:
        if not f.needs_state:
            return 0
        return H * K * V if f.is_last else H * K * K + H * K * V
    return size_of


def _split_MB(flat: torch.Tensor, H: int, K: int, V: int):
    n = H * K * K
    return flat[:n].reshape(H, K, K), flat[n:].reshape(H, K, V)


def compose_entering_states(plan: CPPlan, published: Dict[int, torch.Tensor], H: int, K: int,
                            V: int, wanted: Iterable[Fragment]) -> Dict[int, torch.Tensor]:
    """S_in [H, K, V] of every fragment in `wanted` that needs an entering state, composed in
    chain order from the forward exchange's `published` payloads."""
    last_wanted: Dict[int, int] = {}
    for f in wanted:
        if f.needs_state:
            last_wanted[f.doc] = max(last_wanted.get(f.doc, -1), f.position)
    out: Dict[int, torch.Tensor] = {}
    for doc, upto in sorted(last_wanted.items()):
        chain = plan.doc_fragments(doc)
        S = published[chain[0].index].reshape(H, K, V)
        with ieee_fp32(S.device):
            for f in chain[1:upto + 1]:
                out[f.index] = S
                if f.position == upto:
                    break
                M, B = _split_MB(published[f.index], H, K, V)
                S = torch.baddbmm(B, M, S)          # M S + B
    return out


def compose_exit_grads(plan: CPPlan, published: Dict[int, torch.Tensor], H: int, K: int, V: int,
                       wanted: Iterable[Fragment]) -> Dict[int, torch.Tensor]:
    """dS_out [H, K, V] of every fragment in `wanted` that is not the last of its document,
    composed from the chain end with the backward exchange's `published` payloads."""
    first_wanted: Dict[int, int] = {}
    for f in wanted:
        if not f.is_last:
            first_wanted[f.doc] = min(first_wanted.get(f.doc, 1 << 62), f.position)
    out: Dict[int, torch.Tensor] = {}
    for doc, downto in sorted(first_wanted.items()):
        chain = plan.doc_fragments(doc)
        dS = published[chain[-1].index].reshape(H, K, V)      # dS_in of the last fragment
        with ieee_fp32(dS.device):
            for f in reversed(chain[downto:-1]):
                out[f.index] = dS
                if f.position == downto:
                    break
                M, D = _split_MB(published[f.index], H, K, V)
                dS = torch.baddbmm(D, M.transpose(1, 2), dS)    # M^T dS_out + D
    return out


def exit_state(M: torch.Tensor, B: torch.Tensor, S0: Optional[torch.Tensor]) -> torch.Tensor:
    """E = M S0 + B (S0 None: zero state, E = B)."""
    if S0 is None:
        return B
    with ieee_fp32(B.device):
        return torch.baddbmm(B, M, S0.to(B.dtype))


def compose_pieces(M: torch.Tensor, B: Optional[torch.Tensor], counts) -> list:
    """Summaries of fragments walked as consecutive pieces: M [P, H, K, K] and B [P, H, K, V] (or
    None) of the P pieces in order, `counts` pieces per fragment; returns [(M_f, B_f or None)] with
    M_f = M_p ... M_1 and B_f = M_p (... (M_2 B_1 + B_2) ...) + B_p: piece j's exit state is piece
    j + 1's entering one. Composed in the state dtype, never TF32."""
    out, j = [], 0
    with ieee_fp32(M.device):
        for n in counts:
            Mf, Bf = M[j], None if B is None else B[j]
            for i in range(j + 1, j + n):
                if Bf is not None:
                    Bf = torch.baddbmm(B[i], M[i], Bf)
                Mf = torch.bmm(M[i], Mf)
            out.append((Mf, Bf))
            j += n
    return out
