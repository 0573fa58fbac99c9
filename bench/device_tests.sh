#!/usr/bin/env bash
# One device call (nvidia-h200): the in-place build (the test-only records too; carry build/kobj so that only the
# binding units compile there), then the test files given (default: tests/), stopped with SIGINT at TESTS_S
# (default 560 s) from the start so that pytest still prints its summary. Log: $OUT/pytest.log; Triton's cache
# (FLA's kernels, for the next call to carry) as device_env.sh's save_triton_cache leaves it.
#   bash bench/device_tests.sh tests/test_kda_fwd_gpu.py tests/test_kda_bwd_gpu.py
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
trap save_triton_cache EXIT
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/ 2>/dev/null; fi
KDA_AOT_JOBS=16 KDA_AOT_TEST_RECORDS=1 python3 setup.py -q build_ext --inplace 2>&1 | tail -5
echo "built in $(( $(date +%s) - t0 )) s"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
left=$(( ${TESTS_S:-560} - ($(date +%s) - t0) ))
[ "$left" -gt 10 ] || left=10  # (timeout 0 would mean no limit)
timeout -s INT -k 15 "$left" python3 -X faulthandler -m pytest -q -rs --durations=15 "${@:-tests/}" > "$OUT/pytest.log" 2>&1
echo "pytest rc $? after $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/pytest.log")"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30
