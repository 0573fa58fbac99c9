#!/usr/bin/env bash
# One device call (nvidia-h200, < 600 s): build (kernel objects carried in build/kobj when present:
# compiled off-device by nvcc, keyed by record hash), the GPU tests of every KDA record (shipped and
# test-only), the gate A/B, the per-kernel profile, the single benchmark on Q1.
# Second call: bench/device_next2.sh (sanitizers, rho table, module profile, ncu).
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/; fi
KDA_AOT_TEST_RECORDS=1 python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
stamp build
timeout 230 python3 -X faulthandler -m pytest -q -x -rs tests/test_kda_fwd_gpu.py tests/test_kda_bwd_gpu.py \
  tests/test_l2norm.py tests/test_nn.py tests/test_cp_cuda.py tests/test_conv_gpu.py tests/test_graph_gpu.py "$@" 2>&1 \
  | tee "$OUT/pytest.log" | grep -E "passed|failed|Error|assert" | tail -12; stamp tests
export PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 60 python3 bench/gate_ab.py Q1 32 2>&1 | tail -1; stamp "gate A/B"
timeout 50 python3 bench/profile_kda.py Q1 32 2>&1 | grep -E "kda_|Self CUDA" | cut -c1-60,120-200; stamp profile
timeout 180 python3 -m kda_aot.bench single --pack Q1 --iters 10 --out "$OUT" 2>&1 | grep -E '"ms"|ratio|oom|Error' | cut -c1-330; stamp single
