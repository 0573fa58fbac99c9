#!/usr/bin/env bash
# The tests: codegen check, build shipped + test-only records in place, pytest (GPU tests skip without a GPU).
source "$(dirname "$0")/setup_env.sh"
KDA_AOT_TEST_RECORDS=1 "$PYTHON" setup.py -q build_ext --inplace
exec "$PYTHON" -m pytest -q tests "$@"
