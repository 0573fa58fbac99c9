#!/usr/bin/env bash
# One call on nvidia-h200-x2 (< 560 s): the committed rows. First both GPUs: the CP2 benchmark on
# every pack (3 layouts x B1/B3, walk forms auto and full, FLA's CP side by side; rows written layout
# by layout). Then side by side: GPU 0 the CP1 benchmark (contiguous, every pack) and Q1 at H = 64
# with FLA; GPU 1 the single benchmark on every pack (auto and full, FLA interleaved).
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/ 2>/dev/null; fi
KDA_AOT_TEST_RECORDS=1 python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
stamp build
mkdir -p "$OUT/cp" "$OUT/single"
timeout ${CP2_S:-280} torchrun --nproc-per-node 2 -m kda_aot.bench cp --pack ${CP_PACKS:-all} --iters 5 \
  --walk-forms auto,full --out "$OUT/cp" > "$OUT/cp2.log" 2>&1; stamp "cp2 rc $?"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 110 torchrun --nproc-per-node 1 -m kda_aot.bench cp --pack all --iters 5 --layouts contiguous \
    --walk-forms auto,full --out "$OUT/cp" > "$OUT/cp1.log" 2>&1; stamp "A: cp1 rc $?"
  timeout 120 python3 -m kda_aot.bench single --pack Q1 --heads 64 --boundary fwdbwd --iters 3 \
    --out "$OUT/cp" > "$OUT/h64.log" 2>&1; stamp "A: single H=64 rc $?"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 235 python3 -m kda_aot.bench single --pack all --iters 5 --walk-forms auto,full --out "$OUT/single" \
    > "$OUT/single.log" 2>&1; stamp "B: single all rc $?"
) &
wait
for f in "$OUT"/cp/*.jsonl "$OUT"/single/*.jsonl; do echo "$f: $(wc -l < "$f") rows"; done
grep -E "Error|error" "$OUT"/*.log | grep -v "^.*Warning" | head -8
