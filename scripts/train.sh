#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default corpus:
# 4 data-parallel workers, debug model, 200 steps, output in runs/default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/unbroken train --preset debug --workers 4 --steps 200 --out runs/default --overwrite "$@"
