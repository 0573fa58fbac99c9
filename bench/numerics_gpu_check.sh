#!/usr/bin/env bash
# Device call for the numerics work (issue 21), one call on nvidia-h200 (ends by CHECK_S, default 560 s):
#   1. build in place (shipped and test-only records; with build/kobj carried only the bindings compile)
#   2. bench/numerics.py: kda_aot and FLA 0.6.0 (from the carried .whl, when there) against the fp64
#      reference on every case of issue 21 -> $OUT/numerics.jsonl, the table in numerics_N.log
#   3. the affected GPU tests: tests/test_kda_numerics_gpu.py (every gate value), test_kda_bwd_gpu.py,
#      test_kda_fwd_gpu.py, test_cp_cuda.py (kcp_transfer, the summaries) -> pytest_numerics.log
#   4. Q1, H = 32 timings of kda_aot and FLA (forward, replay step), if time is left -> numerics.jsonl
#   5. (STEPS=forms) bench/forms_ab.py gate Q1 32: the kda_bwd_gate forms
#   (STEPS=profile) bench/profile_kda.py Q1 32, per-kernel times; (STEPS=sanitize) compute-sanitizer memcheck
#   and racecheck of bench/sanitize_kda.py (strong gates and resets included)
# Steps run in that order, each capped by what is left. STEPS (default "numerics tests timing") picks;
# TIMING_S caps the timing step (default 120 s); TESTS overrides step 3's files (TESTS_S its cap, default 240 s), NUMERICS_S step 2's cap (default 300 s), NUMERICS_ARGS its arguments
# (e.g. --init-only, --cases H4/const-8/beta2 --draws 8; runs separated by '|' go one after another, rows
# appended). Rows come back as $OUT/numerics.jsonl, logs packed in $OUT/logs.tgz ($OUT returns 8 files).
# Here first: `python3 -m codegen render && python3 bench/kernel_objects.py`, then carry .whl, build/kobj
# (and .triton_autotune.tgz when there: FLA's autotuning otherwise takes minutes of a fresh machine).
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
DEADLINE=$(( t0 + ${CHECK_S:-560} ))
cap() { local left=$(( DEADLINE - $(date +%s) - 5 )); [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
STEPS=${STEPS:-numerics tests timing}
L=$(mktemp -d)
trap 'tar czf "$OUT/logs.tgz" -C "$L" .; save_triton_cache' EXIT
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/ 2>/dev/null; fi
KDA_AOT_TEST_RECORDS=1 KDA_AOT_JOBS=16 python3 setup.py -q build_ext --inplace > "$L/build.log" 2>&1 || { tail -30 "$L/build.log"; exit 1; }
stamp build
export PYTHONPATH=$PWD:${PYTHONPATH:-}
python3 -c "import fla; print('fla', fla.__version__)" 2>/dev/null || echo "fla not installed: kda_aot rows only"
for step in $STEPS; do
  case $step in
    numerics)
      IFS='|' read -ra runs <<< "${NUMERICS_ARGS:-}"; [ ${#runs[@]} -eq 0 ] && runs=("")
      for i in "${!runs[@]}"; do
        timeout -s INT -k 10 "$(cap ${NUMERICS_S:-300})" python3 bench/numerics.py --out "$OUT" ${runs[$i]} \
          > "$L/numerics_$i.log" 2>&1
        stamp "numerics ${runs[$i]}: $(tail -3 "$L/numerics_$i.log" | tr '\n' ' ')"
      done ;;
    tests)
      timeout -s INT -k 15 "$(cap ${TESTS_S:-240})" python3 -m pytest -q -rs ${TESTS:-tests/test_kda_numerics_gpu.py tests/test_kda_bwd_gpu.py \
        tests/test_kda_fwd_gpu.py tests/test_cp_cuda.py} > "$L/pytest_numerics.log" 2>&1
      stamp "tests: $(tail -1 "$L/pytest_numerics.log"; grep -E "^(FAILED|ERROR)" "$L/pytest_numerics.log" | head -20)" ;;
    forms)
      timeout -s INT -k 10 "$(cap 180)" python3 bench/forms_ab.py gate Q1 32 > "$L/forms_gate.log" 2>&1
      stamp "forms: $(tail -2 "$L/forms_gate.log" | tr '\n' ' ')" ;;
    profile)
      timeout -s INT -k 10 "$(cap 90)" python3 bench/profile_kda.py Q1 32 > "$L/profile.log" 2>&1
      stamp "profile: $(grep -E 'kda_bwd_gate|kda_bwd_chunk|kda_fwd_chunk' "$L/profile.log" | head -4 | tr -s ' ' | tr '\n' ';')" ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout -s INT -k 10 "$(cap 120)" compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize_kda.py \
          > "$L/sanitizer_$tool.log" 2>&1
        stamp "compute-sanitizer $tool exit $? $(tail -1 "$L/sanitizer_$tool.log")"
      done ;;
    timing)
      timeout -s INT -k 10 "$(cap ${TIMING_S:-120})" python3 bench/numerics.py --out "$OUT" --timing --only-timing > "$L/timing.log" 2>&1
      stamp "timing: $(grep '^timing' "$L/timing.log" | tr '\n' ' ')" ;;
  esac
done
