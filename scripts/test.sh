#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two pytest processes, a test file each at a time (module fixtures stay shared): the multi-process
# scenarios mostly wait (failure detection, restarts, admissions), so two at once fill the two cores.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=15 "$@"
