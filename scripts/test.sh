#!/usr/bin/env bash
# The tests: codegen check, build shipped + test-only records in place, pytest (GPU tests skip without a GPU).
source "$(dirname "$0")/setup_env.sh"
# fla-core 0.6.0's wheel, read (not installed: it would want Triton) by tests/test_fla_source.py, which checks
# kda_aot's reading of FLA against FLA's own torch code.
if ! ls .whl/fla_core-0.6.0-*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip download -q --no-deps --only-binary :all: --retries 0 --timeout 15 --dest .whl "fla-core==0.6.0" \
    || echo "could not download fla-core 0.6.0: tests/test_fla_source.py will skip" >&2
fi
KDA_AOT_TEST_RECORDS=1 "$PYTHON" setup.py -q build_ext --inplace
exec "$PYTHON" -m pytest -q tests "$@"
