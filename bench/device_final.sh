#!/usr/bin/env bash
# Short device call: the L2-norm programs, the split gate form, module and memory checks.
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
KDA_AOT_TEST_RECORDS=1 KDA_AOT_PROGRAMS=kda_fwd_chunk,kda_fwd_tape,kda_bwd_tape,kda_bwd_chunk,kda_bwd_gate,l2norm_fwd,l2norm_bwd,conv1d_silu_fwd,conv1d_silu_bwd python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
stamp build
timeout 60 python3 -m pytest -q -rs tests/test_l2norm.py tests/test_nn.py tests/test_kda_bwd_gpu.py 2>&1 | tee "$OUT/pytest.log" | grep -E "passed|failed|Error|assert" | tail -8; stamp tests
export PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 40 python3 bench/gate_ab.py Q1 32 2>&1 | tail -2; stamp "gate A/B"
timeout 30 python3 bench/profile_module.py Q1 32 > "$OUT/profile_module.log" 2>&1; grep -E "B3|l2norm|kda_|conv1d|elementwise|reduce" "$OUT/profile_module.log" | cut -c1-55,100-150 | head -14; stamp "module profile"
timeout 40 python3 -m kda_aot.bench single --pack Q1 --boundary fwdbwd --no-fla --iters 5 --out "$OUT" 2>&1 | grep -E '"ms"|Error' | cut -c1-330; stamp "single fwdbwd"
