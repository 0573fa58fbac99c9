#!/usr/bin/env bash
# Device call for the forward walk's products (wgmma shipped; mma.sync: KDA_AOT_WALK_MMA=sync, test-only
# records *_sync): optionally the chunk stage's phases (CHUNK_PROFILE=pack: bench/chunk_profile.py),
# bench/walk_profile.py (cycles per phase of a wgmma step), optionally kernel timelines
# (TIMELINE=pack: bench/timeline_kda.py, forward and replay step), the forward and
# backward tests (FWD_TESTS=1) and the chunk-form A/B (CHUNK_AB=packs), the GPU tests under
# KDA_AOT_WALK_MMA=$WG_MMA (default wgmma) and KDA_AOT_BWD_WALK_MMA=$BWD_MMA (default sync; -x: stop at
# the first failure), the walk step sweep under each forward product kind, then bench/forms_ab.py
# walkmma on WALKMMA_PACKS (default Q1). Logs under $OUT.
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/ 2>/dev/null; fi
KDA_AOT_TEST_RECORDS=1 KDA_AOT_PROGRAMS=${PROGRAMS-kda_fwd_chunk,kda_fwd_tape,kda_bwd_tape,kda_bwd_chunk,kda_bwd_gate,kcp_transfer,l2norm_fwd,l2norm_bwd} \
  python3 setup.py -q build_ext --inplace 2>&1 | tail -5
stamp build
export PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ -n "${PROFILE-1}" ]; then
  for rec in full_prof ${PROFILE_MORE-full_vs_prof}; do
    timeout 60 python3 bench/walk_profile.py --record $rec >> "$OUT/walk_profile.log" 2>&1; stamp "walk profile $rec"
  done
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
if [ -n "${FWD_TESTS-}" ]; then  # the forward and backward GPU tests as shipped (sync walks)
  timeout ${TESTS_S:-150} python3 -m pytest -q -rs tests/test_kda_fwd_gpu.py tests/test_kda_bwd_gpu.py > "$OUT/pytest.log" 2>&1
  stamp "tests: $(tail -1 "$OUT/pytest.log")"; grep -E "^FAILED|Error" "$OUT/pytest.log" | head -20
fi
if [ -n "${CHUNK_AB-}" ]; then
  timeout 120 python3 bench/forms_ab.py chunk "$CHUNK_AB" 32 > "$OUT/forms_ab_chunk.log" 2>&1; stamp "chunk A/B"
  cat "$OUT/forms_ab_chunk.log"
fi
if [ -n "${WG_TESTS-1}" ]; then
  KDA_AOT_WALK_MMA=${WG_MMA:-wgmma} KDA_AOT_BWD_WALK_MMA=${BWD_MMA:-sync} timeout ${TESTS_S:-150} python3 -m pytest -x -q -rs ${TESTS_ARGS:-tests/test_kda_fwd_gpu.py tests/test_kda_bwd_gpu.py} \
    > "$OUT/pytest_wgmma.log" 2>&1
  stamp "tests (forward walk ${WG_MMA:-wgmma}, backward walk ${BWD_MMA:-sync}): $(tail -1 "$OUT/pytest_wgmma.log")"
  grep -E "Error|assert|FAILED" "$OUT/pytest_wgmma.log" | head -20
fi
if [ -n "${SWEEP-1}" ]; then
  for mma in wgmma sync vsplit; do
    KDA_AOT_WALK_MMA=$mma timeout 100 python3 bench/walk_sweep.py > "$OUT/walk_sweep_$mma.log" 2>&1
    stamp "walk sweep $mma"; cat "$OUT/walk_sweep_$mma.log"
  done
fi
if [ -n "${WALKMMA_PACKS-Q1}" ]; then
  timeout ${AB_S:-200} python3 bench/forms_ab.py walkmma "${WALKMMA_PACKS-Q1}" 32 > "$OUT/forms_ab_walkmma.log" 2>&1
  stamp "forms_ab walkmma rc $?"; cat "$OUT/forms_ab_walkmma.log"
fi
