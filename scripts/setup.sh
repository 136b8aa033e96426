#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with unbroken installed.
#
# torch is never pulled in blindly: an interpreter that already has torch (a
# CUDA build, say) lends it to the venv (--system-site-packages) and pip keeps
# it, since the package asks only for a floor (torch>=N in pyproject.toml, the one
# place it is written). Without one, torch==$TORCH_VERSION is installed explicitly;
# on a CPU-only machine point pip at the CPU wheels
# (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu) if no local wheel exists.
# A torch found older than the floor (or without the checkpoint API the code uses)
# is never upgraded behind your back (that can mean GBs of CUDA packages): the script
# stops and says what to run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${UNBROKEN_TORCH_VERSION:-2.13.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x .venv/bin/python ]; then
    if "$PYTHON" -c "import torch" 2>/dev/null; then
        echo "setup: using the torch already installed for $PYTHON"
        "$PYTHON" -m venv --system-site-packages .venv
        # $PYTHON may itself be a virtual environment (some GPU images ship one): a venv made from it
        # sees only its base interpreter's packages, so point .venv at $PYTHON's own site-packages too.
        parent_sites="$("$PYTHON" -c 'import site, sys; print("\n".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')"
        if [ -n "$parent_sites" ]; then
            printf '%s\n' "$parent_sites" > "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_unbroken_parent_env.pth"
        fi
    else
        "$PYTHON" -m venv .venv
    fi
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==$TORCH_VERSION"
    .venv/bin/python -m pip install -q "torch==$TORCH_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
    .venv/bin/python -c "import torch" 2>/dev/null || { echo "setup: torch==$TORCH_VERSION could not be installed" >&2; exit 1; }
fi
TORCH_FLOOR="$(sed -n 's/^ *"torch>=\([0-9][0-9.]*\)".*/\1/p' pyproject.toml | head -n 1)"
[ -n "$TORCH_FLOOR" ] || { echo "setup: no \"torch>=N\" dependency found in pyproject.toml" >&2; exit 1; }
if ! problem="$(.venv/bin/python - "$TORCH_FLOOR" 2>&1 <<'PY'
import inspect, re, sys
import torch
floor = tuple(int(x) for x in sys.argv[1].split("."))
found = re.match(r"(\d+)\.(\d+)", torch.__version__)
have = (int(found.group(1)), int(found.group(2))) if found else (0, 0)
if have < floor[:2]:
    sys.exit(f"torch {torch.__version__} ({torch.__file__}) is older than {sys.argv[1]}, the oldest this project runs on")
import torch.distributed.checkpoint as dcp
missing = [n for n in ("HuggingFaceStorageReader", "HuggingFaceStorageWriter") if not hasattr(dcp, n)]
if "no_dist" not in inspect.signature(dcp.async_save).parameters:
    missing.append("async_save(no_dist=...)")
if missing:
    sys.exit(f"torch {torch.__version__} ({torch.__file__}) lacks torch.distributed.checkpoint's {', '.join(missing)}")
PY
)"; then
    echo "setup: ${problem##*$'\n'}" >&2
    echo "setup: upgrade it: .venv/bin/python -m pip install 'torch==$TORCH_VERSION' (CPU-only machine: add" \
         "--index-url https://download.pytorch.org/whl/cpu); if .venv borrows the torch of $PYTHON" \
         "(--system-site-packages), upgrade it there instead, or delete .venv and rerun with PYTHON set to an" \
         "interpreter without torch (then torch==$TORCH_VERSION is installed)" >&2
    exit 1
fi
stamp=.venv/.unbroken-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # A setuptools already in the environment builds the package offline (no isolated build environment
    # to download); otherwise pip fetches one.
    isolation=""
    .venv/bin/python -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)" 2>/dev/null \
        && isolation="--no-build-isolation"
    # [hf] too: the tests (and CI) exercise model.family = hf-llama; [etcd]: the etcd store backend; [monitor]: the
    # watchers (TensorBoard, W&B offline, Prometheus); [datasets]: a Hugging Face dataset as data.source.
    .venv/bin/python -m pip install -q $isolation -e ".[test,hf,etcd,monitor,datasets]" 2>&1 | grep -v "^WARNING: Location" || true
    # Checked from outside the checkout, so that the source tree on sys.path cannot pass for an install.
    (venv_python="$PWD/.venv/bin/python"; cd / && "$venv_python" -c "import unbroken, torch, tokenizers, safetensors, pytest_timeout, transformers") \
        && [ -x .venv/bin/unbroken ] \
        || { echo "setup: installation incomplete (see pip's messages above)" >&2; exit 1; }
    touch "$stamp"
fi
# etcd (the etcd-server package) for the tests and benchmarks of --store etcd://: installed when missing and
# possible (root, or passwordless sudo, with apt-get); otherwise those tests skip and say how to get it.
if ! command -v etcd >/dev/null 2>&1 && [ -z "${UNBROKEN_ETCD:-}" ]; then
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && sudo_cmd="sudo -n"; }
    if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$sudo_cmd" ]; }; then
        echo "setup: installing etcd-server (apt-get)"
        $sudo_cmd apt-get install -y -q etcd-server >/dev/null 2>&1 \
            || { $sudo_cmd apt-get update -q >/dev/null 2>&1 && $sudo_cmd apt-get install -y -q etcd-server >/dev/null 2>&1; } \
            || echo "setup: etcd-server could not be installed; the etcd tests will skip" >&2
    else
        echo "setup: no etcd: the etcd tests will skip. Install it as root (apt-get install etcd-server)," \
             "or put an etcd 3.4+ binary on PATH or in UNBROKEN_ETCD" >&2
    fi
fi
# Slurm (slurm-wlm: slurmctld, slurmd, sbatch, srun; munge comes with it) for the test of
# examples/slurm/train.sbatch on a real Slurm: installed when missing and possible (root, or passwordless sudo,
# with apt-get); otherwise that test skips and says how to get it.
if ! PATH="$PATH:/usr/sbin:/sbin" sh -c 'command -v slurmctld && command -v slurmd && command -v sbatch' >/dev/null 2>&1; then
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && sudo_cmd="sudo -n"; }
    if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$sudo_cmd" ]; }; then
        echo "setup: installing slurm-wlm (apt-get)"
        apt_install="$sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm"
        $apt_install >/dev/null 2>&1 \
            || { $sudo_cmd apt-get update -q >/dev/null 2>&1 && $apt_install >/dev/null 2>&1; } \
            || echo "setup: slurm-wlm could not be installed; the Slurm test will skip" >&2
    else
        echo "setup: no Slurm: the Slurm test will skip. Install it as root (apt-get install slurm-wlm)" >&2
    fi
fi
