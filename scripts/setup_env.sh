# Sourced by scripts/main.sh and scripts/test.sh: install what is missing, build the kernels in place.
# Env: KDA_AOT_ARCH (default: local GPU, else sm_90a), KDA_AOT_PROGRAMS (subset), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
missing=()
for mod in torch jinja2 pybind11 pytest setuptools; do
  "$PYTHON" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ ${#missing[@]} -gt 0 ]; then
  pkgs=()
  for m in "${missing[@]}"; do
    # torch: the CPU build CI uses; a GPU machine already has its own torch.
    if [ "$m" = torch ]; then pkgs+=("torch==2.13.0"); else pkgs+=("$m"); fi
  done
  echo "installing: ${pkgs[*]}"
  "$PYTHON" -m pip install -q "${pkgs[@]}"
fi
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ] && [ -z "${CUDA_HOME:-}" ]; then
  echo "nvcc not found: install the CUDA toolkit (12.3 or newer) or set CUDA_HOME" >&2
  exit 1
fi
"$PYTHON" -m codegen check
