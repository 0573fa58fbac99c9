#!/usr/bin/env bash
# The main job: build the shipped kernels, then run `python -m kda_aot` (GPU: the packed KDA and
# conv training-step benchmarks vs flash-linear-attention + reference KDA step; no GPU: says so,
# runs the reference).
source "$(dirname "$0")/setup_env.sh"
"$PYTHON" setup.py -q build_ext --inplace
exec "$PYTHON" -m kda_aot "$@"
