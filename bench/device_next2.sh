#!/usr/bin/env bash
# Second device call (nvidia-h200, < 600 s): sanitizers on the KDA records, the fit rule's rho for
# both walks with the per-walk table (writes kda_aot/fit_params.json into $OUT), the module profile.
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/; fi
KDA_AOT_TEST_RECORDS=1 python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
stamp build
export PYTHONPATH=$PWD:${PYTHONPATH:-}
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize_kda.py > "$OUT/sanitizer_kda_$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $?"; tail -2 "$OUT/sanitizer_kda_$tool.log"
done; stamp sanitizers
timeout 120 python3 bench/measure_rho.py --table 2>&1 | tail -24; cp kda_aot/fit_params.json "$OUT/"; stamp rho
timeout 60 python3 bench/profile_module.py Q1 32 > "$OUT/profile_module.log" 2>&1; grep -E "B3|kda_|l2norm|conv1d|elementwise|reduce" "$OUT/profile_module.log" | cut -c1-55,100-150 | head -14; stamp module
