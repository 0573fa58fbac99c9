#!/usr/bin/env bash
# Nsight Compute on the KDA kernels of one training step (one launch each, pack Q1 with 4 heads):
# speed of light, occupancy, warp stall reasons (every body item: --print-details all), memory,
# instruction counts, the source lines where warps stall most (SourceCounters; -lineinfo builds).
# Leaves the clocks alone.
# Runs: NCU_RUNS, words kernel:form (the form goes to that kernel's option, profile_kda.py's options argument:
# gate_form, walk_form; kda_fwd_chunk and kda_bwd_chunk have one form); default: every forward and backward
# program, the test-only forms beside the shipped ones. NCU_CALL: profile_kda.py's call, log_decay (default)
# or fla_layer (the raw gate and beta's logits activated in the kernels). Reports: $NCU_DIR (default $OUT).
source "$(dirname "$0")/device_env.sh"
if [ -z "${NCU_NO_BUILD:-}" ]; then  # device_check.sh has built everything already
  KDA_AOT_TEST_RECORDS=1 KDA_AOT_PROGRAMS=kda_fwd_chunk,kda_fwd_walk,kda_bwd_walk,kda_bwd_chunk,kda_bwd_gate \
    python3 setup.py -q build_ext --inplace 2>&1 | tail -3
fi
RUNS="kda_fwd_chunk:lean kda_fwd_walk:auto kda_bwd_walk:auto kda_bwd_chunk:default
      kda_bwd_gate:split_staged"
for run in ${NCU_RUNS:-$RUNS}; do
  IFS=: read -r k form <<< "$run"
  case $k in
    kda_fwd_chunk|kda_bwd_chunk) knob= ;;  # one form each
    kda_bwd_gate) knob=gate_form ;; *) knob=walk_form ;;
  esac
  report="${NCU_DIR:-$OUT}/ncu_${k}_${form}_${NCU_CALL:-log_decay}.txt"
  for extra in "--section SourceCounters --print-details all" ""; do  # the first needs a recent ncu
    env PYTHONPATH=$PWD timeout ${NCU_S:-120} \
      ncu --clock-control none -k regex:"$k\\b" -c 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section LaunchStats --section InstructionStats $extra python3 bench/profile_kda.py Q1 4 "${NCU_CALL:-log_decay}" "${knob:+$knob=$form}" > "$report" 2>&1
    grep -q "Duration" "$report" && break
  done
  echo "== $k ($form)"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Block Limit (Reg|Shared)|Issued Ipc|DRAM Throughput|Executed Instructions  " "$report" | head -16
done
