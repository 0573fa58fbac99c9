"""Reference math for kda_aot: the one place every kernel is checked against.

Pure torch, fp64 by default (fp32 also works), CPU or GPU, differentiable by autograd
(no in-place ops on tensors that carry gradients). Clarity over speed: meant for small T.

Layouts follow flash-linear-attention's chunk_kda:
    q, k  [1, T, H, K]     v  [1, T, H, V]     g  [1, T, H, K] (log decay, <= 0)
    beta  [1, T, H]        cu_seqlens [N+1] (0 = c0 <= c1 <= ... <= cN = T: empty documents allowed)
    initial_state / final_state  [N, H, K, V]

Per head and document (docs/math.md):
    S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T
    o_t = scale * S_t^T q_t            (scale defaults to K**-0.5)

Public functions
    kda_recurrent      token-by-token recurrence (the ground truth)
    kda_chunked        the chunked form of docs/math.md (what the kernels implement)
    chunk_prepare      the intra-chunk quantities of one chunk (Gamma, W, U, Aqk, ...)
    fragment_summary   affine summary (M, B) of one fragment: S_out = M S_in + B
    kda_chunked_fwd_saved  kda_chunked's forward keeping every per-chunk tensor (state tape, W, ...)
    kda_chunked_bwd        explicit chunked backward (no autograd): walk -> dS tape -> chunk_bwd
    kda_bwd_state_walk, chunk_bwd, kda_bwd_dvp_local   its stages, as the kernels split them
    conv1d_silu        width-4 causal depthwise conv + SiLU over packed documents, with halo
    conv1d_silu_bwd    its backward written out (no autograd)
    l2norm, kda_gate, beta_sigmoid   q and k's norm, the gate's and beta's activations (activations.py)
"""

from .activations import L2NORM_EPS, beta_sigmoid, kda_gate, l2norm
from .chunked import chunk_bwd, kda_bwd_dvp_local, kda_bwd_state_walk, kda_chunked_bwd, kda_chunked_fwd_saved
from .conv import CONV_WIDTH, conv1d_silu, conv1d_silu_bwd
from .kda import G_FLOOR, chunk_prepare, fragment_summary, kda_chunked, kda_recurrent

__all__ = [
    "kda_recurrent",
    "kda_chunked",
    "chunk_prepare",
    "fragment_summary",
    "kda_chunked_fwd_saved",
    "kda_chunked_bwd",
    "kda_bwd_dvp_local",
    "kda_bwd_state_walk",
    "chunk_bwd",
    "conv1d_silu",
    "conv1d_silu_bwd",
    "CONV_WIDTH",
    "G_FLOOR",
    "l2norm",
    "kda_gate",
    "beta_sigmoid",
    "L2NORM_EPS",
]
