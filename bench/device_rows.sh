#!/usr/bin/env bash
# Device call for the benchmark rows (nvidia-h200-x2, ends by ROWS_S, default 570 s); rows are written
# as they are measured (a run cut short keeps its rows). Stages, each skipped when its knob is empty:
#   both GPUs: the CP2 benchmark on CP2_PACKS (3 layouts x B1/B3, walk forms auto and full, FLA's CP
#              side by side; FLA's Triton autotuning of its CP kernels takes minutes on a fresh
#              machine, carry .triton_cache.tgz from the last call), CP2_S seconds at most; every
#              rank dumps its Python stack if it is stuck (KDA_AOT_DUMP_AFTER).
#   then side by side:
#     GPU 0: the GPU tests matching TESTS_K (pytest -k), the forms A/B (AB: forms_ab.py's arguments),
#            the GPU tests from TESTS_FROM on (their collection index, 1-based), SINGLE_A (single
#            benchmark, auto and full, FLA interleaved), H64=1: Q1 at H = 64 (H64_ARGS, e.g. --no-fla);
#     GPU 1: SINGLE_B, CP1=1: the CP1 benchmark (contiguous, every pack; CP1_ARGS, e.g. --no-fla).
# NCCL_TESTS=1: tests/test_cp_cuda_ranks.py first (both GPUs).
# EXTRA_A / EXTRA_B: a shell command run first on GPU 0 / GPU 1 (e.g. "python3 bench/walk_sweep.py"; SAN=1:
# compute-sanitizer memcheck + racecheck of bench/sanitize_kda.py on GPU 1 first, test-only forms built).
# Defaults: CP2_PACKS=all CP2_S=340 H64_S=150 SINGLE_B=Q2,Q3,Q4,Q5,Q6 CP1=1 H64=1; SINGLE_A, TESTS_FROM unset;
# CP2_ARGS passes more arguments to the CP2 benchmark (e.g. "--layouts zigzag --no-fla").
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# Every step's timeout is capped by what is left before the deadline, so the call ends in time.
DEADLINE=$(( t0 + ${ROWS_S:-570} ))
cap() { local left=$(( DEADLINE - $(date +%s) - 5 )); [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
CP2_PACKS=${CP2_PACKS-all}; SINGLE_A=${SINGLE_A-}; SINGLE_B=${SINGLE_B-Q2,Q3,Q4,Q5,Q6}
CP1=${CP1-1}; H64=${H64-1}; TESTS_FROM=${TESTS_FROM-}; TESTS_K=${TESTS_K-}; AB=${AB-}
# Logs go to $W, packed into $OUT/logs.tgz at the end ($OUT returns at most 8 files); rows are
# copied out as they are.
W=$(mktemp -d)
finish() {
  for f in "$W"/*/*.jsonl; do [ -f "$f" ] && cp "$f" "$OUT/$(basename "$(dirname "$f")")_$(basename "$f")"; done
  tar czf "$OUT/logs.tgz" -C "$W" .
  save_triton_cache
}
trap finish EXIT
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/ 2>/dev/null; fi
SAN=${SAN-}; EXTRA_A=${EXTRA_A-}; EXTRA_B=${EXTRA_B-}
if [ -n "$TESTS_FROM$TESTS_K$SAN${NCCL_TESTS-}" ]; then export KDA_AOT_TEST_RECORDS=1; fi  # the tests check test-only forms too
KDA_AOT_PROGRAMS=${KDA_AOT_PROGRAMS:-} python3 setup.py -q build_ext --inplace 2>&1 | tail -20 || exit 1
stamp build
export PYTHONPATH=$PWD:${PYTHONPATH:-}
mkdir -p "$W/cp" "$W/single" "$W/h64"
if [ "${NCCL_TESTS-}" = 1 ]; then  # the CP tests over NCCL with the CUDA backend (both GPUs, ~15 s)
  timeout $(cap 90) python3 -m pytest -q -rs tests/test_cp_cuda_ranks.py > "$W/pytest_cp_nccl.log" 2>&1
  stamp "cp nccl tests: $(tail -1 "$W/pytest_cp_nccl.log")"
fi
if [ -n "$CP2_PACKS" ]; then
  KDA_AOT_DUMP_AFTER=$(( ${CP2_S:-340} - 30 )) timeout $(cap ${CP2_S:-340}) torchrun --nproc-per-node 2 -m bench cp \
    --pack "$CP2_PACKS" --iters 5 --walk-forms auto,full --out "$W/cp" ${CP2_ARGS:-} > "$W/cp2.log" 2>&1
  stamp "cp2 rc $?"
fi
(
  export CUDA_VISIBLE_DEVICES=0
  if [ -n "$EXTRA_A" ]; then timeout $(cap 120) bash -c "$EXTRA_A" > "$W/extra_a.log" 2>&1; stamp "A: extra rc $?"; fi
  FILES="tests/test_kda_fwd_gpu.py tests/test_kda_bwd_gpu.py tests/test_l2norm.py tests/test_nn.py tests/test_cp_cuda.py
    tests/test_conv_gpu.py tests/test_graph_gpu.py"
  if [ -n "$TESTS_K" ]; then
    timeout -s INT -k 15 $(cap ${TESTS_S:-150}) python3 -m pytest -q -rs -k "$TESTS_K" $FILES > "$W/pytest.log" 2>&1
    stamp "A: tests -k '$TESTS_K': $(tail -1 "$W/pytest.log")"
  fi
  if [ -n "$AB" ]; then
    timeout $(cap ${AB_S:-120}) python3 bench/forms_ab.py $AB > "$W/forms_ab.log" 2>&1; stamp "A: forms A/B $AB rc $?"
  fi
  if [ -n "$TESTS_FROM" ]; then
    python3 -m pytest --collect-only -q $FILES 2>/dev/null | grep "::" | tail -n +"$TESTS_FROM" > "$W/test_ids.txt"
    timeout -s INT -k 15 $(cap ${TESTS_S:-150}) python3 -m pytest -q -rs --durations=15 $(cat "$W/test_ids.txt") > "$W/pytest.log" 2>&1
    stamp "A: $(wc -l < "$W/test_ids.txt") tests: $(tail -1 "$W/pytest.log")"
  fi
  if [ -n "$SINGLE_A" ]; then
    timeout $(cap 240) python3 -m bench single --pack "$SINGLE_A" --iters 10 --walk-forms auto,full \
      --out "$W/single" > "$W/single_a.log" 2>&1; stamp "A: single $SINGLE_A rc $?"
  fi
  if [ "$H64" = 1 ]; then
    timeout $(cap ${H64_S:-150}) python3 -m bench single --pack Q1 --heads 64 --boundary fwdbwd --iters 3 \
      ${H64_ARGS:-} --out "$W/h64" > "$W/h64.log" 2>&1; stamp "A: single H=64 rc $?"
  fi
) &
(
  export CUDA_VISIBLE_DEVICES=1
  if [ "$SAN" = 1 ]; then
    for tool in memcheck racecheck; do
      timeout $(cap 80) compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize_kda.py > "$W/sanitizer_$tool.log" 2>&1
      stamp "B: compute-sanitizer $tool exit $? $(tail -1 "$W/sanitizer_$tool.log")"
    done
  fi
  if [ -n "$EXTRA_B" ]; then timeout $(cap 120) bash -c "$EXTRA_B" > "$W/extra_b.log" 2>&1; stamp "B: extra rc $?"; fi
  if [ -n "$SINGLE_B" ]; then
    timeout $(cap 300) python3 -m bench single --pack "$SINGLE_B" --iters 5 --walk-forms auto,full \
      --out "$W/single" > "$W/single_b.log" 2>&1; stamp "B: single $SINGLE_B rc $?"
  fi
  if [ "$CP1" = 1 ]; then
    timeout $(cap 150) torchrun --nproc-per-node 1 -m bench cp --pack all --iters 5 --layouts contiguous \
      --walk-forms auto,full ${CP1_ARGS:-} --out "$W/cp" > "$W/cp1.log" 2>&1; stamp "B: cp1 rc $?"
  fi
) &
wait
for f in "$W"/cp/*.jsonl "$W"/single/*.jsonl "$W"/h64/*.jsonl; do [ -f "$f" ] && echo "$f: $(wc -l < "$f") rows"; done
grep -E "^(FAILED|ERROR)" "$W/pytest.log" "$W/pytest_cp_nccl.log" 2>/dev/null | head -12
cat "$W/forms_ab.log" 2>/dev/null | tail -12
cat "$W/extra_a.log" "$W/extra_b.log" 2>/dev/null | tail -30
grep -hE "Timeout|^  File" "$W"/cp2.log 2>/dev/null | grep -v "torch/distributed/elastic\|torchrun\|run.py" | head -20
