"""The kernels' rounding points as knobs: SHIPPED (before the numerics fixes), FIXED (the kernels now)."""
from __future__ import annotations

# Rounding points of the shipped kernels (value = what ships). 'fp32' switches one off.
SHIPPED = {
    # kda_fwd_chunk/lean
    "gate_clamp": None,      # g floor before the cumulative sum (None: none)
    "anchor": "mid16",       # diagonal 16-row blocks: one anchor at the middle row ('mid16'), or
                             # 8-row sub-blocks at their middles, the off-diagonal 8 x 8 at row 8 ('mid8')
    "gram_a": "lean",        # Akk/Aqk row operands (q_i, k_i gated): bf16(x * bf16(exp)) ('lean'), bf16(x * exp)
    "gram_b": "lean",        # ('bf16'), bf16 hi + lo ('hilo'), tf32, fp32; gram_b: the column operand k_j gated
    "gram_diag_a": None,     # row / column operands of the diagonal 16-row blocks' pieces
    "gram_diag_b": None,     # (None: gram_a / gram_b)
    "gram_off_a": None,      # row / column operands of the off-diagonal 16-row blocks
    "gram_off_b": None,      # (None: gram_a / gram_b)
    "gram_q": None,          # Aqk's row operand q_i gated alone (None: as Akk's row operand k_i gated)
    "gram_exact": None,      # 'aqk', 'akk' or 'both': that product from exact fp32 operands (attribution)
    "gamma": "fp32",         # Gamma, G as the kernels' fp32 running sum, or exact ('fp64')
    "aqk_ii": "mma",         # Aqk's i = j entries from the mma ('mma') or as sum_d q k in fp32 ('exact')
    "aqk": "bf16",           # Aqk as the walk (and backward) reads it
    "inv": "fp32",           # (I + L)^-1 inside the chunk stage (3xTF32 ~ fp32)
    "t_op": "bf16",          # T = (I + L)^-1 Diag(beta) as the W/U product operand
    "kexp": "bf16",          # K e^Gamma as the W product operand ('hilo': bf16 hi + lo, a second mma pass)
    "w_beta": "t",           # where beta enters W: in T = bf16((I + L)^-1 Diag(beta)) ('t', the kernel), or in
                             # the K operand bf16(beta K e^Gamma) with bf16((I + L)^-1) for W only ('k'), or in
                             # both operands of W and U: bf16((I + L)^-1) @ bf16(beta K e^Gamma) / bf16(beta V)
                             # ('kv', FLA's form), or T's diagonal out of the mma and beta_i K_i e^Gamma_i added
                             # to W's accumulator in fp32 ('t_diag')
    "entering": "decay",     # the initial state / dh0 times kda.entering_decay when g is floored (the op does)
    "w": "bf16", "u": "bf16", "qg": "bf16", "kg": "bf16",
    # kda_fwd_walk
    "s_op": "bf16",          # the state as a product operand
    "vnew": "bf16",          # V' as a product operand (and the saved V')
    "vnew_diag": None,       # V' in the i = j terms of O and dAqk alone (None: vnew; 'fp32': V' before its rounding,
                             # a V' lo tensor beside, its product with Aqk_ii / dO_i added in fp32, no extra mma;
                             # 'u_lo': U's rounding error U - bf16(U) added there instead, V' as vnew;
                             # 'u_recomputed': dAqk_ii alone, U - bf16(U) with U formed again in fp32 by
                             # kda_bwd_chunk from the saved bf16 (I + L)^-1, beta and V: no extra tensor)
    "o_acc": "one",          # O = Qg S + Aqk V' in one fp32 accumulator
    "o_diag": "mma",         # Aqk's i = j terms of O: inside the bf16 mma ('mma'); out of the tile and added
                             # as Aqk_ii (fp32) x V'_i (the fp32 accumulator V' is rounded from) ('fp32'); or
                             # the mma's plus (Aqk_ii - bf16(Aqk_ii)) x bf16(V'_i) after it ('residual')
    # kda_bwd_walk
    "ds_op": "bf16", "ndv": "bf16",
    "bw_w": "stored",        # the backward walk's W, Qg, Kg operands: the stored bf16 tiles ('stored'), or the
    "bw_qg": "stored",       # chunk stage's unrounded fp32 values as 'fp32' / 'hilo' operands (the walk alone)
    "bw_kg": "stored",
    "bw_order": "kernel",    # dS update: fma(scale, Qg^T dO, e^gamma dS), then W^T (-dV') into that accumulator
                             # ('kernel'), or e^gamma dS + (scale Qg^T dO - W^T dV') ('fla')
    # kda_bwd_chunk
    "tape_op": "bf16",       # S, dS tapes as operands
    "tape_dkg": None,        # dS as the operand of dKg = V' dS^T alone (None: tape_op; 'hilo': a second mma pass)
    "tape_dqg": None,        # S as the operand of dQg = scale dO S^T alone (None: tape_op)
    "tape_dvp": None,        # dS as the operand of dV' = ... + Kg dS alone (None: tape_op; 'hilo': a second mma pass)
    "akk_inv": "bf16",       # saved (I + L)^-1
    "dvp": "bf16", "dw": "bf16", "drk": "bf16", "drv": "bf16",
    "dvp_dw": None,          # dV' as dW's operand alone (None: dvp; 'bf16': hi only while dRv keeps dvp's)
    "dqg": "bf16", "dkg": "bf16", "daqk": "bf16", "dakk": "bf16",
    # kda_bwd_gate
    "gated_op": "hilo",      # the gated operand (bf16 hi + lo)
    "gate_diag": "mma",      # the i = j terms of the gated products: inside the mma ('mma') or exact ('exact')
    "daqk_ii": "bf16",       # dAqk's i = j entries as the gate reads them (with gate_diag exact)
    "dg_kg": "total",        # the Kg terms of dg: the chunk's total minus the suffix ('total') or the prefix sum
                             # ('prefix': no cancellation)
    # outputs
    "out": "bf16",           # o, dq, dk, dv, dbeta as returned (bf16 tensors)
}

KNOB_DOC = {
    "gram_a": "Akk/Aqk row operands (chunk stage)", "gram_b": "Akk/Aqk column operand (chunk stage)",
    "gram_diag_a": "gram_a, diagonal blocks only", "gram_diag_b": "gram_b, diagonal blocks only",
    "gram_off_a": "gram_a, off-diagonal blocks only", "gram_off_b": "gram_b, off-diagonal blocks only",
    "gram_q": "Aqk's row operand alone",
    "aqk": "Aqk stored bf16",
    "t_op": "T = (I+L)^-1 diag(beta) operand", "kexp": "K e^Gamma operand", "w": "W stored", "u": "U stored",
    "qg": "Q e^Gamma stored", "kg": "K e^(gamma-Gamma) stored", "s_op": "walk: S operand",
    "vnew": "walk: V' operand/saved", "vnew_diag": "V' in O's and dAqk's i = j terms", "ds_op": "bwd walk: dS operand", "ndv": "bwd walk: dV' operand",
    "tape_op": "bwd chunk: S, dS operands", "tape_dvp": "bwd chunk: dS operand of dV'",
    "akk_inv": "(I+L)^-1 saved bf16", "dvp": "bwd chunk: dV'", "dvp_dw": "bwd chunk: dV' as dW's operand",
    "dw": "bwd chunk: dW", "drk": "bwd chunk: dRk", "drv": "bwd chunk: dRv", "dqg": "dQg stored",
    "dkg": "dKg stored", "daqk": "dAqk stored", "dakk": "dAkk stored", "gated_op": "gate: gated operand",
}

# What the kernels do now (the numerics fixes): the gate floored at -20, the diagonal blocks in three
# anchored pieces, Aqk's diagonal exact and its bf16 rounding error added back after the walk's product, W's
# diagonal term in fp32, dAqk's diagonal terms exact and out of dGamma, dKg in fp32 with dS as hi + lo, dg's Kg
# terms as a prefix sum, dV' as bf16 hi + lo in kda_bwd_chunk; the Akk/Aqk column operand as the fp32 product
# rounded once and Aqk's row operand as that product in bf16 hi + lo (kda_fwd_chunk); dS as hi + lo in
# dV' = .. + Kg dS (kda_bwd_chunk).
FIXED = dict(SHIPPED, gate_clamp=20.0, anchor="mid8", aqk_ii="exact", o_diag="residual", w_beta="t_diag",
             vnew_diag="u_recomputed", gate_diag="exact", daqk_ii="fp32", dkg="fp32", tape_dkg="hilo",
             dg_kg="prefix", dvp="hilo", gram_q="hilo", gram_b="bf16", daqk="hilo", tape_dvp="hilo")
