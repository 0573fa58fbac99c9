#!/usr/bin/env bash
# Device call (nvidia-h200-x2): the CP step's kernel timeline per rank (bench/timeline_cp.py) for each
# "W layout arm" of TL_RUNS (default: CP2 contiguous and zigzag in the default order, CP1 without a plan),
# pack TL_PACK (Q1). JSON per rank under $OUT/tl<W>/; each run prints its ranks' summaries.
source "$(dirname "$0")/device_env.sh"
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/ 2>/dev/null; fi
python3 setup.py -q build_ext --inplace 2>&1 | tail -3
export PYTHONPATH=$PWD:${PYTHONPATH:-}
IFS=';' read -ra RUNS <<< "${TL_RUNS:-2 contiguous pipelined;2 zigzag pipelined;1 contiguous no_plan}"
for run in "${RUNS[@]}"; do
  set -- $run
  timeout 120 torchrun --nproc-per-node "$1" bench/timeline_cp.py "${TL_PACK:-Q1}" "$2" "$3" --out "$OUT/tl$1" 2>&1 \
    | grep -E "^rank|^  " | grep -v "return func\|_warn_once"
done
