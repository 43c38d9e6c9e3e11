#!/usr/bin/env bash
# One-line wrapper for the device machine: install batchgen, then run the GPU check.
set -euo pipefail; cd "$(dirname "$0")/.." && pip install -q -e . && python scripts/gpu_check.py "$@"
