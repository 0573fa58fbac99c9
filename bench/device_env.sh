# Sourced by the device scripts: unbuffered output, $OUT, the repo root, carried wheels (.whl).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kda_out}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Once per call: a nested script (ncu_kda.sh from device_check.sh) must not reinstall the wheels or
# re-extract the cache under processes that are using them.
if [ -n "${KDA_AOT_DEVICE_ENV:-}" ]; then return 0; fi
export KDA_AOT_DEVICE_ENV=1
# The tests that compare with FLA fail rather than skip when it is missing (.whl not carried).
export KDA_AOT_REQUIRE_FLA=${KDA_AOT_REQUIRE_FLA:-1}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
# Triton's cache (FLA's compiled kernels and autotuning results) from an earlier call, when carried:
# FLA's autotuning otherwise takes minutes of every fresh machine. .triton_autotune.tgz holds the
# autotuning results alone (small: with them Triton compiles only each kernel's chosen config).
mkdir -p "$HOME/.triton"
# bench/triton_autotune.tgz is the committed copy (the checkout of a new session has no carried one).
for f in bench/triton_autotune.tgz .triton_cache.tgz .triton_autotune.tgz; do
  if [ -f "$f" ]; then tar xzf "$f" -C "$HOME/.triton"; fi
done
# save_triton_cache: the autotuning results into $OUT (triton_autotune.tgz) and, when the whole
# cache is under 45 MB, the cache in 15 MB parts ($OUT returns files of at most 16 MiB):
# here `cat triton_cache.part-* > .triton_cache.tgz` and `cp triton_autotune.tgz .triton_autotune.tgz`.
save_triton_cache() {
  [ -d "$HOME/.triton/cache" ] || return 0
  (cd "$HOME/.triton" && find cache -name '*.autotune.json' | tar czf "$OUT/triton_autotune.tgz" -T -)
  tar czf /tmp/triton_cache.tgz -C "$HOME/.triton" cache
  if [ "$(stat -c %s /tmp/triton_cache.tgz)" -lt 45000000 ]; then
    split -b 15000000 -d -a 1 /tmp/triton_cache.tgz "$OUT/triton_cache.part-"
  fi
}
