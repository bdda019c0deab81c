#!/usr/bin/env bash
# The tests: lint, then pytest. CUDA tests are skipped without a GPU.
# Extra arguments go to pytest, e.g.
#   bash scripts/test.sh                   everything, on every core (CI runs this)
#   bash scripts/test.sh -m "not slow"     while working: no cold builds of the whole library, examples, wheel, CMake
#   bash scripts/test.sh -k add -n 0       a selection, in one process
# On a GPU machine: bash scripts/test_gpu.sh (every CUDA test, in parallel).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if command -v ruff >/dev/null; then
  ruff check src tests
  ruff format --check src tests
else
  echo "ruff is not installed here (no package index?): lint skipped" >&2
fi
# Every core by default (pytest-xdist): the op library is built once and shared, and tests that
# share one setup stay in one worker. `-n 0` runs in this process (for a debugger).
case " $* " in
*" -n "* | *" -n"[0-9a]* | *" --numprocesses"*) exec python -m pytest "$@" ;;
*) exec python -m pytest -n auto "$@" ;;
esac
