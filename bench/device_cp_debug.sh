#!/usr/bin/env bash
# nvidia-h200-x2: the CP2 benchmark on Q1 (contiguous) with forced full walks, then with auto; every
# rank dumps its Python stack if a run is stuck (KDA_AOT_DUMP_AFTER).
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/ 2>/dev/null; fi
KDA_AOT_PROGRAMS=kda_fwd_chunk,kda_fwd_tape,kda_bwd_tape,kda_bwd_chunk,kda_bwd_gate,kcp_transfer,conv1d_silu_fwd,conv1d_silu_bwd,l2norm_fwd,l2norm_bwd \
  python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
stamp build
for wf in ${WALK_FORMS:-full auto}; do
  KDA_AOT_DUMP_AFTER=${DUMP_S:-100} timeout 125 torchrun --nproc-per-node 2 -m kda_aot.bench cp --pack Q1 --iters 5 \
    --layouts contiguous --walk-forms $wf --out "$OUT" > "$OUT/cp2_$wf.log" 2>&1; stamp "cp2 $wf rc $?"
  grep -E '"ms"' "$OUT/cp2_$wf.log" | cut -c1-200
  grep -E "^  File|Thread|Timeout" "$OUT/cp2_$wf.log" | grep -v "torch/distributed/elastic\|torchrun\|run.py" | head -30
done
