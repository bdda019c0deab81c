#!/usr/bin/env bash
# The tests: lint, then pytest. CUDA tests are skipped without a GPU.
# Extra arguments go to pytest, e.g.
#   bash scripts/test.sh                   everything (CI runs this)
#   bash scripts/test.sh -m "not slow"     while working: no cold builds of the whole library, examples, wheel, CMake
#   bash scripts/test.sh -k add -n 2       a selection, on two pytest-xdist workers
# On a GPU machine: bash scripts/test_gpu.sh (every CUDA test, in parallel).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if command -v ruff >/dev/null; then
  ruff check src tests
  ruff format --check src tests
else
  echo "ruff is not installed here (no package index?): lint skipped" >&2
fi
exec python -m pytest "$@"
