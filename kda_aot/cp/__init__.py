"""Context parallelism for KDA on packed documents (docs/cp.md).

    plan = kda_aot.cp.make_plan(cu_seqlens, "doc_zigzag", group=dist.group.WORLD)
    q_l, k_l, ... = (plan.shard(x) for x in (q, k, ...))            # global -> local
    o_l, _ = kda_aot.cp.chunk_kda_cp(q_l, k_l, v_l, g_l, beta_l, plan=plan)
    halo = kda_aot.cp.conv_halo(x_l, plan)                           # conv1d halo
    y_l = kda_aot.cp.conv1d_silu_cp(x_l, w, b, plan=plan)            # halo + conv
    o = kda_aot.cp.gather(o_l, plan)                                 # local -> global

Modules: plan (layouts, fragment table), summaries (affine summaries and their composition),
exchange (collectives, agreement check), backends (the local primitives: the
reference and the CUDA kernels), collective (the CP forward and backward), ops (chunk_kda_cp: custom ops
and entry points), halo (conv_halo). Every collective function must be called by all
ranks of the group in the same order, and so must the backward: every rank's result must
reach the loss, also on a rank that holds no token.
"""
from .backends import ReferenceBackend, get_backend
from .exchange import check_agreement, gather, resolve_group
from .halo import conv1d_silu_cp, conv_halo
from .ops import BACKWARD_MODES, chunk_kda_cp, phase_times
from .plan import CHUNK, LAYOUTS, CPPlan, Fragment, make_plan

__all__ = ["make_plan", "CPPlan", "Fragment", "LAYOUTS", "CHUNK", "chunk_kda_cp",
           "BACKWARD_MODES", "conv_halo", "conv1d_silu_cp", "gather", "check_agreement", "resolve_group",
           "ReferenceBackend", "get_backend", "phase_times"]
