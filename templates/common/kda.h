// Launch arguments of the single-device chunked KDA forward programs (kda_fwd_chunk: the
// chunk-parallel stage; kda_fwd_walk: the state walk with the output stage fused). Layouts follow flash-linear-attention's chunk_kda: token-major
// [T, H, 128] for q, k, v, g and every per-token intermediate; chunk-major [n_chunks, H, ...] for
// per-chunk tensors. bf16 data is passed as raw 16-bit words. Grouped value heads (FLA's HV > H): H is the
// value heads (v, g, beta, o, the states and every intermediate); q and k have qk_heads = H / qk_group heads,
// and value head h reads q, k head h / qk_group.
#pragma once
#include <cstdint>

namespace kda {

constexpr int kHeadDim = 128;  // K = V = 128
constexpr int kChunk = 64;     // tokens per chunk
constexpr int kMaxHeads = 64;
// The gate's floor: every program sums max(g, -kGateFloor) (so g = -inf, a reset, is finite there).
// A token below it keeps e^-20 ~ 2e-9 of the state instead of less: below bf16's resolution of every
// output; its dg is zero (the floor's derivative). 20 keeps the diagonal 8-row pieces' factors within
// e^(4 x 20) (docs/numerics.md).
constexpr float kGateFloor = 20.f;

// The gate's activation inside the programs (chunk_kda's use_gate_in_kernel): with kind != kGateRaw, g holds
// the raw gate x and kda_fwd_chunk and kda_bwd_gate form the log decay from it before the cumulative sum,
// so the activated gate never goes through memory (kda.cuh: activated_gate).
enum GateKind : int {
  kGateRaw = 0,       // g is the log decay
  kGateSoftplus = 1,  // -exp(A_log) softplus(x + dt_bias)
  kGateSigmoid = 2,   // lower_bound sigmoid(exp(A_log) (x + dt_bias))
};
struct KdaGate {
  int kind;
  float lower_bound;
  const float* a_log;    // [H] fp32, or null: exp(A_log) = 1
  const float* dt_bias;  // [H, 128] fp32, or null: 0
  // [T, H, 128] the raw gate in bf16 (as FLA's f_proj gives it; g then null), or null: g in fp32. Read as it
  // is, so that no fp32 copy of it goes through memory.
  const uint16_t* raw_bf16;
};

// beta's activation inside the programs (chunk_kda's use_beta_sigmoid_in_kernel): with kind != kBetaPlain, beta
// holds the logits b and every program that reads beta (kda_fwd_chunk, kda_bwd_chunk, kda_bwd_gate) forms it on load
// in fp32 (kda.cuh: activated_beta), so that no activated copy goes through memory; dbeta stays beta's gradient
// (the caller applies the chain factor where it sums dbeta's parts).
enum BetaKind : int {
  kBetaPlain = 0,     // beta is beta
  kBetaSigmoid = 1,   // sigmoid(b)
  kBetaSigmoid2 = 2,  // 2 sigmoid(b) (allow_neg_eigval)
};
struct KdaBeta {
  int kind;
  // [T, H] the logits in fp32 (beta then null), or null: beta in bf16 (logits or beta itself).
  const float* logits_f32;
};

struct KdaFwdArgs {
  // inputs
  const uint16_t* q;            // [T, qk_heads, 128] bf16
  const uint16_t* k;            // [T, qk_heads, 128] bf16
  const uint16_t* v;            // [T, H, 128] bf16
  const float* g;               // [T, H, 128] fp32 log decay (<= 0)
  const uint16_t* beta;         // [T, H] bf16
  const float* initial_state;   // [N, H, 128, 128] fp32 or null
  const int32_t* chunks;        // [n_chunks, 2]: (first token, end token) of each chunk, packed order
  const int32_t* seg_chunks;    // [N + 1]: first chunk of each segment
  int64_t T, N, H, n_chunks;
  int64_t qk_heads, qk_group;   // q's and k's heads, and the value heads that read each (H = qk_heads * qk_group)
  float scale;
  // kda_fwd_chunk outputs (chunk-parallel intermediates)
  uint16_t* w;                  // [T, H, 128] bf16  W = T_c (K * exp(Gamma))
  uint16_t* u;                  // [T, H, 128] bf16  U = T_c V
  uint16_t* qg;                 // [T, H, 128] bf16  Q * exp(Gamma)
  uint16_t* kg;                 // [T, H, 128] bf16  K * exp(gamma - Gamma)
  uint16_t* aqk;                // [T, H, 64]  bf16  row i of the chunk's tril(Aqk)
  float* aqk_diag_lo;           // [T, H]      fp32  Aqk_ii - bf16(Aqk_ii): the rounding error of the diagonal
                                //                    (q_i . k_i, o_i's largest term at strong decay), which the
                                //                    walk's output stage adds back (docs/numerics.md)
  float* gamma;                 // [n_chunks, H, 128] fp32: Gamma at the chunk's last token
  uint16_t* akk_inv;            // [T, H, 64]  bf16  row i of the chunk's (I + L)^-1, or null (for the backward)
  uint16_t* inv_pack;           // [T, H, 64]  bf16  the chunk's T_c below the diagonal, (I + L)^-1 on and above it
                                //                    transposed, or null: the forward of the replay writes it, the
                                //                    replay's chunk stage (form `replay`) reads it
  // kda_fwd_walk outputs
  uint16_t* o;                  // [T, H, 128] bf16
  float* final_state;           // [N, H, 128, 128] fp32 or null
  uint16_t* u_lo_end;           // [N, 64, H, 128] bf16 or null: U - bf16(U) over the last chunk of each segment (rows
                                //                    below its length; kda_fwd_chunk writes it, the walk adds
                                //                    Kg^T of it to the final state: docs/numerics.md)
  const int32_t* end_segment;   // [n_chunks] int32: the segment a chunk is the last of, or -1 (with u_lo_end:
                                //                    -1 also where that segment's final state takes no tile)
  float* transfer;              // kcp_transfer output: [N, H, 128, 128] fp32 M = A_n ... A_1 per segment
  float* tape;                  // [n_chunks, H, 128, 128] fp32 state at each chunk start, or null
  uint16_t* vnew;               // [T, H, 128] bf16 V' = U - W S, or null (both kept for the saved backward)
  KdaGate gate;                 // kda_fwd_chunk: how g becomes the log decay
  KdaBeta beta_act;             // kda_fwd_chunk: how beta is formed from what the beta tensor holds
};

}  // namespace kda

namespace kda {

// Launch arguments of the backward state walk (kda_bwd_walk).
struct KdaBwdArgs {
  const uint16_t* dout;          // [T, H, 128] bf16 gradient of o
  const uint16_t* w;             // [T, H, 128] bf16 (forward chunk stage)
  const uint16_t* qg;            // [T, H, 128] bf16
  const uint16_t* kg;            // [T, H, 128] bf16
  const uint16_t* aqk;           // [T, H, 64]  bf16
  const float* gamma;            // [n_chunks, H, 128] fp32
  const int32_t* chunks;         // [n_chunks, 2]
  const int32_t* seg_chunks;     // [N + 1]
  const float* dfinal_state;     // [N, H, 128, 128] fp32 or null
  float* dtape;                  // [n_chunks, H, 128, 128] fp32: gradient of the state at each chunk END
                                 // (kda_bwd_walk writes it, kda_bwd_chunk reads it)
  float* dinitial_state;         // [N, H, 128, 128] fp32 or null
  // kda_bwd_chunk inputs (besides dout, w, kg, aqk, gamma, chunks, dtape)
  const uint16_t* v;             // [T, H, 128] bf16
  const uint16_t* u;             // [T, H, 128] bf16
  const uint16_t* vnew;          // [T, H, 128] bf16 V'
  const uint16_t* akk_inv;       // [T, H, 64]  bf16 (I + L)^-1
  const uint16_t* beta;          // [T, H] bf16
  KdaBeta beta_act;              // kda_bwd_chunk, kda_bwd_gate: how beta is formed from what the beta tensor holds
  const float* tape;             // [n_chunks, H, 128, 128] fp32 state at each chunk start
  // kda_bwd_chunk outputs (the plain products of the chunk-parallel backward)
  uint16_t* dv;                  // [T, H, 128] bf16  beta * dRv
  uint16_t* drk;                 // [T, H, 128] bf16  dRk = (I + L)^-T dW,  dW = -dV' S^T
  uint16_t* dqg;                 // [T, H, 128] bf16  scale dO S^T
  float* dkg;                    // [T, H, 128] fp32  V' dS_end^T (fp32: in bf16 its rounding would be dk's and dg's
                                 //                    largest error at strong decay, bench/studies/kda_emulation.py)
  uint16_t* daqk;                // [T, H, 64]  bf16  scale tril(dO V'^T)   (bf16: the gated products' operand,
  uint16_t* dakk;                // [T, H, 64]  bf16  -tril_strict(dRk W^T + dRv U^T)  rounded once, here)
  uint16_t* daqk_lo;             // [T, H, 64]  bf16  dAqk - float(daqk), its bf16 rounding residue (diagonal zero):
                                 //                    added in the gate's rows(dAqk, K) (dq: its in-chunk terms are
                                 //                    not decayed away at mild gates, docs/numerics.md) and
                                 //                    cols(dAqk, Q) (so that the pair terms cancel in dGamma)
  float* daqk_diag;              // [T, H]      fp32  scale dO_i . (V'_i + U'_i - U_i): dAqk's diagonal, taken exactly
                                 //                    by the gate; U' is U formed again in fp32 from akk_inv, beta
                                 //                    and V, so U's bf16 rounding leaves it (V'_i ~ U_i at strong decay)
  float* dbeta_v;                // [T, H]      fp32  sum_v V * dRv
  float* dgam_s;                 // [n_chunks, H, 128] fp32  exp(gamma) * rowsum(S * dS_end)
  // kda_bwd_gate inputs: q, k, g, beta and the fp32 intermediates above; outputs:
  const uint16_t* q;             // [T, qk_heads, 128] bf16
  const uint16_t* k;             // [T, qk_heads, 128] bf16
  const float* g;                // [T, H, 128] fp32
  uint16_t* dq;                  // [T, H, 128] bf16: per value head (the caller sums each q head's group)
  uint16_t* dk;                  // [T, H, 128] bf16: per value head (likewise)
  float* dg;                     // [T, H, 128] fp32
  uint16_t* dg_bf16;             // [T, H, 128] bf16: dg in the raw gate's dtype when gate.raw_bf16 (dg then null)
  float* dbeta;                  // [T, H] fp32
  float* dbeta_part;             // [2, T, H] fp32: per channel half, when two CTAs share a (chunk, head)
  // with the gate's activation (gate.kind != kGateRaw) dg is the raw gate's gradient, and each chunk's parts
  // of the parameters' gradients are written (the caller sums them over chunks, in a fixed order):
  KdaGate gate;
  float* ddt_bias_part;          // [n_chunks, H, 128] fp32: sum over the chunk's rows of dg
  float* da_log_part;            // [n_chunks, H, 2] fp32: per channel half, sum of dG dG/dA_log (full width: [.., 1] = 0)
  int64_t T, N, H, n_chunks;
  int64_t qk_heads, qk_group;    // as KdaFwdArgs
  float scale;
};

}  // namespace kda
