#!/usr/bin/env bash
# Nsight Compute on the KDA kernels of one training step (one launch each, pack Q1 with 4 heads):
# speed of light, occupancy, warp stall reasons, memory. Leaves the clocks alone. Runs: NCU_RUNS,
# words kernel:chunk_form:gate_form (default: every forward and backward program, the test-only
# kda_fwd_chunk and kda_bwd_gate forms beside the shipped ones). Reports: $NCU_DIR (default $OUT).
source "$(dirname "$0")/device_env.sh"
if [ -z "${NCU_NO_BUILD:-}" ]; then  # device_check.sh has built everything already
  KDA_AOT_TEST_RECORDS=1 KDA_AOT_PROGRAMS=kda_fwd_chunk,kda_fwd_tape,kda_bwd_tape,kda_bwd_chunk,kda_bwd_gate \
    python3 setup.py -q build_ext --inplace 2>&1 | tail -3
fi
RUNS="kda_fwd_chunk:default:split_staged kda_fwd_chunk:balanced:split_staged kda_fwd_tape:default:split_staged
      kda_bwd_tape:default:split_staged kda_bwd_chunk:default:split_staged kda_bwd_gate:default:split_staged
      kda_bwd_gate:default:split_horner"
for run in ${NCU_RUNS:-$RUNS}; do
  IFS=: read -r k chunk gate <<< "$run"
  report="${NCU_DIR:-$OUT}/ncu_${k}_${chunk}_${gate}.txt"
  KDA_AOT_CHUNK_FORM=$chunk KDA_AOT_GATE_FORM=$gate PYTHONPATH=$PWD timeout ${NCU_S:-120} \
    ncu --clock-control none -k regex:"$k\\b" -c 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section LaunchStats --section InstructionStats python3 bench/profile_kda.py Q1 4 > "$report" 2>&1
  echo "== $k (chunk $chunk, gate $gate)"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Block Limit (Reg|Shared)|Issued Ipc|DRAM Throughput|Executed Instructions  " "$report" | head -16
done
