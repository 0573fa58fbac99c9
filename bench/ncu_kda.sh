#!/usr/bin/env bash
# Nsight Compute on the two KDA forward kernels (one launch each, pack Q1 with 4 heads):
# speed of light, occupancy, warp stall reasons. Leaves the clocks alone.
source "$(dirname "$0")/device_env.sh"
KDA_AOT_PROGRAMS=kda_fwd_chunk,kda_fwd_tape python3 setup.py -q build_ext --inplace 2>&1 | tail -3
for k in kda_fwd_chunk kda_fwd_tape; do
  PYTHONPATH=$PWD ncu --clock-control none -k regex:$k -c 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
    python3 bench/profile_kda.py Q1 4 > "$OUT/ncu_$k.txt" 2>&1
  grep -E "Duration|Throughput|Achieved Occupancy|Theoretical Occupancy|Registers|Shared Memory Config|Warp Cycles Per Issued|Stall|Block Limit|Issued Ipc|L1/TEX Hit|Mem Busy|Max Bandwidth" "$OUT/ncu_$k.txt" | head -40
done
