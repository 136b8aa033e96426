#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with unbroken installed.
#
# torch is never pulled in blindly: an interpreter that already has torch (a
# CUDA build, say) lends it to the venv (--system-site-packages) and pip keeps
# it, since the package asks only for torch>=2.6. Without one, torch==$TORCH_VERSION
# is installed explicitly; on a CPU-only machine point pip at the CPU wheels
# (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu) if no local wheel exists.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${UNBROKEN_TORCH_VERSION:-2.13.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x .venv/bin/python ]; then
    if "$PYTHON" -c "import torch" 2>/dev/null; then
        echo "setup: using the torch already installed for $PYTHON"
        "$PYTHON" -m venv --system-site-packages .venv
    else
        "$PYTHON" -m venv .venv
    fi
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==$TORCH_VERSION"
    .venv/bin/python -m pip install -q "torch==$TORCH_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
    .venv/bin/python -c "import torch" 2>/dev/null || { echo "setup: torch==$TORCH_VERSION could not be installed" >&2; exit 1; }
fi
stamp=.venv/.unbroken-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
    .venv/bin/python -c "import unbroken, torch, tokenizers, safetensors, rich, pytest_timeout" \
        || { echo "setup: installation incomplete" >&2; exit 1; }
    touch "$stamp"
fi
