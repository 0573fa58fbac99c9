#!/usr/bin/env bash
# Device call 2 of a session (nvidia-h200-x2, ~580 s): the benchmark rows, written as they are
# measured (a run cut short keeps its rows). First both GPUs: the CP2 benchmark on every pack
# (3 layouts x B1/B3, walk forms auto and full, FLA's CP side by side; FLA's Triton autotuning of
# its CP kernels takes minutes on a fresh machine). Then side by side: GPU 0 the CP1 benchmark
# (contiguous) and Q1 at H = 64 with FLA; GPU 1 the single benchmark on Q2-Q6 (auto and full).
# Every rank dumps its Python stack if the CP2 run is stuck (KDA_AOT_DUMP_AFTER).
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# Every step's timeout is capped by what is left before the deadline, so the call ends in time.
DEADLINE=$(( t0 + ${ROWS_S:-570} ))
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
KDA_AOT_PROGRAMS=kda_fwd_chunk,kda_fwd_tape,kda_bwd_tape,kda_bwd_chunk,kda_bwd_gate,kcp_transfer,conv1d_silu_fwd,conv1d_silu_bwd,l2norm_fwd,l2norm_bwd \
  python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
stamp build
mkdir -p "$W/cp" "$W/single" "$W/h64"
KDA_AOT_DUMP_AFTER=$(( ${CP2_S:-340} - 30 )) timeout ${CP2_S:-340} torchrun --nproc-per-node 2 -m kda_aot.bench cp \
  --pack ${CP_PACKS:-all} --iters 5 --walk-forms auto,full --out "$W/cp" > "$W/cp2.log" 2>&1
stamp "cp2 rc $?"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout $(cap 120) torchrun --nproc-per-node 1 -m kda_aot.bench cp --pack all --iters 5 --layouts contiguous \
    --walk-forms auto,full --out "$W/cp" > "$W/cp1.log" 2>&1; stamp "A: cp1 rc $?"
  timeout $(cap 90) python3 -m kda_aot.bench single --pack Q1 --heads 64 --boundary fwdbwd --iters 3 \
    --out "$W/h64" > "$W/h64.log" 2>&1; stamp "A: single H=64 rc $?"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout $(cap 210) python3 -m kda_aot.bench single --pack Q2,Q3,Q4,Q5,Q6 --iters 5 --walk-forms auto,full \
    --out "$W/single" > "$W/single.log" 2>&1; stamp "B: single Q2-Q6 rc $?"
) &
wait
for f in "$W"/cp/*.jsonl "$W"/single/*.jsonl; do [ -f "$f" ] && echo "$f: $(wc -l < "$f") rows"; done
grep -hE "Timeout|^  File" "$W"/cp2.log | grep -v "torch/distributed/elastic\|torchrun\|run.py" | head -20
