"""Config and dependency defects: non-finite floats, ``train.backend``, the torch floor."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.agent.preflight import prepare_run_dir
from unbroken.config import Config, config_diff, config_from_dict, config_hash, load_config, validate

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
FLOAT_FIELDS = ("train.timeout_s", "fault.heartbeat_timeout_s", "fault.store_timeout_s", "fault.job_hours", "optim.lr")


# -- 2. inf / nan ----------------------------------------------------------------


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "Infinity"])
def test_non_finite_override_is_rejected_naming_field_value_and_fix(field: str, text: str) -> None:
    with pytest.raises(ValueError) as err:
        load_config(overrides=[f"{field}={text}"])
    assert f"{field}={text!r}: expected a finite number (not inf or nan)" in str(err.value)


def test_non_finite_values_from_toml_and_json_are_rejected(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("[train]\ntimeout_s = inf\n[fault]\nheartbeat_timeout_s = nan\njob_hours = -inf\n")
    with pytest.raises(ValueError) as err:
        load_config(file=toml)
    msg = str(err.value)
    assert "3 configuration error(s)" in msg  # all at once
    for field in ("train.timeout_s", "fault.heartbeat_timeout_s", "fault.job_hours"):
        assert f"{field}=" in msg
    with pytest.raises(ValueError, match=r"train.timeout_s=inf: expected a finite number"):
        config_from_dict({"train": {"timeout_s": math.inf}})


def test_validate_catches_non_finite_values_set_in_code() -> None:
    cfg = Config()
    cfg.train.timeout_s = math.inf
    cfg.fault.heartbeat_timeout_s = math.nan
    cfg.fault.job_hours = math.inf
    errors = "\n".join(validate(cfg))
    assert "train.timeout_s=inf: must be a finite number > 0" in errors
    assert "fault.heartbeat_timeout_s=nan: must be a finite number > 0" in errors
    assert "fault.job_hours=inf: must be a finite number > 0" in errors



def test_store_timeout_is_checked_and_changes_nothing_trained() -> None:
    cfg = Config()
    cfg.fault.store_timeout_s = 0.0
    assert "fault.store_timeout_s=0.0: must be a finite number > 0" in "\n".join(validate(cfg))
    assert config_hash(load_config(overrides=["fault.store_timeout_s=5"])) == config_hash(load_config())

# -- 3. train.backend: NCCL on CUDA by default, gloo to share a GPU (a test topology) ------------------------


def test_backend_changes_how_sums_travel_not_what_is_trained() -> None:
    assert Config().train.backend == "auto"
    assert config_hash(load_config(overrides=["train.backend=gloo"])) == config_hash(load_config())
    with_it = Config().to_dict()
    with_it["train"]["backend"] = "gloo"
    assert config_diff(with_it, Config().to_dict()) == ["train.backend"]


def test_backend_nccl_on_the_cpu_or_gloo_under_sharded_state_on_a_gpu_is_refused() -> None:
    cfg = Config()
    cfg.train.device, cfg.train.backend = "cpu", "nccl"
    assert "train.backend='nccl' with train.device='cpu': NCCL runs on GPUs only" in "\n".join(validate(cfg))
    cfg.train.device, cfg.train.backend, cfg.train.shard_optimizer = "cuda", "gloo", True
    assert "train.backend='gloo' on a GPU with train.shard_optimizer" in "\n".join(validate(cfg))
    with pytest.raises(ValueError, match="train.backend"):
        load_config(overrides=["train.backend=mpi"])


def test_two_workers_may_share_a_gpu_only_over_gloo() -> None:
    from unbroken.models.factory import placement_problem

    assert "NCCL cannot hold two ranks of one group on one GPU" in placement_problem([0, 1], 1)
    assert "or train.backend=gloo to share the GPUs" in placement_problem([0, 1], 1)


def test_resume_of_a_run_saved_with_backend_is_not_a_different_config(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    saved = Config().to_dict()
    saved["train"]["backend"] = "auto"
    (run / "config.json").write_text(json.dumps(saved))
    # The config check passes; the run then lacks a checkpoint (a later, different error).
    with pytest.raises(ValueError, match="no committed checkpoint"):
        prepare_run_dir(run, config_from_dict(saved), overwrite=False, resume=True)


# -- 4. the torch floor ----------------------------------------------------------


def _floor() -> tuple[int, int]:
    found = re.search(r'"torch>=(\d+)\.(\d+)', (REPO / "pyproject.toml").read_text())
    assert found, "pyproject.toml names no torch floor"
    return int(found.group(1)), int(found.group(2))


def test_torch_floor_has_the_checkpoint_api_the_code_imports() -> None:
    # torch.distributed.checkpoint exports HuggingFaceStorageWriter/Reader from 2.8 (2.7: only _HuggingFace...).
    assert _floor() >= (2, 8)
    assert f"`torch` (≥ {_floor()[0]}.{_floor()[1]}" in (REPO / "README.md").read_text()


def _setup_copy(tmp_path: Path) -> Path:
    """scripts/setup.sh and pyproject.toml in a scratch tree whose .venv is this one (installed, up to date)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "setup.sh").write_text((REPO / "scripts" / "setup.sh").read_text())
    (root / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    os.utime(root / "pyproject.toml", (0, 0))  # older than the venv's install stamp: no pip run
    (root / ".venv").symlink_to(Path(sys.prefix))
    return root


def _fake_torch(tmp_path: Path, version: str, *, with_hf: bool) -> Path:
    pkg = tmp_path / "fake" / "torch"
    (pkg / "distributed" / "checkpoint").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (pkg / "distributed" / "__init__.py").write_text("")
    api = "def async_save(state_dict, *, storage_writer=None, no_dist=False): ...\n"
    if with_hf:
        api += "class HuggingFaceStorageReader: ...\nclass HuggingFaceStorageWriter: ...\n"
    (pkg / "distributed" / "checkpoint" / "__init__.py").write_text(api)
    return pkg.parent


def _run_setup(root: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    if not (Path(sys.prefix) / ".unbroken-installed").is_file():
        pytest.skip("this venv was not made by scripts/setup.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_INDEX_URL")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(["bash", str(root / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=50)


def test_setup_accepts_the_installed_torch(tmp_path: Path) -> None:
    done = _run_setup(_setup_copy(tmp_path))
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("version, with_hf, says", [
    ("2.6.0+cpu", True, "is older than 2.8"),
    ("2.9.1", False, "lacks torch.distributed.checkpoint's HuggingFaceStorageReader, HuggingFaceStorageWriter"),
])
def test_setup_refuses_a_torch_without_the_api_and_says_what_to_do(tmp_path: Path, version: str, with_hf: bool,
                                                                   says: str) -> None:
    done = _run_setup(_setup_copy(tmp_path), _fake_torch(tmp_path, version, with_hf=with_hf))
    assert done.returncode == 1
    assert f"setup: torch {version}" in done.stderr and says in done.stderr
    assert "pip install 'torch==" in done.stderr and "--system-site-packages" in done.stderr
