#!/usr/bin/env bash
# Every CUDA test, on a GPU machine, in parallel on pytest-xdist workers
# (default 8; OPFORGE_TEST_WORKERS=N to change). Tests that share one setup
# (the examples, a scaffolded package, the CMake build) stay in one worker
# (their xdist_group). Extra arguments go to pytest, e.g. -k qqq.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec bash scripts/test.sh -m cuda -n "${OPFORGE_TEST_WORKERS:-8}" --durations=20 "$@"
