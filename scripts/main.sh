#!/usr/bin/env bash
# The main job: build the shipped kernels in place; with a GPU, the packed KDA training step (pack Q1,
# H = 32) and the conv1d + SiLU step, each beside flash-linear-attention when it is installed, from the
# checkout's bench package (rows in bench/results/); then `python -m kda_aot` (what was built, and the
# fp64 reference KDA step on a small pack: on the GPU, or on the CPU without one).
source "$(dirname "$0")/setup_env.sh"
"$PYTHON" setup.py -q build_ext --inplace
if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PYTHON" -m bench single --pack Q1 --heads 32 --iters 10
  "$PYTHON" -m bench conv --pack Q1
else
  echo "main: no CUDA GPU here, so no benchmark (it needs one); the reference step only."
fi
exec "$PYTHON" -m kda_aot
