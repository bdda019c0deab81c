#!/usr/bin/env bash
# The tests: lint, then pytest. CUDA tests are skipped without a GPU.
# Extra arguments go to pytest (e.g. -k add, -m cuda).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ruff check src tests
ruff format --check src tests
exec python -m pytest "$@"
