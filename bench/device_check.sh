#!/usr/bin/env bash
# Device call 1 of a session (nvidia-h200-x2, ends by 560 s): checks and diagnostics.
#   both:  the CP tests over NCCL with the CUDA backend (first: ~15 s)
#   GPU 0: the single-GPU test files but the backward's, then the single benchmark on Q1 (walk forms
#          auto and full, FLA interleaved; FLA's Triton autotuning takes ~2 min of it on a fresh
#          machine unless .triton_autotune.tgz is carried)
#   GPU 1: compute-sanitizer memcheck + racecheck, the fit rule's rho table (a fresh fit_params.json
#          comes back in $OUT; the committed one stays in place for GPU 0), the module profile,
#          the forms A/B (bench/forms_ab.py all), Nsight Compute on the KDA kernels, then the backward's
#          GPU tests (tests/test_kda_bwd_gpu.py).
# Here first: `python3 -m codegen render && python3 bench/kernel_objects.py`, then carry .whl and
# build/kobj (the device then compiles only the binding units).
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# Every step's timeout is capped by what is left before the deadline, so the call ends in time.
DEADLINE=$(( t0 + ${CHECK_S:-560} ))
cap() { local left=$(( DEADLINE - $(date +%s) - 5 )); [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
# Logs go to $W, packed into $OUT/logs.tgz at the end ($OUT returns at most 8 files); rows and
# fit_params.json are copied out as they are.
W=$(mktemp -d)
finish() {
  cp "$W"/*.jsonl "$W"/fit_params.json "$OUT"/ 2>/dev/null
  for f in "$W"/*/*.jsonl; do [ -f "$f" ] && cp "$f" "$OUT/$(basename "$(dirname "$f")")_$(basename "$f")"; done
  tar czf "$OUT/logs.tgz" -C "$W" .
  save_triton_cache
}
trap finish EXIT
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/ 2>/dev/null; fi
KDA_AOT_TEST_RECORDS=1 python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
stamp build
export PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout $(cap 120) python3 -m pytest -q -rs tests/test_cp_cuda_ranks.py > "$W/pytest_cp_nccl.log" 2>&1
stamp "cp nccl tests: $(tail -1 "$W/pytest_cp_nccl.log")"
(
  export CUDA_VISIBLE_DEVICES=0
  # SIGINT at the cap: pytest still prints its summary (which test ran, the slowest ones)
  timeout -s INT -k 15 $(cap 330) python3 -X faulthandler -m pytest -q -rs --durations=15 tests/test_kda_fwd_gpu.py \
    tests/test_l2norm.py tests/test_nn.py tests/test_cp_cuda.py tests/test_conv_gpu.py tests/test_graph_gpu.py \
    > "$W/pytest.log" 2>&1
  stamp "A: tests: $(tail -1 "$W/pytest.log")"
  timeout $(cap 290) python3 -m bench single --pack Q1 --iters 10 --walk-forms auto,full --out "$W" \
    > "$W/single.log" 2>&1
  stamp "A: single Q1 rc $?"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  for tool in memcheck racecheck; do
    timeout $(cap 80) compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize_kda.py > "$W/sanitizer_$tool.log" 2>&1
    stamp "B: compute-sanitizer $tool exit $? $(tail -1 "$W/sanitizer_$tool.log")"
  done
  timeout $(cap 45) python3 bench/measure_rho.py --table --out "$W/fit_params.json" > "$W/rho.log" 2>&1
  stamp "B: rho rc $?"
  timeout $(cap 45) python3 bench/profile_module.py Q1 32 > "$W/profile_module.log" 2>&1; stamp "B: module profile"
  timeout $(cap 150) python3 bench/forms_ab.py all Q1 32 > "$W/forms_ab.log" 2>&1; stamp "B: forms A/B rc $?"
  tail -2 "$W/forms_ab.log"
  NCU_S=27 NCU_NO_BUILD=1 NCU_DIR="$W" timeout $(cap 260) bash bench/ncu_kda.sh > "$W/ncu.log" 2>&1
  stamp "B: ncu rc $?"
  timeout -s INT -k 15 $(cap 250) python3 -X faulthandler -m pytest -q -rs --durations=15 tests/test_kda_bwd_gpu.py \
    > "$W/pytest_bwd.log" 2>&1
  stamp "B: backward tests: $(tail -1 "$W/pytest_bwd.log")"
) &
wait
grep -E "^(FAILED|ERROR)|Error" "$W/pytest.log" "$W/pytest_bwd.log" "$W/pytest_cp_nccl.log" | head -12
grep -E '"ms"|ratio|oom|Error' "$W/single.log" | cut -c1-260
tail -14 "$W/rho.log"
grep -E "B3|kda_|l2norm|conv1d|elementwise" "$W/profile_module.log" | cut -c1-55,100-150 | head -12
cat "$W/ncu.log"
