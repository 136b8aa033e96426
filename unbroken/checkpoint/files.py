"""The files of persistent checkpoints: durable writes, checksums, verification, retention.

One checkpoint is a directory ``<run>/checkpoints/step_<NNNNNNN>/``; it is
*committed* once it holds ``commit.json``. This module knows the files only;
what goes into them is :mod:`unbroken.checkpoint.checkpointer`'s business.

Invariants:
- ``commit.json`` is written last: only after every other file of the
  directory and the directory itself are fsynced; it is written to a temporary
  file, fsynced, renamed into place, and then the directory and
  ``checkpoints/`` are fsynced. A crash leaves either no commit or a whole one.
- ``commit.json["files"]`` maps every other file of the checkpoint to its
  sha256; a checkpoint whose files do not match is never loaded.
- Retention deletes only committed checkpoints beyond the newest ``keep`` and
  incomplete directories older than the newest committed one (an incomplete
  directory newer than that may be a save in flight).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = [
    "COMMIT_FILE",
    "CheckpointError",
    "checkpoint_dir",
    "committed_checkpoints",
    "prune_checkpoints",
    "read_commit",
    "remove_checkpoint",
    "seal_files",
    "verify_files",
    "write_commit",
]

logger = logging.getLogger(__name__)

COMMIT_FILE = "commit.json"
_PREFIX = "step_"
_TMP_SUFFIX = ".tmp"
_CHUNK = 1 << 20
_REQUIRED = ("step", "config_hash")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not match the run."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{_PREFIX}{step:07d}"


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(_PREFIX) or not path.is_dir():
        return None
    try:
        return int(name[len(_PREFIX):])
    except ValueError:
        return None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every checkpoint directory under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if (s := _step_of(p)) is not None]
    return sorted(found)


def committed_checkpoints(root: str | Path) -> list[Path]:
    """Directories under ``root`` holding a ``commit.json`` (not yet verified), newest first."""
    return [p for _, p in reversed(_step_dirs(Path(root))) if (p / COMMIT_FILE).is_file()]


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (created, renamed, deleted files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_file(path: Path, *, sync: bool) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _payload_files(path: Path) -> list[Path]:
    """The files of a checkpoint other than its commit record (and temporary files), subdirectories included
    (a sharded run's ``shards/LO-HI/``)."""
    return sorted(f for f in path.rglob("*")
                  if f.is_file() and f.name != COMMIT_FILE and not f.name.endswith(_TMP_SUFFIX))


def seal_files(path: Path, known: dict[str, str] | None = None) -> dict[str, str]:
    """Fsync every file of checkpoint ``path`` and its directories; returns ``{relative path: sha256}``.

    ``known``: the digests of files whose writer hashed them as it wrote and fsynced them
    (:func:`~unbroken.checkpoint.writer.write_state`); those are not read again. Every other file is
    read, hashed and fsynced, several at a time."""
    known = known or {}
    files = _payload_files(path)
    rest = [f for f in files if f.relative_to(path).as_posix() not in known]
    digests = dict(zip((f.relative_to(path).as_posix() for f in rest), _map(lambda f: _hash_file(f, sync=True), rest)))
    missing = set(known) - {f.relative_to(path).as_posix() for f in files}
    if missing:
        raise FileNotFoundError(f"{path}: {sorted(missing)[0]} was written but is gone")
    digests.update(known)
    for d in sorted({f.parent for f in files} | {path}, key=lambda d: -len(d.parts)):
        fsync_dir(d)
    return dict(sorted(digests.items()))


def _map(fn: Any, items: list[Any]) -> list[Any]:
    """``fn`` over ``items`` with a thread per core (hashing and file reads release the GIL), in order."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    from unbroken.checkpoint.writer import writer_threads

    with ThreadPoolExecutor(max_workers=min(len(items), writer_threads()), thread_name_prefix="checkpoint-hash") as pool:
        return list(pool.map(fn, items))


def write_commit(path: Path, commit: dict[str, Any]) -> None:
    """Write ``commit.json`` durably and atomically: temp file, fsync, rename, fsync the directories."""
    final = path / COMMIT_FILE
    tmp = path / (COMMIT_FILE + _TMP_SUFFIX)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(commit, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(path)
    # The step directory's own entry lives in checkpoints/: without this, a crash can lose it whole.
    fsync_dir(path.parent)


def read_commit(path: str | Path) -> dict[str, Any]:
    """The commit record of checkpoint ``path``.

    Raises:
        CheckpointError: naming ``commit.json`` when it is missing, torn
            (unparseable) or lacks a required field.
    """
    f = Path(path) / COMMIT_FILE
    if not f.is_file():
        raise CheckpointError(f"{path} has no {COMMIT_FILE}: the checkpoint is incomplete")
    try:
        commit = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{f} is torn or unreadable ({exc})") from exc
    if not isinstance(commit, dict) or any(k not in commit for k in _REQUIRED):
        raise CheckpointError(f"{f} is not a commit record: it needs the fields {', '.join(_REQUIRED)}")
    return commit


def verify_files(path: str | Path, commit: dict[str, Any]) -> None:
    """Check every file recorded in ``commit["files"]`` against its sha256 (several files at a time).

    A commit without ``files`` (written before checksums were recorded) is
    accepted with a warning.

    Raises:
        CheckpointError: naming the first file that is missing or does not match.
    """
    path = Path(path)
    files = commit.get("files")
    if files is None:
        logger.warning("%s records no checksums (an older checkpoint); its files are not verified", path)
        return
    if not isinstance(files, dict):
        raise CheckpointError(f"{path / COMMIT_FILE}: 'files' must map file names to sha256 digests")
    names = sorted(files)
    for name in names:
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name} is missing (recorded in {path / COMMIT_FILE})")
    for name, got in zip(names, _map(lambda n: _hash_file(path / n, sync=False), names)):
        f, want = path / name, files[name]
        if got != want:
            raise CheckpointError(f"{f} does not match its checksum: sha256 {got}, "
                                  f"{path / COMMIT_FILE} records {want}")


def remove_checkpoint(path: Path) -> bool:
    """Delete a checkpoint directory, its commit record first; returns False (logged) on failure.

    Removing ``commit.json`` first means a deletion cut short leaves an
    incomplete directory, never a committed one with files missing.
    """
    try:
        (path / COMMIT_FILE).unlink(missing_ok=True)
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not delete checkpoint directory %s: %s", path, exc)
        return False
    return True


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete committed checkpoints beyond the newest ``keep``, and incomplete ones older than the newest.

    ``keep`` counts committed directories; their checksums are not re-read here.
    Returns the directories deleted.
    """
    assert keep >= 1, keep
    root = Path(root)
    dirs = _step_dirs(root)
    committed = [(s, p) for s, p in dirs if (p / COMMIT_FILE).is_file()]
    if not committed:
        return []
    newest = committed[-1][0]
    doomed = [p for _, p in committed[:-keep]]
    doomed += [p for s, p in dirs if s < newest and not (p / COMMIT_FILE).is_file()]
    deleted = [p for p in sorted(doomed) if remove_checkpoint(p)]
    if deleted:
        fsync_dir(root)
        logger.info("deleted old checkpoints %s (keeping the newest %d)", ", ".join(p.name for p in deleted), keep)
    return deleted
