"""Snapshot memory nobody else can poison: planted seals, links, other users' files, odd entries, and the
private folder itself (the threat model in docs/design.md: a local user is the attacker)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from unbroken.models import build_model
from unbroken.store.view import View
from unbroken.snapshot import segment
from unbroken.snapshot.restore import decide, inventory
from unbroken.snapshot.segment import (MAGIC, SECRET_ENV, SnapshotMemoryUnsafe, crc32, job_segments,
                                       remove_segments, segment_dir, segment_name, segment_path)
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of

pytestmark = pytest.mark.timeout(60)
OTHER_UID = 54321


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(SECRET_ENV, "the-jobs-secret")
    ident = os.urandom(6).hex()
    yield ident
    remove_segments(ident)
    for p in segment_dir().glob(f"unbroken-{ident}-*"):
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def _snapshot(job: str, step: int) -> None:
    model = build_model("debug", vocab_size=256, seq_len=32)
    opt = torch.optim.AdamW(model.parameters())
    snap = Snapshotter(job_id=job, node=0, worker=0, node_of={0: 0}, every=1, redundancy="none", parity=0,
                       config_hash="cfg", state=lambda: tensors_of(model, opt), on_event=lambda *a, **k: None)
    snap.take(step, View(gen=1, members=(0,), step=step))
    snap.close()


def _forge(path: Path, genuine: Path, step: int, mac: bytes) -> None:
    """A copy of a genuine sealed buffer claiming a later step, sealed with ``mac`` (the attacker lacks the key)."""
    data = bytearray(genuine.read_bytes())
    length = struct.unpack("<I", data[8:12])[0]
    seal = json.loads(bytes(data[64:64 + length]))
    raw = json.dumps({**seal, "step": step}, separators=(",", ":")).encode()
    data[64:64 + len(raw)] = raw
    data[8:16] = struct.pack("<II", len(raw), crc32(raw))
    data[16:48] = mac
    path.write_bytes(bytes(data))


def test_planted_links_foreign_files_and_forged_seals_are_left_out_and_reported(job: str, tmp_path: Path):
    _snapshot(job, 4)
    genuine = segment_path(segment_name(job, 0, 0, 0))
    assert genuine.read_bytes()[:8] == MAGIC
    _forge(segment_path(segment_name(job, 0, 0, 1)), genuine, 9, bytes(32))  # a later step, unkeyed
    victim = tmp_path / "victim"
    victim.write_bytes(genuine.read_bytes())
    kept = victim.read_bytes()
    segment_path(segment_name(job, 0, 1, 0)).symlink_to(victim)  # a link to a well-formed buffer
    foreign = segment_path(segment_name(job, 0, 2, 0))
    shutil.copyfile(genuine, foreign)
    os.chown(foreign, OTHER_UID, OTHER_UID)  # another user's file (mode 000 would be read by root anyway)
    os.chmod(foreign, 0)
    segment_path(segment_name(job, 0, 3, 0)).mkdir()  # not a file at all
    inv = inventory(job, 0, config_hash="cfg")
    assert [s["step"] for s in inv["seals"]] == [4], "only the job's own sealed buffer"
    problems = "\n".join(inv["problems"])
    assert "w0-b1: not sealed with this job's secret" in problems
    assert "w1-b0: cannot be opened safely" in problems
    assert f"w2-b0: not a regular file of user {os.getuid()} (owner {OTHER_UID})" in problems
    assert "w3-b0: cannot be opened safely" in problems or "w3-b0: not a regular file" in problems
    spec = decide([inv], checkpoint=None, members_of=lambda nodes: [0])
    assert spec is not None and spec["step"] == 4
    remove_segments(job)  # never raises on odd entries, and removes a link, not what it points to
    assert victim.read_bytes() == kept


def test_a_writer_replaces_a_link_planted_at_its_name_instead_of_writing_through_it(job: str, tmp_path: Path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    segment_path(segment_name(job, 0, 0, 0)).symlink_to(victim)
    _snapshot(job, 2)
    assert victim.read_bytes() == b"precious"
    path = segment_path(segment_name(job, 0, 0, 0))
    assert not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600
    assert [s["step"] for s in inventory(job, 0, config_hash="cfg")["seals"]] == [2]


def test_the_private_folder_must_be_a_folder_of_ours_closed_to_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(segment, "SHM_DIR", tmp_path)
    mine = tmp_path / f"unbroken-u{os.getuid()}"
    assert segment_dir() == mine and mine.stat().st_mode & 0o777 == 0o700
    os.chmod(mine, 0o777)
    with pytest.raises(SnapshotMemoryUnsafe, match="not a private folder .* mode 777"):
        job_segments("abcd")
    mine.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    mine.symlink_to(elsewhere)
    with pytest.raises(SnapshotMemoryUnsafe, match="a link, another owner's"):
        segment_dir()
    mine.unlink()
    mine.mkdir(mode=0o700)
    os.chown(mine, OTHER_UID, OTHER_UID)
    with pytest.raises(SnapshotMemoryUnsafe):
        segment_dir()
