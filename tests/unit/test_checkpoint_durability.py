"""Persistent checkpoints survive crashes, bit flips, torn commits and a full disk.

Real files throughout: the disk-full case writes to a tmpfs mounted for the
test (skipped where mounting is not permitted) and, everywhere, to a process
whose file-size limit is lowered (``RLIMIT_FSIZE``). ``os.fsync`` is only
observed (the real call still runs) to check what reaches the disk and when.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from unbroken.agent.preflight import prepare_run_dir
from unbroken.config import Config, OptimConfig, config_hash, load_config
from unbroken.models import build_model
from unbroken.models.optim import build_optimizer
from unbroken.checkpoint.checkpointer import (
    COMMIT_FILE,
    AsyncCheckpointer,
    CheckpointError,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    read_commit,
    training_state,
    verify_checkpoint,
)

pytestmark = [
    pytest.mark.timeout(120),
    # DCP warns from its writer thread that it saves in one process: that is the intent.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

REPO = Path(__file__).resolve().parents[2]
HASH = "cafe0123"
SHARD = "model-00001-of-00001.safetensors"


def _job(seed: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = build_model("debug", vocab_size=64, seq_len=8, seed=seed)
    o = OptimConfig()
    opt = build_optimizer(model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    opt.step()
    opt.zero_grad()


def _saved_run(run: Path, steps: int, **kw: object) -> tuple[AsyncCheckpointer, dict[int, dict[str, torch.Tensor]]]:
    """Train ``steps`` steps with a checkpoint after each; returns the parameters at each step."""
    model, opt = _job()
    ckpt = AsyncCheckpointer(run, config_hash=HASH, **kw)
    params = {}
    for done in range(1, steps + 1):
        _train_step(model, opt)
        ckpt.save(done, training_state(model, opt), {"loss": 1.0})
        params[done] = {n: p.detach().clone() for n, p in model.named_parameters()}
    ckpt.wait()
    return ckpt, params


def _assert_loads(path: Path, want: dict[str, torch.Tensor]) -> None:
    model, opt = _job(seed=7)
    load_checkpoint(path, model, opt, config_hash=HASH)
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name


def _flip_byte(f: Path, offset: int = -5) -> None:
    data = bytearray(f.read_bytes())
    data[offset] ^= 0x01
    f.write_bytes(bytes(data))


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


# -- 1. durability ------------------------------------------------------------


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names open files through /proc (Linux)")

def _run_dir(tmp_path: Path) -> tuple[Config, Path]:
    """A run directory holding the debug preset's config (what resume checks against)."""
    cfg = load_config(preset_name="debug")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    return cfg, run

def test_every_file_commit_and_directories_are_fsynced_in_order(tmp_path, monkeypatch):
    """Shards and index fsynced; commit.json written to a temp file, fsynced, renamed; then the dirs."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _saved_run(tmp_path / "run", 1)
    path = checkpoint_dir(tmp_path / "run", 1).resolve()
    synced = [p for kind, p in events if kind == "fsync"]
    files = sorted(f.name for f in path.iterdir() if f.name != COMMIT_FILE)
    assert SHARD in files and len(files) >= 2, files
    for name in files:
        assert str(path / name) in synced, f"{name} was never fsynced"
    tmp = str(path / (COMMIT_FILE + ".tmp"))
    rename = events.index(("replace", str(path / COMMIT_FILE)))
    assert ("fsync", tmp) in events[:rename], "commit.json must be fsynced before it is renamed into place"
    assert all(("fsync", str(path / n)) in events[:rename] for n in files), "files must be on disk before commit"
    after = events[rename + 1:]
    assert ("fsync", str(path)) in after, "the checkpoint directory must be fsynced after the rename"
    assert ("fsync", str(path.parent)) in after, "checkpoints/ must be fsynced after the rename"


# -- 2. checksums ----------------------------------------------------------------


def test_commit_records_the_sha256_of_every_file(tmp_path):
    _saved_run(tmp_path / "run", 1)
    path = checkpoint_dir(tmp_path / "run", 1)
    files = read_commit(path)["files"]
    assert set(files) == {f.name for f in path.iterdir() if f.name != COMMIT_FILE}
    for name, digest in files.items():
        assert digest == hashlib.sha256((path / name).read_bytes()).hexdigest(), name
    assert verify_checkpoint(path)["step"] == 1


def test_flipped_byte_in_a_shard_resumes_from_the_previous_checkpoint(tmp_path, caplog):
    cfg, run = _run_dir(tmp_path)
    model, opt = _job()
    ckpt = AsyncCheckpointer(run, config_hash=config_hash(cfg))
    for done in (1, 2):
        _train_step(model, opt)
        ckpt.save(done, training_state(model, opt), {})
        ckpt.wait()
    bad = checkpoint_dir(run, 2) / SHARD
    _flip_byte(bad)
    caplog.set_level(logging.WARNING)
    assert latest_checkpoint(run) == checkpoint_dir(run, 1)
    assert any(str(bad) in m for m in _messages(caplog, logging.WARNING)), "the warning must name the file"
    assert prepare_run_dir(run, cfg, overwrite=False, resume=True) == checkpoint_dir(run, 1)
    with pytest.raises(CheckpointError, match=SHARD):
        load_checkpoint(checkpoint_dir(run, 2), *_job(seed=3), config_hash=config_hash(cfg))


def test_flipped_byte_with_no_previous_checkpoint_is_a_clear_error(tmp_path, caplog):
    cfg, run = _run_dir(tmp_path)
    model, opt = _job()
    ckpt = AsyncCheckpointer(run, config_hash=config_hash(cfg))
    _train_step(model, opt)
    ckpt.save(1, training_state(model, opt), {})
    ckpt.wait()
    _flip_byte(checkpoint_dir(run, 1) / SHARD, offset=200)  # inside the JSON header
    with pytest.raises(CheckpointError, match=f"no intact committed checkpoint.*{SHARD}.*does not match"):
        latest_checkpoint(run)
    with pytest.raises(CheckpointError, match=f"--resume {run}: .*{SHARD}"):
        prepare_run_dir(run, cfg, overwrite=False, resume=True)


# -- 3. torn commit ----------------------------------------------------------------


def test_torn_commit_falls_back_and_read_commit_names_the_file(tmp_path, caplog):
    run = tmp_path / "run"
    _, params = _saved_run(run, 2)
    torn = checkpoint_dir(run, 2) / COMMIT_FILE
    torn.write_bytes(torn.read_bytes()[: len(torn.read_bytes()) // 2])
    caplog.set_level(logging.WARNING)
    assert latest_checkpoint(run) == checkpoint_dir(run, 1)
    warned = _messages(caplog, logging.WARNING)
    assert any(str(torn) in m and "torn" in m for m in warned), warned
    with pytest.raises(CheckpointError, match=str(torn)):
        read_commit(checkpoint_dir(run, 2))
    _assert_loads(checkpoint_dir(run, 1), params[1])


# -- 4. retention ----------------------------------------------------------------


def test_keep_checkpoints_is_a_validated_train_field():
    assert load_config(preset_name="debug").train.keep_checkpoints == 3
    assert load_config(overrides=["train.keep_checkpoints=1"]).train.keep_checkpoints == 1
    with pytest.raises(ValueError, match=r"train\.keep_checkpoints=0: must be >= 1"):
        load_config(overrides=["train.keep_checkpoints=0"])
    with pytest.raises(ValueError, match="keep=0"):
        AsyncCheckpointer("unused", config_hash=HASH, keep=0)


def test_only_the_newest_keep_checkpoints_remain(tmp_path):
    """checkpoint_every=1, keep_checkpoints=2: older committed and older incomplete dirs go, a newer one stays."""
    cfg = load_config(overrides=["train.checkpoint_every=1", "train.keep_checkpoints=2", "train.steps=6"])
    t, run = cfg.train, tmp_path / "run"
    stale, in_flight = checkpoint_dir(run, 0), checkpoint_dir(run, 99)
    for d in (stale, in_flight):
        d.mkdir(parents=True)
        (d / SHARD).write_bytes(b"partial")
    model, opt = _job()
    ckpt = AsyncCheckpointer(run, config_hash=HASH, keep=t.keep_checkpoints)
    for done in range(1, t.steps + 1):
        _train_step(model, opt)
        if done % t.checkpoint_every == 0:
            ckpt.save(done, training_state(model, opt), {})
    ckpt.wait()
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left == ["step_0000005", "step_0000006", "step_0000099"], left
    assert latest_checkpoint(run) == checkpoint_dir(run, 6)
    _assert_loads(checkpoint_dir(run, 6), dict(model.named_parameters()))
    verify_checkpoint(checkpoint_dir(run, 5))


# -- 5. disk full ----------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    """A 4 MiB tmpfs (room for two debug checkpoints), unmounted afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here; test_file_size_limit_does_not_stop_training covers the failure")
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)],
                         capture_output=True, text=True, timeout=30)
    if got.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({got.stderr.strip()}); "
                    "test_file_size_limit_does_not_stop_training covers the failure")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def _fill(disk: Path) -> Path:
    ballast = disk / "ballast"
    with open(ballast, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return ballast


def test_disk_full_does_not_stop_training(tiny_disk, caplog):
    caplog.set_level(logging.INFO)
    run = tiny_disk / "run"
    model, opt = _job()
    ckpt = AsyncCheckpointer(run, config_hash=HASH)
    _train_step(model, opt)
    ckpt.save(1, training_state(model, opt), {})
    ckpt.wait()
    ballast = _fill(tiny_disk)
    _train_step(model, opt)
    ckpt.save(2, training_state(model, opt), {})
    deadline = time.monotonic() + 60
    while ckpt.pending_step is not None and time.monotonic() < deadline:
        _train_step(model, opt)  # training goes on while the save fails in the background
        ckpt.poll()
        time.sleep(0.01)
    ckpt.wait()
    assert ckpt.failed_steps == [2]
    assert not checkpoint_dir(run, 2).exists(), "the partial checkpoint must be removed"
    assert latest_checkpoint(run) == checkpoint_dir(run, 1)
    ballast.unlink()
    ckpt.save(3, training_state(model, opt), {})
    ckpt.wait()
    assert latest_checkpoint(run) == checkpoint_dir(run, 3), "the next save is tried again"
    errors = [m for m in _messages(caplog, logging.ERROR) if "checkpoint at step 2 not written" in m]
    assert len(errors) == 1 and "No space left on device" in errors[0], _messages(caplog, logging.ERROR)


_FSIZE_SCRIPT = textwrap.dedent("""
    import json, logging, resource, signal, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint_durability import HASH, _job, _train_step
    from unbroken.checkpoint.checkpointer import AsyncCheckpointer, checkpoint_dir, latest_checkpoint, training_state
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append([record.levelname, record.getMessage()])
    logging.getLogger("unbroken").addHandler(Keep())
    logging.getLogger("unbroken").setLevel(logging.INFO)
    run = Path(sys.argv[1])
    model, opt = _job()
    ckpt = AsyncCheckpointer(run, config_hash=HASH)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    _train_step(model, opt)
    ckpt.save(1, training_state(model, opt), {})
    ckpt.wait()
    _train_step(model, opt)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    ckpt.save(2, training_state(model, opt), {})
    ckpt.wait()
    print(json.dumps({"failed": ckpt.failed_steps, "step1_exists": checkpoint_dir(run, 1).exists(),
                      "latest": str(latest_checkpoint(run)), "records": records}))
""")


def test_file_size_limit_does_not_stop_training(tmp_path):
    """The same failure without a mount: a process whose file-size limit the shard exceeds (EFBIG)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    got = subprocess.run([sys.executable, "-c", _FSIZE_SCRIPT, str(tmp_path / "run"), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=100, cwd=REPO, env=env)
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    assert out["failed"] == [1] and not out["step1_exists"]
    assert out["latest"] == str(checkpoint_dir(tmp_path / "run", 2))
    errors = [m for level, m in out["records"] if level == "ERROR"]
    assert len(errors) == 1 and "checkpoint at step 1 not written" in errors[0] and "File too large" in errors[0], \
        errors


# -- 6. leadership lost ----------------------------------------------------------------


def test_a_save_commits_without_being_polled(tmp_path):
    """A leader that stops leading never polls again: its save must still commit on its own."""
    run = tmp_path / "run"
    model, opt = _job()
    ckpt = AsyncCheckpointer(run, config_hash=HASH)
    _train_step(model, opt)
    ckpt.save(1, training_state(model, opt), {})
    commit = checkpoint_dir(run, 1) / COMMIT_FILE
    deadline = time.monotonic() + 60
    while not commit.is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert commit.is_file(), "the save was left uncommitted"
    ckpt.wait()


def test_handover_finishes_and_commits_the_pending_save(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    run = tmp_path / "run"
    model, opt = _job()
    ckpt = AsyncCheckpointer(run, config_hash=HASH)
    _train_step(model, opt)
    ckpt.save(1, training_state(model, opt), {})
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert ckpt.pending_step == 1
    ckpt.handover()
    assert ckpt.pending_step is None
    assert verify_checkpoint(checkpoint_dir(run, 1))["step"] == 1, "committed when handover returns"
    assert any("no longer leading" in m for m in _messages(caplog, logging.INFO))
    ckpt.handover()  # nothing pending: a no-op
    _assert_loads(checkpoint_dir(run, 1), want)
