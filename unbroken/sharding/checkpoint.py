"""Persistent checkpoints of a sharded run: every worker writes its range's moments, the leader commits.

Each member writes its range's ``exp_avg`` and ``exp_avg_sq`` (flat float32,
DCP's safetensors storage, no pickle) asynchronously into a staging directory
``checkpoints/.shards/step_<N>-g<gen>/<lo>-<hi>/`` and marks it done
(``shard.json``: step, generation, range). The leader writes the replicated
part (parameters, ``step`` counts, RNG) into ``checkpoints/step_<N>/`` as for a
replicated run; its background thread waits for every range of the view's
sharding, moves them into ``step_<N>/shards/`` and only then seals the
checksums of all files and writes ``commit.json`` (with ``"shards": [[lo, hi],
...]``). A range that does not arrive (its worker died meanwhile) leaves the
checkpoint uncommitted; the next one is tried as usual.

Loading (:func:`load_moments`) reassembles the flat moments from whatever
ranges a checkpoint holds, so a sharded checkpoint resumes under any worker
count, and replicated and sharded runs resume from each other's checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from unbroken.dcp import dcp

__all__ = ["SHARD_WAIT_S", "ShardCheckpointer", "collect_shards", "load_moments", "staging_dir"]

logger = logging.getLogger(__name__)

SHARD_WAIT_S = 60.0
"""Longest the leader waits for the other members' ranges of one checkpoint."""
MARKER = "shard.json"


def staging_dir(run_dir: str | Path, step: int, gen: int) -> Path:
    return Path(run_dir) / "checkpoints" / ".shards" / f"step_{step:07d}-g{gen}"


class ShardCheckpointer:
    """One worker's half of a sharded checkpoint: its range's moments, written in the background."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-checkpoint")
        self._pending: Future[None] | None = None

    def save(self, step: int, gen: int, lo: int, hi: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Stage the range's moments now and write them asynchronously (the previous save is waited for)."""
        self.wait()
        out = staging_dir(self.run_dir, step, gen) / f"{lo}-{hi}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        state = {"exp_avg": exp_avg.detach().cpu(), "exp_avg_sq": exp_avg_sq.detach().cpu()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            fut = dcp().async_save(state, storage_writer=dcp().HuggingFaceStorageWriter(str(out)), no_dist=True)
        self._pending = self._pool.submit(self._finish, out, fut, {"step": step, "gen": gen, "lo": lo, "hi": hi})

    @staticmethod
    def _finish(out: Path, fut: Future, marker: dict) -> None:
        fut.result(timeout=600)
        tmp = out / (MARKER + ".tmp")
        tmp.write_text(json.dumps(marker))
        os.replace(tmp, out / MARKER)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result(timeout=600)
            except Exception as exc:  # the leader's commit then lacks this range: the checkpoint is not committed
                logger.error("optimizer shard not written for the checkpoint: %s", exc)

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)


def collect_shards(run_dir: str | Path, step: int, gen: int, ranges: list[tuple[int, int]], dest: Path,
                   timeout_s: float = SHARD_WAIT_S) -> None:
    """Wait until every range of ``ranges`` is staged for ``(step, gen)``, then move them under ``dest/shards``.

    Raises:
        TimeoutError: a range did not arrive in time (its worker died or its disk failed).
    """
    stage = staging_dir(run_dir, step, gen)
    deadline = time.monotonic() + timeout_s
    missing = list(ranges)
    while missing:
        missing = [(lo, hi) for lo, hi in missing if not (stage / f"{lo}-{hi}" / MARKER).is_file()]
        if missing and time.monotonic() > deadline:
            raise TimeoutError(f"optimizer shards {missing} of step {step} were not written within {timeout_s:.0f} s")
        if missing:
            time.sleep(0.01)
    (dest / "shards").mkdir(exist_ok=True)
    for lo, hi in ranges:
        (stage / f"{lo}-{hi}" / MARKER).unlink()
        os.replace(stage / f"{lo}-{hi}", dest / "shards" / f"{lo}-{hi}")
    shutil.rmtree(stage, ignore_errors=True)
    for old in stage.parent.glob("step_*"):  # stages of earlier steps nobody will commit any more
        if old.name < stage.name:
            shutil.rmtree(old, ignore_errors=True)


def load_moments(path: str | Path, ranges: list[list[int]], total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat moments of a sharded checkpoint, reassembled from its ranges.

    Raises:
        ValueError: the ranges do not cover ``[0, total)`` exactly (another model, or a torn checkpoint).
    """
    spans = sorted((int(lo), int(hi)) for lo, hi in ranges)
    at = 0
    for lo, hi in spans:
        if lo != at:
            raise ValueError(f"{path}: optimizer shards cover [{at}, {lo}) twice or not at all")
        at = hi
    if at != total:
        raise ValueError(f"{path}: optimizer shards cover {at} elements, the model has {total}")
    m = torch.empty(total, dtype=torch.float32)
    v = torch.empty(total, dtype=torch.float32)
    for lo, hi in spans:
        part = {"exp_avg": m[lo:hi], "exp_avg_sq": v[lo:hi]}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp().load(part, storage_reader=dcp().HuggingFaceStorageReader(str(Path(path) / "shards" / f"{lo}-{hi}")),
                     no_dist=True)
    return m, v
