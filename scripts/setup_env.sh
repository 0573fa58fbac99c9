# Sourced by scripts/main.sh and scripts/test.sh: install what is missing, check that generated/ is current.
# Env: KDA_AOT_ARCH (default: local GPU, else sm_90a), KDA_AOT_PROGRAMS (subset), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
# What is missing or older than the build needs (pyproject.toml's build-system, the [test] extra). torch
# only when there is none: the CPU build CI uses (a GPU machine has its own torch).
mapfile -t missing < <("$PYTHON" - <<'PY'
import importlib.metadata, re
def numbers(version):
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])
for dist, floor, requirement in (("torch", "", "torch==2.13.0"), ("jinja2", "3.1", "jinja2>=3.1"),
                                 ("pybind11", "2.12", "pybind11>=2.12"), ("pytest", "8", "pytest>=8"),
                                 ("setuptools", "68", "setuptools>=68"), ("wheel", "", "wheel"),
                                 ("numpy", "", "numpy")):  # numpy: torch warns on every import without it
    try:
        if numbers(importlib.metadata.version(dist)) >= numbers(floor):
            continue
    except importlib.metadata.PackageNotFoundError:
        pass
    print(requirement)
PY
)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  "$PYTHON" -m pip install -q "${missing[@]}"
fi
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ] && [ -z "${CUDA_HOME:-}" ]; then
  echo "nvcc not found: install the CUDA toolkit (12.3 or newer) or set CUDA_HOME" >&2
  exit 1
fi
"$PYTHON" -m codegen check
