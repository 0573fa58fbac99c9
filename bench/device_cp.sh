#!/usr/bin/env bash
# One device call on nvidia-h200-x2: build, the replay/grouping GPU tests, the CP equality tests with
# the CUDA backend over NCCL, single-device Q1 H = 64, the CP benchmark on Q1. Phases are timed.
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
KDA_AOT_TEST_RECORDS=1 KDA_AOT_PROGRAMS=kda_fwd_chunk,kda_fwd_tape,kda_bwd_tape,kda_bwd_chunk,kda_bwd_gate,kcp_transfer,conv1d_silu_fwd,conv1d_silu_bwd python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
stamp build
timeout 120 python3 -m pytest -q -rs -s tests/test_kda_bwd_gpu.py -k "replay" 2>&1 | tail -3; stamp "replay tests"
timeout 240 python3 -m pytest -q -rs -s tests/test_cp_nccl_cuda.py tests/test_cp_cuda.py 2>&1 | tee "$OUT/pytest_cp_cuda.log" | grep -E "spans (dg|o|dq):|passed|failed|Error" | tail -12; stamp "cp cuda tests"
timeout 100 python3 -m kda_aot.bench single --pack Q1 --heads 64 --boundary fwdbwd --iters 5 ${SINGLE_ARGS:---no-fla} --out "$OUT" > "$OUT/single_h64.log" 2>&1; grep -E '"ms"|ratio|oom|Error' "$OUT/single_h64.log" | cut -c1-300; stamp "single H=64"
timeout 200 torchrun --nproc-per-node 2 -m kda_aot.bench cp --pack ${CP_PACKS:-Q1} --iters 5 --out "$OUT" > "$OUT/cp_bench.log" 2>&1; grep -E '"ms"|Error|error' "$OUT/cp_bench.log" | cut -c1-300 | head -20; stamp "cp bench"
