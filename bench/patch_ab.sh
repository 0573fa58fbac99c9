#!/usr/bin/env bash
# One device call (nvidia-h200) that checks a kernel patch against the tree it applies to:
#   A = this checkout as it is (built in place; carry build/kobj), B = a copy with PATCH applied, re-rendered
#   and built from scratch (16 cores: ~20 s). Steps (STEPS, in order, each capped by what is left of CHECK_S):
#     tests     the GPU test files TESTS on B
#     sanitize  compute-sanitizer memcheck and racecheck of bench/sanitize_kda.py on B
#     timing    Q1, H = 32 forward and replay step, kda_aot alone, A B A B (separate processes): the patch's cost
#     numerics  bench/numerics.py on B (NUMERICS_ARGS; FLA beside when .whl carries it), rows into $OUT
#     cmd       AB_CMD (a command line run from a tree's root, e.g. "python3 bench/profile_kda.py Q1 32
#               fla_layer") in A B A B, each capped by CMD_S (default 60 s), logs cmd_{A,B}_{1,2}.log
# Logs and rows come back under $OUT (logs.tgz, *.jsonl), with Triton's cache (device_env.sh).
# Usage: PATCH=docs/wip/x.patch STEPS="tests sanitize timing" TESTS="tests/..." bash bench/patch_ab.sh
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
DEADLINE=$(( t0 + ${CHECK_S:-560} ))
cap() { local left=$(( DEADLINE - $(date +%s) - 5 )); [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
: "${PATCH:?PATCH=path of the patch to check}"
W=$(mktemp -d)
finish() { cp "$W"/*.jsonl "$OUT"/ 2>/dev/null; tar czf "$OUT/logs.tgz" -C "$W" .; save_triton_cache; }
trap finish EXIT
A=$PWD
B=/tmp/patch_ab_B
rm -rf "$B" && mkdir -p "$B"
tar cf - --exclude=./build --exclude=./.whl --exclude='./kda_aot/_lib/*.so' . | tar xf - -C "$B"
(cd "$B" && git apply "$A/$PATCH" && python3 -m codegen render) > "$W/patch.log" 2>&1 || { cat "$W/patch.log"; exit 1; }
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/ 2>/dev/null; fi
for tree in "$A" "$B"; do
  (cd "$tree" && KDA_AOT_TEST_RECORDS=1 KDA_AOT_JOBS=16 python3 setup.py -q build_ext --inplace) \
    > "$W/build_$(basename "$tree").log" 2>&1 || { tail -30 "$W/build_$(basename "$tree").log"; exit 1; }
done
stamp "built A ($A) and B ($B, $PATCH applied)"
for step in ${STEPS:-tests sanitize timing}; do
  case $step in
    tests)
      timeout -s INT -k 15 "$(cap ${TESTS_S:-200})" bash -c "cd $B && PYTHONPATH=$B:\${PYTHONPATH:-} python3 -m pytest \
        -q -rs ${TESTS:-tests/test_kda_fwd_gpu.py tests/test_kda_numerics_gpu.py tests/test_kda_bwd_gpu.py}" \
        > "$W/pytest_B.log" 2>&1
      stamp "tests B: $(tail -1 "$W/pytest_B.log")"; grep -E "^(FAILED|ERROR)" "$W/pytest_B.log" | head -20 ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout -s INT -k 10 "$(cap 150)" bash -c "cd $B && PYTHONPATH=$B:\${PYTHONPATH:-} compute-sanitizer \
          --tool $tool --error-exitcode 9 python3 bench/sanitize_kda.py" > "$W/sanitizer_$tool.log" 2>&1
        stamp "compute-sanitizer $tool on B: exit $? $(tail -1 "$W/sanitizer_$tool.log")"
      done ;;
    timing)
      for round in 1 2; do
        for tree in "$A" "$B"; do
          name=$(basename "$tree")
          timeout -s INT -k 10 "$(cap 90)" bash -c "cd $tree && PYTHONPATH=$tree:\${PYTHONPATH:-} python3 \
            bench/numerics.py --timing --only-timing --no-fla --out $W/timing_${name}_$round" \
            > "$W/timing_${name}_$round.log" 2>&1
          stamp "timing $([ "$tree" = "$A" ] && echo A || echo B) round $round: $(grep '^timing' \
            "$W/timing_${name}_$round.log" | tr '\n' ' ')"
        done
      done ;;
    cmd)
      for round in 1 2; do
        for tree in "$A" "$B"; do
          arm=$([ "$tree" = "$A" ] && echo A || echo B)
          timeout -s INT -k 10 "$(cap ${CMD_S:-60})" bash -c "cd $tree && PYTHONPATH=$tree:\${PYTHONPATH:-} $AB_CMD" \
            > "$W/cmd_${arm}_$round.log" 2>&1
          stamp "cmd $arm round $round: rc $?"
        done
      done ;;
    numerics)
      timeout -s INT -k 10 "$(cap ${NUMERICS_S:-300})" bash -c "cd $B && PYTHONPATH=$B:\${PYTHONPATH:-} python3 \
        bench/numerics.py --out $W ${NUMERICS_ARGS:-}" > "$W/numerics_B.log" 2>&1
      stamp "numerics B: $(tail -3 "$W/numerics_B.log" | tr '\n' ' ')" ;;
  esac
done
