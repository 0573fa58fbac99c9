#!/usr/bin/env bash
# Device call for the kernels' inner loops: optionally the chunk stage's phases (CHUNK_PROFILE=pack:
# bench/chunk_profile.py), bench/walk_profile.py (cycles per phase of a walk step; PROFILE= skips),
# kernel timelines (TIMELINE=pack: bench/timeline_kda.py, forward and replay step), the forward and
# backward GPU tests (FWD_TESTS=1, TESTS_ARGS to choose files), the chunk-form A/B (CHUNK_AB=packs),
# the walk step sweep (SWEEP=1) and the rho measurement (RHO=1: bench/measure_rho.py, writes the GPU's
# table kda_aot/schedule/fit_params/<gpu>.json, e.g. nvidia_h200.json, copied to $OUT). Logs under $OUT.
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/ 2>/dev/null; fi
KDA_AOT_TEST_RECORDS=1 KDA_AOT_PROGRAMS=${PROGRAMS-kda_fwd_chunk,kda_fwd_walk,kda_bwd_walk,kda_bwd_chunk,kda_bwd_gate,kcp_transfer,l2norm_fwd,l2norm_bwd} \
  python3 setup.py -q build_ext --inplace 2>&1 | tail -5
stamp build
export PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ -n "${PROFILE-1}" ]; then
  timeout 60 python3 bench/walk_profile.py > "$OUT/walk_profile.log" 2>&1; stamp "walk profile"
  cat "$OUT/walk_profile.log"
fi
if [ -n "${CHUNK_PROFILE-}" ]; then  # cycles per phase of the chunk stage (pack $CHUNK_PROFILE, H = 32)
  timeout 60 python3 bench/chunk_profile.py "$CHUNK_PROFILE" 32 > "$OUT/chunk_profile.log" 2>&1; stamp "chunk profile"
  cat "$OUT/chunk_profile.log"
fi
if [ -n "${TIMELINE-}" ]; then  # kernel timelines of one call (pack $TIMELINE, H = 32): forward, replay step
  for mode in forward replay; do
    timeout 90 python3 bench/timeline_kda.py "$TIMELINE" 32 $mode --json "$OUT/timeline_$mode.json" \
      > "$OUT/timeline_$mode.log" 2>&1; stamp "timeline $mode"; grep -v "^| [0-9]" "$OUT/timeline_$mode.log" | tail -4
  done
fi
if [ -n "${FWD_TESTS-}" ]; then
  timeout ${TESTS_S:-150} python3 -m pytest -q -rs ${TESTS_ARGS:-tests/test_kda_fwd_gpu.py tests/test_kda_bwd_gpu.py} > "$OUT/pytest.log" 2>&1
  stamp "tests: $(tail -1 "$OUT/pytest.log")"; grep -E "^FAILED|Error" "$OUT/pytest.log" | head -20
fi
if [ -n "${CHUNK_AB-}" ]; then
  timeout 120 python3 bench/forms_ab.py chunk "$CHUNK_AB" 32 > "$OUT/forms_ab_chunk.log" 2>&1; stamp "chunk A/B"
  cat "$OUT/forms_ab_chunk.log"
fi
if [ -n "${SWEEP-}" ]; then
  timeout 100 python3 bench/walk_sweep.py > "$OUT/walk_sweep.log" 2>&1; stamp "walk sweep"; cat "$OUT/walk_sweep.log"
fi
if [ -n "${RHO-}" ]; then
  timeout ${RHO_S:-200} python3 bench/measure_rho.py > "$OUT/measure_rho.log" 2>&1; stamp "rho"
  cat "$OUT/measure_rho.log"; cp kda_aot/schedule/fit_params/*.json "$OUT/"
fi
