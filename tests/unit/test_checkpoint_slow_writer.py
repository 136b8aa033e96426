"""A checkpoint that verifies holds one step's state, however slow its writer.

The writer is slowed by a patched file sink that stops, part-way through a checkpoint's tensors, until the
test lets it go on (an event, not a sleep): the save of the next step then runs while the write is still
reading its host buffers, and the checkpointers' timeouts (made short here) expire deterministically.
Real files, real threads, real sha256.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from unbroken.checkpoint import writer as checkpoint_writer
from unbroken.checkpoint.checkpointer import COMMIT_FILE, AsyncCheckpointer, checkpoint_dir, verify_checkpoint
from unbroken.checkpoint.writer import HostStage, StageBusy
from unbroken.checkpoint.sharded import MARKER, ShardCheckpointer, staging_dir

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

NAMES = ("a", "b", "c", "d")
SHORT_S = 0.05
"""The checkpointers' timeouts while the writer is held (they expire for certain: the writer waits for the test)."""
LONG_S = 60.0
"""Their timeouts once it is let go (a bound on a wait the test needs to end, never reached)."""


def _state(step: int) -> dict[str, torch.Tensor]:
    return {name: torch.full((4, 4), float(step)) for name in NAMES}


class _Gate:
    """Holds the writer of files under ``under`` after the header and the first tensor of its first file,
    until :meth:`release`."""

    def __init__(self, under: Path) -> None:
        self.under, self.held, self.go = str(under), threading.Event(), threading.Event()
        self.puts = 0

    def release(self) -> None:
        self.go.set()

    def before_put(self, sink: object) -> None:
        if self.go.is_set() or not str(getattr(getattr(sink, "f"), "name")).startswith(self.under):
            return
        self.puts += 1
        if self.puts > 2:  # the header, then tensor "a": stop before "b"
            self.held.set()
            assert self.go.wait(LONG_S), "the test never let the writer go on"


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    g = _Gate(tmp_path)
    put = checkpoint_writer._Sink.put

    def slow_put(sink: checkpoint_writer._Sink, data: memoryview | bytes) -> None:
        g.before_put(sink)
        put(sink, data)

    monkeypatch.setattr(checkpoint_writer._Sink, "put", slow_put)
    yield g
    g.release()  # a failed test never leaves a writer thread waiting


def _values(files: list[Path]) -> dict[str, float]:
    """Each tensor's value (the tensors are filled with one number)."""
    out: dict[str, float] = {}
    for f in files:
        out.update({name: float(t.flatten()[0]) for name, t in load_file(f).items() if name in NAMES})
    return out


def test_a_save_while_the_previous_write_still_reads_its_buffers_is_skipped(tmp_path, gate, caplog):
    ckpt = AsyncCheckpointer(tmp_path, config_hash="h", timeout_s=SHORT_S)
    ckpt.save(1, _state(1), {})
    assert gate.held.wait(LONG_S)
    ckpt.save(2, _state(2), {})  # the write of step 1 still reads the host buffers: they must stay step 1's
    pending = ckpt.pending_step
    gate.release()
    ckpt.timeout_s = LONG_S
    ckpt.save(3, _state(3), {})
    ckpt.wait()
    for step in (1, 3):
        path = checkpoint_dir(tmp_path, step)
        assert verify_checkpoint(path)["step"] == step
        assert _values(sorted(path.glob("*.safetensors"))) == dict.fromkeys(NAMES, float(step)), step
    assert pending == 1 and ckpt.skipped_steps == [2] and ckpt.failed_steps == []
    assert not checkpoint_dir(tmp_path, 2).exists()
    assert sum("skipped" in r.getMessage() for r in caplog.records) == 1


def test_a_write_given_up_on_never_commits(tmp_path, gate):
    ckpt = AsyncCheckpointer(tmp_path, config_hash="h", timeout_s=SHORT_S)
    ckpt.save(1, _state(1), {})
    assert gate.held.wait(LONG_S)
    ckpt.wait()  # gives up on step 1: it counts as not written
    assert ckpt.failed_steps == [1] and ckpt.pending_step == 1
    gate.release()
    ckpt.timeout_s = LONG_S
    ckpt.save(2, _state(2), {})  # waits for the write given up on to end (it removes what it wrote)
    ckpt.wait()
    assert not checkpoint_dir(tmp_path, 1).exists(), "a checkpoint counted as not written was committed"
    assert _values(sorted(checkpoint_dir(tmp_path, 2).glob("*.safetensors"))) == dict.fromkeys(NAMES, 2.0)


def test_a_part_saved_while_the_previous_part_is_written_is_skipped_and_the_commit_holds_one_step(
        tmp_path, gate):
    parts = ShardCheckpointer(tmp_path, timeout_s=SHORT_S)
    parts.save_part(1, 0, "i0", _state(1), about={"dims": dict.fromkeys(NAMES, 0)})
    assert gate.held.wait(LONG_S)
    parts.save_part(2, 0, "i0", _state(2), about={"dims": dict.fromkeys(NAMES, 0)})
    gate.release()
    parts.timeout_s = LONG_S
    parts.wait()  # the part of step 1 is staged: the leader's commit finds it at once
    leader = AsyncCheckpointer(tmp_path, config_hash="h", timeout_s=LONG_S)
    leader.save(1, {"rest": torch.zeros(2)}, {}, shards=(0, ["i0"], {"hsdp_parts": 1}))
    leader.wait()
    path = checkpoint_dir(tmp_path, 1)
    commit = verify_checkpoint(path)
    assert commit["step"] == 1 and "shards/i0/model.safetensors.index.json" in commit["files"]
    assert _values(sorted((path / "shards" / "i0").glob("*.safetensors"))) == dict.fromkeys(NAMES, 1.0)
    assert parts.skipped_steps == [2]
    assert not (staging_dir(tmp_path, 2, 0) / "i0" / MARKER).exists()
    parts.save_part(3, 0, "i0", _state(3))
    parts.close()
    marker = json.loads((staging_dir(tmp_path, 3, 0) / "i0" / MARKER).read_text())
    assert marker["step"] == 3
    assert _values(sorted((staging_dir(tmp_path, 3, 0) / "i0").glob("*.safetensors"))) == dict.fromkeys(NAMES, 3.0)


def test_a_part_given_up_on_never_marks_itself_done(tmp_path, gate):
    parts = ShardCheckpointer(tmp_path, timeout_s=SHORT_S)
    parts.save_part(1, 0, "i0", _state(1))
    assert gate.held.wait(LONG_S)
    parts.wait()  # gives up on it: the leader's commit must not find it later
    gate.release()
    parts.timeout_s = LONG_S
    parts.save_part(2, 0, "i0", _state(2))  # waits for the write given up on to end
    parts.close()
    assert not (staging_dir(tmp_path, 1, 0) / "i0" / MARKER).exists()
    assert (staging_dir(tmp_path, 2, 0) / "i0" / MARKER).is_file()


def test_the_final_checkpoint_is_never_skipped_it_follows_the_write_still_running(tmp_path, gate):
    """The final save is written from the live state (no buffer to protect): the older write still running is
    given up on and the final one follows it."""
    ckpt = AsyncCheckpointer(tmp_path, config_hash="h", timeout_s=SHORT_S)
    ckpt.save(1, _state(1), {})
    assert gate.held.wait(LONG_S)
    final = _state(2)
    ckpt.save(2, final, {}, live=True)
    assert ckpt.skipped_steps == [] and ckpt.failed_steps == [1] and ckpt.pending_step == 2
    gate.release()
    ckpt.timeout_s = LONG_S
    ckpt.wait()
    assert not (checkpoint_dir(tmp_path, 1) / COMMIT_FILE).exists()
    assert verify_checkpoint(checkpoint_dir(tmp_path, 2))["step"] == 2
    assert _values(sorted(checkpoint_dir(tmp_path, 2).glob("*.safetensors"))) == dict.fromkeys(NAMES, 2.0)


def test_a_host_stage_lent_to_a_running_write_refuses_a_copy():
    stage = HostStage()
    first = stage.copy(_state(1))
    write: Future[None] = Future()
    stage.lend(write)
    with pytest.raises(StageBusy):
        stage.copy(_state(2))
    assert all(float(t.flatten()[0]) == 1.0 for t in first.values()), "the lent buffers were written into"
    write.set_result(None)
    assert all(float(t.flatten()[0]) == 2.0 for t in stage.copy(_state(2)).values())
