// Argument checks shared by the KDA bindings (forward and backward). Tensors arrive as a dict of descriptors
// named as in KdaFwdArgs; each program names the ones it needs, and every tensor given is checked
// (dtype, shape, contiguity, 16-byte alignment, one CUDA device) before anything is launched.
#pragma once
#include <map>
#include <string>

#include "common/binding.h"
#include "common/kda.h"

namespace kda {

// Checked tensors of one call: dims from q (or dout), the value heads H (v, dout, w, kg or g), chunks and seg_chunks.
struct KdaTensors {
  std::map<std::string, Tensor> t;
  int64_t T = 0, N = 0, H = 0, C = 0;
  int64_t Hqk = 0;  // q's and k's heads: H / Hqk value heads read each (grouped value heads)
  int device = -1;  // the CUDA device every tensor is on
  uint64_t ptr(const char* name) const {
    auto it = t.find(name);
    return it == t.end() ? 0 : it->second.ptr;
  }
  bool bf16(const char* name) const {
    auto it = t.find(name);
    return it != t.end() && it->second.present && it->second.dtype == kBFloat16;
  }
};

inline bool needs(const std::vector<std::string>& need, const char* name) {
  for (const auto& n : need)
    if (n == name) return true;
  return false;
}

// need: tensors that must be given; need_one: tensors of which at least one must be given. gate_kind: the
// gate's activation of a program that reads g (kind 1, 2: g may be the raw gate in bf16, and dg then bf16).
// need_with_o: a tensor that must be given with the output o.
inline KdaTensors check_kda_tensors(const py::dict& tensors, const std::vector<std::string>& need, const char* what,
                                    const std::vector<std::string>& need_one = {}, int gate_kind = kGateRaw,
                                    const char* need_with_o = nullptr, int beta_kind = kBetaPlain) {
  static const char* kKnown[] = {"q", "k", "v", "g", "beta", "initial_state", "chunks", "seg_chunks", "w", "u",
                                 "qg", "kg", "aqk", "aqk_diag_lo", "gamma", "tape", "vnew", "final_state", "o",
                                 "dout", "dfinal_state", "dtape", "dinitial_state", "akk_inv", "inv_pack", "dv", "drk",
                                 "dqg", "dkg", "daqk", "daqk_lo", "dakk", "daqk_diag", "dbeta_v", "dgam_s", "dq", "dk",
                                 "dg", "dbeta", "dbeta_part", "transfer", "gate_a_log", "gate_dt_bias", "ddt_bias_part",
                                 "da_log_part", "u_lo_end", "end_segment"};
  KdaTensors out;
  auto& t = out.t;
  for (auto item : tensors) {
    const std::string name = py::str(item.first);
    bool known = false;
    for (const char* k : kKnown) known = known || name == k;
    if (!known) fail_value(std::string(what) + ": unknown tensor argument '" + name + "'");
    t[name] = tensor_arg(item.second, name.c_str(), false);
  }
  for (const auto& name : need)
    if (!t.count(name) || !t[name].present) fail_type(name + ": a tensor is required by " + what);
  if (!need_one.empty()) {
    bool any = false;
    std::string names;
    for (const auto& name : need_one) {
      any = any || (t.count(name) && t[name].present);
      names += (names.empty() ? "" : " or ") + name;
    }
    if (!any) fail_type(std::string(what) + ": expected a tensor for " + names);
  }
  if (need_with_o && t.count("o") && t["o"].present && !(t.count(need_with_o) && t[need_with_o].present))
    fail_type(std::string(what) + ": " + need_with_o + " is required with o");

  // q (or dout) fixes T and q's heads; the first given of v, dout, w, kg, g the value heads H, a multiple of
  // q's (grouped value heads); chunks fixes the chunk count; seg_chunks the segment count.
  const Tensor& q = t.count("q") && t["q"].present ? t["q"] : t["dout"];
  expect_dtype(q, kBFloat16);
  if (q.shape.size() != 4 || q.shape[0] != 1)
    fail_value(q.name + ": expected shape [1, T, H, 128] (packed documents, batch 1), got " + join(q.shape));
  if (q.shape[3] != kHeadDim) fail_value(q.name + ": head dim must be 128, got " + std::to_string(q.shape[3]));
  const int64_t T = q.shape[1];
  if (q.shape[2] < 1 || q.shape[2] > kMaxHeads)
    fail_value(q.name + ": heads must be 1 .. 64, got " + std::to_string(q.shape[2]));
  if (T < 1 || T > INT32_MAX) fail_value(q.name + ": T must be in 1 .. 2^31 - 1, got " + std::to_string(T));
  const Tensor* heads = &q;
  for (const char* name : {"v", "dout", "w", "kg", "g"})
    if (heads == &q && t.count(name) && t[name].present && t[name].shape.size() == 4) heads = &t[name];
  const int64_t H = heads->shape[2];
  if (H < 1 || H > kMaxHeads) fail_value(heads->name + ": heads must be 1 .. 64, got " + std::to_string(H));
  const int64_t Hqk = q.name == "q" ? q.shape[2] : H;  // without q the program reads no q, k head
  if (H % Hqk != 0)
    fail_value(heads->name + ": its heads (HV = " + std::to_string(H) + ") must be a multiple of q's and k's (H = " +
               std::to_string(Hqk) + ")");
  const Tensor& chunks = t["chunks"];
  expect_dtype(chunks, kInt32);
  if (chunks.shape.size() != 2 || chunks.shape[1] != 2 || chunks.shape[0] < 1)
    fail_value("chunks: expected shape [n_chunks, 2], got " + join(chunks.shape));
  const int64_t C = chunks.shape[0];
  const Tensor& segs = t["seg_chunks"];
  expect_dtype(segs, kInt32);
  if (segs.shape.size() != 1 || segs.shape[0] < 2)
    fail_value("seg_chunks: expected shape [N + 1], got " + join(segs.shape));
  const int64_t N = segs.shape[0] - 1;

  struct Spec {
    const char* name;
    int dtype;
    std::vector<int64_t> shape;
    const char* spelled;
  };
  // H: the value heads; q and k have Hqk (H = Hqk with no grouping)
  const std::vector<int64_t> tok = {1, T, H, kHeadDim}, state = {N, H, kHeadDim, kHeadDim};
  const std::vector<int64_t> tok_qk = {1, T, Hqk, kHeadDim};
  const std::vector<Spec> specs = {
      {"q", kBFloat16, tok_qk, "[1, T, Hqk, 128]"},
      {"k", kBFloat16, tok_qk, "[1, T, Hqk, 128] (as q)"},
      {"v", kBFloat16, tok, "[1, T, H, 128] (H: a multiple of q's heads)"},
      {"g", kFloat32, tok, "[1, T, H, 128] (as v)"},
      {"beta", kBFloat16, {1, T, H}, "[1, T, H]"},
      {"initial_state", kFloat32, state, "[N, H, 128, 128]"},
      {"chunks", kInt32, {C, 2}, "[n_chunks, 2]"},
      {"seg_chunks", kInt32, {N + 1}, "[N + 1]"},
      {"w", kBFloat16, tok, "[1, T, H, 128]"},
      {"u", kBFloat16, tok, "[1, T, H, 128]"},
      {"qg", kBFloat16, tok, "[1, T, H, 128]"},
      {"kg", kBFloat16, tok, "[1, T, H, 128]"},
      {"aqk", kBFloat16, {1, T, H, kChunk}, "[1, T, H, 64]"},
      {"aqk_diag_lo", kFloat32, {1, T, H}, "[1, T, H]"},
      {"gamma", kFloat32, {C, H, kHeadDim}, "[n_chunks, H, 128]"},
      {"tape", kFloat32, {C, H, kHeadDim, kHeadDim}, "[n_chunks, H, 128, 128]"},
      {"vnew", kBFloat16, tok, "[1, T, H, 128]"},
      {"final_state", kFloat32, state, "[N, H, 128, 128]"},
      {"o", kBFloat16, tok, "[1, T, H, 128]"},
      {"dout", kBFloat16, tok, "[1, T, H, 128]"},
      {"dfinal_state", kFloat32, state, "[N, H, 128, 128]"},
      {"dtape", kFloat32, {C, H, kHeadDim, kHeadDim}, "[n_chunks, H, 128, 128]"},
      {"dinitial_state", kFloat32, state, "[N, H, 128, 128]"},
      {"akk_inv", kBFloat16, {1, T, H, kChunk}, "[1, T, H, 64]"},
      {"inv_pack", kBFloat16, {1, T, H, kChunk}, "[1, T, H, 64]"},
      {"dv", kBFloat16, tok, "[1, T, H, 128]"},
      {"drk", kBFloat16, tok, "[1, T, H, 128]"},
      {"dqg", kBFloat16, tok, "[1, T, H, 128]"},
      {"dkg", kFloat32, tok, "[1, T, H, 128]"},
      {"daqk", kBFloat16, {1, T, H, kChunk}, "[1, T, H, 64]"},
      {"daqk_lo", kBFloat16, {1, T, H, kChunk}, "[1, T, H, 64]"},
      {"dakk", kBFloat16, {1, T, H, kChunk}, "[1, T, H, 64]"},
      {"daqk_diag", kFloat32, {1, T, H}, "[1, T, H]"},
      {"dbeta_v", kFloat32, {1, T, H}, "[1, T, H]"},
      {"dgam_s", kFloat32, {C, H, kHeadDim}, "[n_chunks, H, 128]"},
      {"dq", kBFloat16, tok, "[1, T, H, 128]"},
      {"dk", kBFloat16, tok, "[1, T, H, 128]"},
      {"dg", kFloat32, tok, "[1, T, H, 128]"},
      {"dbeta", kFloat32, {1, T, H}, "[1, T, H]"},
      {"dbeta_part", kFloat32, {2, T, H}, "[2, T, H]"},
      {"transfer", kFloat32, state, "[N, H, 128, 128]"},
      {"gate_a_log", kFloat32, {H}, "[H]"},
      {"gate_dt_bias", kFloat32, {H, kHeadDim}, "[H, 128]"},
      {"ddt_bias_part", kFloat32, {C, H, kHeadDim}, "[n_chunks, H, 128]"},
      {"da_log_part", kFloat32, {C, H, 2}, "[n_chunks, H, 2]"},
      {"u_lo_end", kBFloat16, {N, kChunk, H, kHeadDim}, "[N, 64, H, 128]"},
      {"end_segment", kInt32, {C}, "[n_chunks]"},
  };
  std::vector<const Tensor*> all;
  for (const Spec& sp : specs) {
    auto it = t.find(sp.name);
    if (it == t.end() || !it->second.present) continue;
    // g and dg may also be bf16: the raw gate as FLA gives it and its gradient, for a program that activates
    // it (or one that does not read them: the walks get the same tensors)
    const bool raw_gate = (std::string(sp.name) == "g" || std::string(sp.name) == "dg") &&
                          it->second.dtype == kBFloat16 && (gate_kind != kGateRaw || !needs(need, sp.name));
    // beta may be fp32 as the logits of an activation (FLA's b_proj output in fp32, read as it is), for a program
    // that activates it (or one that does not read it)
    const bool f32_logits = std::string(sp.name) == "beta" && it->second.dtype == kFloat32 &&
                            (beta_kind != kBetaPlain || !needs(need, sp.name));
    if (!raw_gate && !f32_logits) expect_dtype(it->second, sp.dtype);
    expect_shape(it->second, sp.shape, sp.spelled);
    expect_contiguous(it->second);
    // beta and dbeta are read per element; every other tensor in 16-byte vectors
    // (seg_chunks too: a view narrowed to one segment starts at any int32)
    const bool scalar = std::string(sp.name) == "beta" || std::string(sp.name) == "dbeta" ||
                        std::string(sp.name) == "dbeta_v" || std::string(sp.name) == "dbeta_part" ||
                        std::string(sp.name) == "daqk_diag" || std::string(sp.name) == "aqk_diag_lo" ||
                        std::string(sp.name) == "gate_a_log" ||
                        std::string(sp.name) == "gate_dt_bias" || std::string(sp.name) == "da_log_part" ||
                        std::string(sp.name) == "seg_chunks" || std::string(sp.name) == "end_segment";
    expect_aligned(it->second, scalar ? dtype_size(it->second.dtype) : (sp.dtype == kInt32 ? 8 : 16));
    all.push_back(&it->second);
  }
  out.device = expect_one_cuda_device(all);
  out.T = T;
  out.N = N;
  out.H = H;
  out.Hqk = Hqk;
  out.C = C;
  return out;
}

// The gate's activation (KdaGate): its kind and lower bound from the caller, its parameter tensors from the
// checked set. Raw (kind 0) takes no parameter tensor; the others need g, and lower_bound < 0 for the sigmoid.
// reads_g: the program reads g (kda_fwd_chunk, kda_bwd_gate): bf16 there only as the raw gate of kind 1, 2
// (check_kda_tensors); the others may be handed the same g and ignore it.
inline KdaGate gate_args(const KdaTensors& k, int kind, double lower_bound, const char* what, bool reads_g) {
  if (kind != kGateRaw && kind != kGateSoftplus && kind != kGateSigmoid)
    fail_value(std::string(what) + ": gate_kind must be 0 (g is the log decay), 1 (softplus) or 2 (sigmoid), got " +
               std::to_string(kind));
  if (kind == kGateRaw && (k.ptr("gate_a_log") || k.ptr("gate_dt_bias")))
    fail_value(std::string(what) + ": gate_a_log / gate_dt_bias given with gate_kind 0 (g is the log decay)");
  if (kind == kGateSoftplus && !k.ptr("gate_a_log"))
    fail_type(std::string(what) + ": gate_kind 1 (-exp(A_log) softplus) needs gate_a_log");
  if (kind == kGateSigmoid && !(lower_bound < 0.0))
    fail_value(std::string(what) + ": gate_kind 2 needs lower_bound < 0, got " + std::to_string(lower_bound));
  KdaGate gate{};
  gate.kind = kind;
  gate.lower_bound = static_cast<float>(lower_bound);
  gate.a_log = reinterpret_cast<const float*>(k.ptr("gate_a_log"));
  gate.dt_bias = reinterpret_cast<const float*>(k.ptr("gate_dt_bias"));
  if (reads_g && k.bf16("g")) gate.raw_bf16 = reinterpret_cast<const uint16_t*>(k.ptr("g"));  // kind 1, 2
  return gate;
}

// beta's activation (KdaBeta): its kind from the caller; fp32 logits (check_kda_tensors let them through only
// with kind 1, 2) are read through logits_f32 and the bf16 pointer is then null.
inline KdaBeta beta_args(const KdaTensors& k, int kind, const char* what) {
  if (kind != kBetaPlain && kind != kBetaSigmoid && kind != kBetaSigmoid2)
    fail_value(std::string(what) + ": beta_kind must be 0 (beta as given), 1 (sigmoid) or 2 (2 sigmoid), got " +
               std::to_string(kind));
  KdaBeta act{};
  act.kind = kind;
  auto it = k.t.find("beta");
  if (it != k.t.end() && it->second.present && it->second.dtype == kFloat32)
    act.logits_f32 = reinterpret_cast<const float*>(it->second.ptr);
  return act;
}

template <typename Args>
inline void run_launcher(int (*launcher)(const Args*, int, void*, char*, int), const Args& a, int device,
                         uint64_t stream, const char* what) {
  char err[256] = {0};
  const int code = launcher(&a, device, reinterpret_cast<void*>(stream), err, sizeof(err));
  check_launch(code, err, what);
}

// need: tensors a launch must be given; need_one: tensors of which at least one must be given (outputs of which
// a call may leave some out). The launcher's argument struct picks the forward's or the backward's overload.
inline void launch_kda(const py::dict& tensors, double scale, uint64_t stream, const std::vector<std::string>& need,
                       const std::vector<std::string>& need_one, int (*launcher)(const KdaFwdArgs*, int, void*, char*, int),
                       const char* what, int gate_kind, double lower_bound, int beta_kind) {
  // the walk's output stage adds back Aqk's diagonal rounding error (kda_fwd_chunk's aqk_diag_lo)
  const KdaTensors k = check_kda_tensors(tensors, need, what, need_one, gate_kind,
                                         needs(need, "aqk") ? "aqk_diag_lo" : nullptr, beta_kind);
  KdaFwdArgs a{};
  a.gate = gate_args(k, gate_kind, lower_bound, what, needs(need, "g"));
  a.beta_act = beta_args(k, beta_kind, what);
  a.q = reinterpret_cast<const uint16_t*>(k.ptr("q"));
  a.k = reinterpret_cast<const uint16_t*>(k.ptr("k"));
  a.v = reinterpret_cast<const uint16_t*>(k.ptr("v"));
  a.g = a.gate.raw_bf16 || k.bf16("g") ? nullptr : reinterpret_cast<const float*>(k.ptr("g"));
  a.beta = a.beta_act.logits_f32 ? nullptr : reinterpret_cast<const uint16_t*>(k.ptr("beta"));
  a.initial_state = reinterpret_cast<const float*>(k.ptr("initial_state"));
  a.chunks = reinterpret_cast<const int32_t*>(k.ptr("chunks"));
  a.seg_chunks = reinterpret_cast<const int32_t*>(k.ptr("seg_chunks"));
  a.T = k.T;
  a.N = k.N;
  a.H = k.H;
  a.qk_heads = k.Hqk;
  a.qk_group = k.H / k.Hqk;
  a.n_chunks = k.C;
  a.scale = static_cast<float>(scale);
  a.w = reinterpret_cast<uint16_t*>(k.ptr("w"));
  a.u = reinterpret_cast<uint16_t*>(k.ptr("u"));
  a.qg = reinterpret_cast<uint16_t*>(k.ptr("qg"));
  a.kg = reinterpret_cast<uint16_t*>(k.ptr("kg"));
  a.aqk = reinterpret_cast<uint16_t*>(k.ptr("aqk"));
  a.aqk_diag_lo = reinterpret_cast<float*>(k.ptr("aqk_diag_lo"));
  a.gamma = reinterpret_cast<float*>(k.ptr("gamma"));
  a.akk_inv = reinterpret_cast<uint16_t*>(k.ptr("akk_inv"));
  a.inv_pack = reinterpret_cast<uint16_t*>(k.ptr("inv_pack"));
  // kda_fwd_chunk's forward form (the one that needs aqk_diag_lo) writes (I + L)^-1 for the saved context or
  // inv_pack for the replay, through one staging tile
  if (a.akk_inv && a.inv_pack && needs(need, "aqk_diag_lo"))
    fail_value(std::string(what) + ": akk_inv and inv_pack given: the forward writes one of them");
  a.tape = reinterpret_cast<float*>(k.ptr("tape"));
  a.vnew = reinterpret_cast<uint16_t*>(k.ptr("vnew"));
  a.final_state = reinterpret_cast<float*>(k.ptr("final_state"));
  // U's rounding error over each segment's last chunk: the forward chunk stage writes it where end_segment
  // says, the walk adds it to the final state
  a.u_lo_end = reinterpret_cast<uint16_t*>(k.ptr("u_lo_end"));
  a.end_segment = reinterpret_cast<const int32_t*>(k.ptr("end_segment"));
  if (a.u_lo_end && !a.end_segment)
    fail_type(std::string(what) + ": u_lo_end needs end_segment (the segment each chunk ends)");
  a.transfer = reinterpret_cast<float*>(k.ptr("transfer"));
  a.o = reinterpret_cast<uint16_t*>(k.ptr("o"));
  run_launcher(launcher, a, k.device, stream, what);
}

inline void launch_kda(const py::dict& tensors, double scale, uint64_t stream, const std::vector<std::string>& need,
                       const std::vector<std::string>& need_one, int (*launcher)(const KdaBwdArgs*, int, void*, char*, int),
                       const char* what, int gate_kind, double lower_bound, int beta_kind) {
  const KdaTensors k = check_kda_tensors(tensors, need, what, need_one, gate_kind, nullptr, beta_kind);
  KdaBwdArgs a{};
  a.gate = gate_args(k, gate_kind, lower_bound, what, needs(need, "g"));
  a.beta_act = beta_args(k, beta_kind, what);
  if (k.ptr("dg") && k.bf16("dg") != (a.gate.raw_bf16 != nullptr))
    fail_type(std::string(what) + ": dg must have g's dtype (bfloat16 only for a bfloat16 raw gate)");
  if (gate_kind != kGateRaw && !(k.ptr("ddt_bias_part") && k.ptr("da_log_part")))
    fail_type(std::string(what) + ": the gate's activation needs ddt_bias_part and da_log_part");
  a.ddt_bias_part = reinterpret_cast<float*>(k.ptr("ddt_bias_part"));
  a.da_log_part = reinterpret_cast<float*>(k.ptr("da_log_part"));
  a.dout = reinterpret_cast<const uint16_t*>(k.ptr("dout"));
  a.w = reinterpret_cast<const uint16_t*>(k.ptr("w"));
  a.qg = reinterpret_cast<const uint16_t*>(k.ptr("qg"));
  a.kg = reinterpret_cast<const uint16_t*>(k.ptr("kg"));
  a.aqk = reinterpret_cast<const uint16_t*>(k.ptr("aqk"));
  a.gamma = reinterpret_cast<const float*>(k.ptr("gamma"));
  a.chunks = reinterpret_cast<const int32_t*>(k.ptr("chunks"));
  a.seg_chunks = reinterpret_cast<const int32_t*>(k.ptr("seg_chunks"));
  a.dfinal_state = reinterpret_cast<const float*>(k.ptr("dfinal_state"));
  a.dtape = reinterpret_cast<float*>(k.ptr("dtape"));
  a.dinitial_state = reinterpret_cast<float*>(k.ptr("dinitial_state"));
  a.v = reinterpret_cast<const uint16_t*>(k.ptr("v"));
  a.u = reinterpret_cast<const uint16_t*>(k.ptr("u"));
  a.vnew = reinterpret_cast<const uint16_t*>(k.ptr("vnew"));
  a.akk_inv = reinterpret_cast<const uint16_t*>(k.ptr("akk_inv"));
  a.beta = a.beta_act.logits_f32 ? nullptr : reinterpret_cast<const uint16_t*>(k.ptr("beta"));
  a.tape = reinterpret_cast<const float*>(k.ptr("tape"));
  a.dv = reinterpret_cast<uint16_t*>(k.ptr("dv"));
  a.drk = reinterpret_cast<uint16_t*>(k.ptr("drk"));
  a.dqg = reinterpret_cast<uint16_t*>(k.ptr("dqg"));
  a.dkg = reinterpret_cast<float*>(k.ptr("dkg"));
  a.daqk = reinterpret_cast<uint16_t*>(k.ptr("daqk"));
  a.daqk_lo = reinterpret_cast<uint16_t*>(k.ptr("daqk_lo"));
  a.dakk = reinterpret_cast<uint16_t*>(k.ptr("dakk"));
  a.daqk_diag = reinterpret_cast<float*>(k.ptr("daqk_diag"));
  a.dbeta_v = reinterpret_cast<float*>(k.ptr("dbeta_v"));
  a.dgam_s = reinterpret_cast<float*>(k.ptr("dgam_s"));
  a.q = reinterpret_cast<const uint16_t*>(k.ptr("q"));
  a.k = reinterpret_cast<const uint16_t*>(k.ptr("k"));
  a.g = a.gate.raw_bf16 || k.bf16("g") ? nullptr : reinterpret_cast<const float*>(k.ptr("g"));
  a.dq = reinterpret_cast<uint16_t*>(k.ptr("dq"));
  a.dk = reinterpret_cast<uint16_t*>(k.ptr("dk"));
  a.dg = a.gate.raw_bf16 ? nullptr : reinterpret_cast<float*>(k.ptr("dg"));
  a.dg_bf16 = a.gate.raw_bf16 ? reinterpret_cast<uint16_t*>(k.ptr("dg")) : nullptr;
  a.dbeta = reinterpret_cast<float*>(k.ptr("dbeta"));
  a.dbeta_part = reinterpret_cast<float*>(k.ptr("dbeta_part"));
  a.T = k.T;
  a.N = k.N;
  a.H = k.H;
  a.qk_heads = k.Hqk;
  a.qk_group = k.H / k.Hqk;
  a.n_chunks = k.C;
  a.scale = static_cast<float>(scale);
  run_launcher(launcher, a, k.device, stream, what);
}

}  // namespace kda
