#!/usr/bin/env bash
# The main job: build the op library, check every operator, benchmark it
# against PyTorch and print the tables. On the GPU when there is one, else CPU.
# Extra arguments go to `opforge run` (e.g. --device cpu, --json FILE).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec opforge run "$@"
