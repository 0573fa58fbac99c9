#!/usr/bin/env bash
# One call on nvidia-h200-x2 (< 600 s), two single-GPU streams side by side, then the NCCL tests:
#   GPU 0: every single-GPU test file, then the single benchmark on Q1 H = 32 (FLA interleaved)
#   GPU 1: compute-sanitizer memcheck + racecheck on the KDA records, the fit rule's rho table,
#          the module profile, Q1 H = 64 with FLA (does it still run out of memory?)
#   both:  the CP equality tests with the CUDA backend over NCCL.
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/ 2>/dev/null; fi
KDA_AOT_TEST_RECORDS=1 python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
stamp build
export PYTHONPATH=$PWD:${PYTHONPATH:-}
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 200 python3 -m pytest -q -rs tests/test_kda_fwd_gpu.py tests/test_kda_bwd_gpu.py tests/test_l2norm.py \
    tests/test_nn.py tests/test_cp_cuda.py tests/test_conv_gpu.py tests/test_graph_gpu.py > "$OUT/pytest.log" 2>&1
  stamp "A: tests $(tail -1 "$OUT/pytest.log")"
  timeout 280 python3 -m kda_aot.bench single --pack Q1 --iters 10 --out "$OUT" > "$OUT/single_q1.log" 2>&1
  stamp "A: single Q1 rc $?"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  for tool in memcheck racecheck; do
    timeout 110 compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize_kda.py > "$OUT/sanitizer_$tool.log" 2>&1
    stamp "B: compute-sanitizer $tool exit $? $(tail -1 "$OUT/sanitizer_$tool.log")"
  done
  timeout 120 python3 bench/measure_rho.py --table > "$OUT/rho.log" 2>&1; cp kda_aot/fit_params.json "$OUT/"; stamp "B: rho"
  timeout 60 python3 bench/profile_module.py Q1 32 > "$OUT/profile_module.log" 2>&1; stamp "B: module profile"
  timeout 100 python3 -m kda_aot.bench single --pack Q1 --heads 64 --boundary fwdbwd --iters 5 --out "$OUT" > "$OUT/single_h64.log" 2>&1
  stamp "B: single H=64 rc $?"
) &
wait
grep -E "failed|FAILED|Error" "$OUT/pytest.log" | head -12
grep -E '"ms"|ratio|oom|Error' "$OUT/single_q1.log" | cut -c1-300
cat "$OUT/rho.log" | tail -24
grep -E "B3|kda_|l2norm|conv1d|elementwise|reduce" "$OUT/profile_module.log" | cut -c1-55,100-150 | head -14
grep -E '"ms"|ratio|oom|Error' "$OUT/single_h64.log" | cut -c1-300
timeout 150 python3 -m pytest -q -rs tests/test_cp_nccl_cuda.py > "$OUT/pytest_cp_nccl.log" 2>&1
stamp "cp nccl tests: $(tail -1 "$OUT/pytest_cp_nccl.log")"
grep -E "failed|FAILED|Error" "$OUT/pytest_cp_nccl.log" | head -8
