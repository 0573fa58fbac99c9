#!/usr/bin/env bash
# One device call for the KDA kernels: build only them, GPU tests, sanitizers, profile, benchmark.
# Extra arguments go to pytest.
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
KDA_AOT_TEST_RECORDS=1 KDA_AOT_PROGRAMS=kda_fwd_chunk,kda_fwd_tape,kda_bwd_tape,kda_bwd_chunk,kda_bwd_gate,kcp_transfer python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
echo "build: $(( $(date +%s) - t0 )) s"
timeout 300 python3 -X faulthandler -m pytest -q -rs -s tests/test_kda_fwd_gpu.py tests/test_kda_bwd_gpu.py tests/test_cp_cuda.py "$@" 2>&1 | tee "$OUT/pytest_kda.log" | grep -E " dg: |M [0-9]|passed|failed|Error|assert" | tail -${KDA_LOG_LINES:-30}
for tool in memcheck racecheck; do
  PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize_kda.py > "$OUT/sanitizer_kda_$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $?"; tail -2 "$OUT/sanitizer_kda_$tool.log"
done
PYTHONPATH=$PWD:${PYTHONPATH:-} python3 bench/profile_kda.py Q1 32 2>&1 | grep -E "kda_|Self CUDA|elementwise|reduce|copy" | cut -c1-60,120-200
python3 -m kda_aot.bench single --pack Q1 --iters 10 --out "$OUT" 2>&1 | grep -E '"ms"|ratio|oom|Error' | cut -c1-400
python3 -m kda_aot.bench single --pack Q1 --heads 64 --boundary fwdbwd --iters 5 --out "$OUT" 2>&1 | grep -E '"ms"|ratio|oom|Error' | cut -c1-400
