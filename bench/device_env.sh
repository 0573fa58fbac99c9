# Sourced by the device scripts: unbuffered output, $OUT, the repo root, carried wheels (.whl).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kda_out}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
