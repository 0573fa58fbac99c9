#!/usr/bin/env bash
# One device call (nvidia-h200): the op layer as training code calls it, then the GPU test files.
#   1. build in place (test records too; carry build/obj to skip the kernel units' compile)
#   2. tests/test_ops_gpu.py (opcheck, compile / reduce-overhead bitwise, losses, views, padding)
#   3. bench/compile_step.py: a Q1 B3 step eager vs compiled vs reduce-overhead (rows into $OUT)
#   4. SINGLE=Q1[,..]: the single benchmark on those packs beside FLA (carry .whl; rows into $OUT)
#   5. FLA_LAYER=Q1: bench/fla_layer.py, FLA's KimiDeltaAttention step beside kda_aot as its backend
#   6. the other single-GPU test files, as far as the deadline allows
# Env: OPS_S (deadline, default 560 s), COMPILE_HEADS (default 32; 0: no compile step), SINGLE, FLA_LAYER,
# TESTS (the files of step 6). Triton's cache comes back as in device_env.sh (save_triton_cache).
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
DEADLINE=$(( t0 + ${OPS_S:-560} ))
cap() { local left=$(( DEADLINE - $(date +%s) - 5 )); [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
W=$(mktemp -d)
finish() { cp "$W"/*.jsonl "$OUT"/ 2>/dev/null; tar czf "$OUT/logs.tgz" -C "$W" .; save_triton_cache; }
trap finish EXIT
KDA_AOT_TEST_RECORDS=1 KDA_AOT_JOBS=16 python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
stamp build
export PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout -s INT -k 15 $(cap 200) python3 -X faulthandler -m pytest -q -rs -x --durations=10 tests/test_ops_gpu.py \
  > "$W/pytest_ops.log" 2>&1
stamp "ops tests: $(tail -1 "$W/pytest_ops.log")"
grep -E "^(FAILED|ERROR)|Error|assert" "$W/pytest_ops.log" | head -20
if [ "${COMPILE_HEADS:-32}" != 0 ]; then
  timeout $(cap 200) python3 bench/compile_step.py --heads "${COMPILE_HEADS:-32}" --out "$W" > "$W/compile.log" 2>&1
  stamp "compile step rc $?"; tail -6 "$W/compile.log"
fi
if [ -n "${SINGLE:-}" ]; then
  timeout $(cap 300) python3 -m bench single --pack "$SINGLE" --iters 10 --out "$W" > "$W/single.log" 2>&1
  stamp "single $SINGLE rc $?"; grep -E '"arm"' "$W/single.log" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r['pack'], r['boundary'], r.get('mode', ''), r['arm'], r.get('walk_form', ''), r.get('ms', r.get('ratio')))"
fi
if [ -n "${FLA_LAYER:-}" ]; then  # FLA's layer step beside FLA (flash-linear-attention and einops wheels in .whl)
  timeout $(cap 240) python3 -m bench.fla_layer --pack "${FLA_LAYER}" --iters 10 --out "$W" > "$W/fla_layer.log" 2>&1
  stamp "fla_layer $FLA_LAYER rc $?"; tail -8 "$W/fla_layer.log"
fi
timeout -s INT -k 15 $(cap 400) python3 -X faulthandler -m pytest -q -rs --durations=10 \
  ${TESTS:-tests/test_kda_fwd_gpu.py tests/test_graph_gpu.py tests/test_nn.py tests/test_l2norm.py tests/test_conv_gpu.py tests/test_kda_bwd_gpu.py tests/test_cp_cuda.py tests/test_fla_signature_gpu.py tests/test_kda_numerics_gpu.py tests/test_pipeline_streams.py} \
  > "$W/pytest.log" 2>&1
stamp "tests: $(tail -1 "$W/pytest.log")"
grep -E "^(FAILED|ERROR)" "$W/pytest.log" | head -20
