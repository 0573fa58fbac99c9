#!/usr/bin/env bash
# Nsight Compute on the KDA kernels of one training step (one launch each, pack Q1 with 4 heads):
# speed of light, occupancy, warp stall reasons, memory. Leaves the clocks alone. Kernels: the
# arguments (default: every forward and backward program, both gate forms). Reports: $NCU_DIR (default $OUT).
source "$(dirname "$0")/device_env.sh"
if [ -z "${NCU_NO_BUILD:-}" ]; then  # device_check.sh has built everything already
  KDA_AOT_TEST_RECORDS=1 KDA_AOT_PROGRAMS=kda_fwd_chunk,kda_fwd_tape,kda_bwd_tape,kda_bwd_chunk,kda_bwd_gate \
    python3 setup.py -q build_ext --inplace 2>&1 | tail -3
fi
for k in ${@:-kda_fwd_chunk kda_fwd_tape kda_bwd_tape kda_bwd_chunk kda_bwd_gate}; do
  for gate in split_staged split_horner; do
    [ "$k" != kda_bwd_gate ] && [ $gate != split_staged ] && continue
    KDA_AOT_GATE_FORM=$gate PYTHONPATH=$PWD timeout ${NCU_S:-120} ncu --clock-control none -k regex:"$k\\b" -c 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section LaunchStats python3 bench/profile_kda.py Q1 4 > "${NCU_DIR:-$OUT}/ncu_${k}_$gate.txt" 2>&1
    echo "== $k ($gate)"
    grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Block Limit (Reg|Shared)|Issued Ipc|DRAM Throughput" "${NCU_DIR:-$OUT}/ncu_${k}_$gate.txt" | head -14
  done
done
