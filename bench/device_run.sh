#!/usr/bin/env bash
# One device call: install carried wheels, build (shipped + test-only records), GPU tests,
# compute-sanitizer, the conv benchmark; logs and result rows under $OUT.
# Usage on the device: bash bench/device_run.sh [pytest args...]
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -2;
  python3 -c "import torch; print('torch', torch.__version__)"; } 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
KDA_AOT_TEST_RECORDS=1 python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
echo "build: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.txt"
python3 setup.py -q build --build-base /tmp/wheel_build bdist_wheel -d /tmp/wheel 2>&1 | tail -5
ls /tmp/wheel | tee -a "$OUT/env.txt"
python3 -c "import torch, kda_aot; kda_aot.registry.library('conv1d_silu_fwd'); print(''.join(sorted({l.split()[-1] + chr(10) for l in open('/proc/self/maps') if 'libstdc++' in l})))" | tee -a "$OUT/env.txt"
python3 -X faulthandler -m pytest -v -rs tests/test_conv_input.py 2>&1 | tee "$OUT/pytest_input.log" | grep -E "FAIL|Error|passed|failed|Fatal" | head -20
python3 -X faulthandler -m pytest -q -rs tests --ignore=tests/test_conv_input.py "$@" 2>&1 | tee "$OUT/pytest.log" | tail -25
for tool in memcheck racecheck; do
  PYTHONPATH=$PWD:${PYTHONPATH:-} compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize_conv.py > "$OUT/sanitizer_$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors\|RACECHECK SUMMARY: 0 hazards' "$OUT/sanitizer_$tool.log") clean summaries)"
  tail -3 "$OUT/sanitizer_$tool.log"
done
python3 -m kda_aot.bench conv --out "$OUT" 2>&1 | tail -12
python3 -m kda_aot.bench single --pack Q1 --iters 10 --out "$OUT" 2>&1 | tail -6
