#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default corpus: 4 data-parallel
# workers on 2 nodes survive a worker kill, a hang and a node loss (unbroken demo; --no-faults
# for none); output in runs/default, the failure-free reference in runs/default-failure-free.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/unbroken demo --out runs/default --overwrite "$@"
