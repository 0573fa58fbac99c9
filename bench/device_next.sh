#!/usr/bin/env bash
# One device call (nvidia-h200) verifying what session 2 wrote without device time: the l2norm
# programs, kda_bwd_gate/split, kda_bwd_tape/split (bitwise tests on 1/2/6/500 chains x H 1/32/64),
# the rewritten shipped records (gate generalised, backward walk generalised), sanitizers, the fit
# rule's rho for both walks with the per-walk table, the gate A/B, profiles, the single benchmark.
# (Nsight Compute on every kernel: bench/ncu_kda.sh, a call of its own.)
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
KDA_AOT_TEST_RECORDS=1 python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
stamp build
timeout 240 python3 -X faulthandler -m pytest -q -rs tests/test_kda_fwd_gpu.py tests/test_kda_bwd_gpu.py \
  tests/test_l2norm.py tests/test_nn.py tests/test_cp_cuda.py tests/test_conv_gpu.py tests/test_graph_gpu.py "$@" 2>&1 \
  | tee "$OUT/pytest.log" | grep -E "passed|failed|Error|assert" | tail -12; stamp tests
export PYTHONPATH=$PWD:${PYTHONPATH:-}
for tool in memcheck racecheck; do
  timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize_kda.py > "$OUT/sanitizer_kda_$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $?"; tail -2 "$OUT/sanitizer_kda_$tool.log"
done; stamp sanitizers
timeout 120 python3 bench/measure_rho.py --table 2>&1 | tail -24; cp kda_aot/fit_params.json "$OUT/"; stamp rho
timeout 60 python3 bench/gate_ab.py Q1 32 2>&1 | tail -1; stamp "gate A/B"
timeout 60 python3 bench/profile_kda.py Q1 32 2>&1 | grep -E "kda_|Self CUDA" | cut -c1-60,120-200; stamp profile
timeout 60 python3 bench/profile_module.py Q1 32 > "$OUT/profile_module.log" 2>&1; grep -E "B3|kda_|l2norm|conv1d|elementwise|reduce" "$OUT/profile_module.log" | cut -c1-55,100-150 | head -14
timeout 200 python3 -m kda_aot.bench single --pack Q1 --iters 10 --out "$OUT" 2>&1 | grep -E '"ms"|ratio|oom|Error' | cut -c1-330; stamp single
