#!/usr/bin/env bash
# One device call (nvidia-h200) that checks a kernel patch against the tree it applies to:
#   A = this checkout as it is (built in place; carry build/kobj), B = a copy with PATCH applied, re-rendered
#   and built from scratch (16 cores: ~20 s). Steps (STEPS, in order, each capped by what is left of CHECK_S):
#     tests     the GPU test files TESTS on B
#     sanitize  compute-sanitizer memcheck, initcheck and racecheck of bench/sanitize_kda.py on B
#     timing    Q1, H = 32 forward and replay step, kda_aot alone, A B A B (separate processes): the patch's cost
#     numerics  bench/numerics.py on B (NUMERICS_ARGS; FLA beside when .whl carries it), rows into $OUT
#     cmd       AB_CMD (a command line run from a tree's root, e.g. "python3 bench/profile_kda.py Q1 32
#               fla_layer") in A B A B, each capped by CMD_S (default 60 s), logs cmd_{A,B}_{1,2}.log
#     bcmd      AB_CMD on B alone (when the command carries its own baseline), log cmd_B.log
#     bits      bench/bits.py's fixed-seed calls saved in A and in B and compared: a change that claims every
#               output bitwise unchanged (log bits.log)
# Logs and rows come back under $OUT (logs.tgz, *.jsonl), with Triton's cache (device_env.sh).
# Usage: PATCH=docs/wip/x.patch STEPS="tests sanitize timing" TESTS="tests/..." bash bench/patch_ab.sh
# (PATCH="a.patch b.patch": B has each applied, in that order)
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
DEADLINE=$(( t0 + ${CHECK_S:-560} ))
cap() { local left=$(( DEADLINE - $(date +%s) - 5 )); [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
: "${PATCH:?PATCH=path of the patch (or paths, space-separated) to check}"
W=$(mktemp -d)
finish() { cp "$W"/*.jsonl "$OUT"/ 2>/dev/null; tar czf "$OUT/logs.tgz" -C "$W" .; save_triton_cache; }
trap finish EXIT
A=$PWD
B=/tmp/patch_ab_B
rm -rf "$B" && mkdir -p "$B"
tar cf - --exclude=./build --exclude=./.whl --exclude='./kda_aot/_lib/*.so' . | tar xf - -C "$B"
(cd "$B" && for p in $PATCH; do git apply "$A/$p" || exit 1; done && python3 -m codegen render) > "$W/patch.log" 2>&1 || { cat "$W/patch.log"; exit 1; }
if [ -d build/kobj ]; then mkdir -p build/obj && cp -n build/kobj/*.o build/obj/ 2>/dev/null; fi
for tree in "$A" "$B"; do
  (cd "$tree" && KDA_AOT_TEST_RECORDS=1 KDA_AOT_JOBS=16 python3 setup.py -q build_ext --inplace) \
    > "$W/build_$(basename "$tree").log" 2>&1 || { tail -30 "$W/build_$(basename "$tree").log"; exit 1; }
done
stamp "built A ($A) and B ($B, $PATCH applied)"
# in_tree DIR SECONDS LOG COMMAND: COMMAND from DIR's root, DIR's package first on the path, capped.
in_tree() {
  timeout -s INT -k 10 "$(cap "$2")" bash -c "cd $1 && export PYTHONPATH=$1:\${PYTHONPATH:-} && $4" > "$3" 2>&1
}
# ab NAME SECONDS COMMAND: COMMAND in A, B, A, B (ARM and ROUND exported to it), logs NAME_ARM_ROUND.log.
ab() {
  for ROUND in 1 2; do
    for ARM in A B; do
      export ARM ROUND
      in_tree "$([ "$ARM" = A ] && echo "$A" || echo "$B")" "$2" "$W/$1_${ARM}_$ROUND.log" "$3"
      stamp "$1 $ARM round $ROUND: rc $? $(grep '^timing' "$W/$1_${ARM}_$ROUND.log" | tr '\n' ' ')"
    done
  done
}
for step in ${STEPS:-tests sanitize timing}; do
  case $step in
    tests)
      in_tree "$B" "${TESTS_S:-200}" "$W/pytest_B.log" \
        "python3 -m pytest -q -rs ${TESTS:-tests/test_kda_fwd_gpu.py tests/test_kda_numerics_gpu.py tests/test_kda_bwd_gpu.py}"
      stamp "tests B: $(tail -1 "$W/pytest_B.log")"; grep -E "^(FAILED|ERROR)" "$W/pytest_B.log" | head -20 ;;
    sanitize)
      for tool in memcheck initcheck racecheck; do
        # initcheck sees an allocation's first use only: torch's caching allocator would hand it reused blocks
        in_tree "$B" 150 "$W/sanitizer_$tool.log" \
          "env $([ $tool = initcheck ] && echo PYTORCH_NO_CUDA_MEMORY_CACHING=1) compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize_kda.py"
        stamp "compute-sanitizer $tool on B: exit $? $(tail -1 "$W/sanitizer_$tool.log")"
      done ;;
    timing)
      ab timing 90 "python3 bench/numerics.py --timing --only-timing --no-fla --out $W/timing_\${ARM}_\$ROUND" ;;
    cmd)
      ab cmd "${CMD_S:-60}" "$AB_CMD" ;;
    bcmd)
      in_tree "$B" "${CMD_S:-60}" "$W/cmd_B.log" "$AB_CMD"
      stamp "cmd B: rc $? $(tail -4 "$W/cmd_B.log" | tr '\n' ' ')" ;;
    bits)
      rm -f /tmp/bits_A.pt /tmp/bits_B.pt
      in_tree "$A" 120 "$W/bits_A.log" "python3 bench/bits.py save /tmp/bits_A.pt" &&
        in_tree "$B" 120 "$W/bits_B.log" "python3 bench/bits.py save /tmp/bits_B.pt" &&
        in_tree "$B" 60 "$W/bits.log" "python3 bench/bits.py compare /tmp/bits_A.pt /tmp/bits_B.pt"
      stamp "bits: rc $? $(tail -q -n 1 "$W"/bits*.log | tr '\n' ' ')" ;;
    numerics)
      in_tree "$B" "${NUMERICS_S:-300}" "$W/numerics_B.log" "python3 bench/numerics.py --out $W ${NUMERICS_ARGS:-}"
      stamp "numerics B: $(tail -3 "$W/numerics_B.log" | tr '\n' ' ')" ;;
  esac
done
