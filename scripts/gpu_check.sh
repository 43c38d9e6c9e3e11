#!/usr/bin/env bash
# One-line wrapper for a GPU machine: runs the GPU check from this checkout with the machine's own
# torch, Triton and transformers (nothing installed, so it also runs where no package index is
# reachable). Arguments go to scripts/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
