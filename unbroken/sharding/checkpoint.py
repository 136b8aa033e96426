"""Persistent checkpoints of a sharded run: every worker writes its part, the leader commits.

Each member writes its range's ``exp_avg`` and ``exp_avg_sq`` (flat float32,
safetensors files by :mod:`unbroken.runtime.checkpoint_writer`, no pickle)
asynchronously into a staging directory
``checkpoints/.shards/step_<N>-g<gen>/<lo>-<hi>/`` and marks it done
(``shard.json``: step, generation, range, the sha256 of every file taken as it
was written). The leader writes the replicated
part (parameters, ``step`` counts, RNG) into ``checkpoints/step_<N>/`` as for a
replicated run; its background thread waits for every range of the view's
sharding, moves them into ``step_<N>/shards/`` and only then seals the
checksums of all files and writes ``commit.json`` (with ``"shards": [[lo, hi],
...]``). A range that does not arrive (its worker died meanwhile) leaves the
checkpoint uncommitted; the next one is tried as usual.

Loading (:func:`load_moments`) reassembles the flat moments from whatever
ranges a checkpoint holds, so a sharded checkpoint resumes under any worker
count, and replicated and sharded runs resume from each other's checkpoints.

HSDP (``train.shard_degree = k``) the same way: each of the ``k`` ranks of the
replica that writes stages its local shards of every sharded tensor
(parameters, moments) as part ``i<index>`` (``part.json`` names the dimension
each is split on), the leader writes the rest (step counts, RNG) and commits
once all ``k`` parts are in (``"hsdp_parts": k``). Nobody gathers the model
on one host. :func:`load_hsdp_parts` reads a rank's own part alone when it
loads into ``k`` shards again, else concatenates the parts into whole tensors
(another ``k``, or a replicated model).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from unbroken.dcp import dcp
from unbroken.runtime.checkpoint_writer import HostStage, write_state, writer_threads

__all__ = ["SHARD_WAIT_S", "ShardCheckpointer", "collect_shards", "hsdp_part", "hsdp_part_keys", "load_hsdp_parts",
           "load_moments", "staging_dir"]

logger = logging.getLogger(__name__)

SHARD_WAIT_S = 60.0
"""Longest the leader waits for the other members' ranges of one checkpoint."""
MARKER = "shard.json"
PART = "part.json"


def hsdp_part(index: int) -> str:
    """The name of shard index ``index``'s part of an HSDP checkpoint."""
    return f"i{index}"


_STAGE = re.compile(r"step_(\d+)-g(\d+)(?:w(\d+))?")


def staging_dir(run_dir: str | Path, step: int, gen: int | str) -> Path:
    """``gen``: the view's generation, or a stage of its own within it (:meth:`Trainer._stage`)."""
    return Path(run_dir) / "checkpoints" / ".shards" / f"step_{step:07d}-g{gen}"


class ShardCheckpointer:
    """One worker's half of a sharded checkpoint: its range's moments, written in the background."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-checkpoint")
        self._pending: Future[None] | None = None
        self._stage = HostStage()

    def save(self, step: int, gen: int | str, lo: int, hi: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Stage the range's moments now and write them asynchronously (the previous save is waited for)."""
        self.save_part(step, gen, f"{lo}-{hi}", {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})

    def save_part(self, step: int, gen: int | str, name: str, state: dict[str, torch.Tensor],
                  about: dict | None = None, live: bool = False) -> None:
        """Stage part ``name`` (host copies of ``state``; ``live``: ``state`` itself, which does not change
        until :meth:`wait`) now and write it asynchronously (the previous save is waited for); ``about`` is
        kept beside it (``part.json``)."""
        self.wait()
        out = staging_dir(self.run_dir, step, gen) / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        staged = state if live else self._stage.copy(state)
        if about is not None:
            (out / PART).write_text(json.dumps(about))
        self._pending = self._pool.submit(self._finish, out, staged, {"step": step, "gen": gen, "part": name})

    @staticmethod
    def _finish(out: Path, state: dict[str, torch.Tensor], marker: dict) -> None:
        written = write_state(out, state)  # part.json is hashed (and fsynced) with the commit
        tmp = out / (MARKER + ".tmp")
        tmp.write_text(json.dumps({**marker, "files": written.files}))
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


def _stage_order(name: str) -> tuple[int, int, int]:
    """``(step, generation, writer)`` of a staging directory's name (:func:`staging_dir`: ``step_<N>-g<gen>`` or
    ``step_<N>-g<gen>w<writer>``, writer -1 without one), compared as numbers (``g12`` after ``g3``); a name of
    another form orders after every stage (never removed as an earlier one)."""
    match = _STAGE.fullmatch(name)
    if match is None:
        return (sys.maxsize, 0, 0)
    step, gen, writer = match.groups()
    return (int(step), int(gen), int(writer) if writer is not None else -1)


def collect_shards(run_dir: str | Path, step: int, gen: int | str, parts: list[str], dest: Path,
                   timeout_s: float = SHARD_WAIT_S) -> dict[str, str]:
    """Wait until every part of ``parts`` (a ZeRO-1 range ``lo-hi``, an HSDP shard index ``i<index>``) is staged
    for ``(step, gen)``, then move them under ``dest/shards``; returns the sha256 of each of their files its
    writer took as it wrote it (by path relative to ``dest``).

    Raises:
        TimeoutError: a part did not arrive in time (its worker died or its disk failed).
    """
    stage = staging_dir(run_dir, step, gen)
    deadline = time.monotonic() + timeout_s
    missing = list(parts)
    while missing:
        missing = [name for name in missing if not (stage / name / MARKER).is_file()]
        if missing and time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint parts {missing} of step {step} were not written within {timeout_s:.0f} s")
        if missing:
            time.sleep(0.01)
    (dest / "shards").mkdir(exist_ok=True)
    known: dict[str, str] = {}
    for name in parts:
        marker = json.loads((stage / name / MARKER).read_text())
        known.update({f"shards/{name}/{f}": digest for f, digest in marker.get("files", {}).items()})
        (stage / name / MARKER).unlink()
        os.replace(stage / name, dest / "shards" / name)
    shutil.rmtree(stage, ignore_errors=True)
    for old in stage.parent.glob("step_*"):  # stages of earlier steps nobody will commit any more
        if _stage_order(old.name) < _stage_order(stage.name):
            shutil.rmtree(old, ignore_errors=True)
    return known


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
            dcp().load(part, storage_reader=dcp().HuggingFaceStorageReader(str(Path(path) / "shards" / f"{lo}-{hi}"),
                                                                           thread_count=writer_threads()),
                       no_dist=True)
    return m, v


def hsdp_part_keys(path: str | Path) -> set[str]:
    """The entries an HSDP checkpoint holds in its parts (every tensor its writers held sharded)."""
    return set(json.loads((Path(path) / "shards" / hsdp_part(0) / PART).read_text())["dims"])


def load_hsdp_parts(path: str | Path, k: int, wanted: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """The sharded entries of an HSDP checkpoint written by ``k`` ranks, for each key of ``wanted`` (laid out
    as the loading model holds it: a DTensor, or a whole tensor).

    Returns ``(tensors, local)``: when every sharded entry of ``wanted`` is split over a mesh of ``k`` ranks on
    the dimension it was written split on, this rank's parts, read from its own part alone (``local``);
    otherwise whole tensors, the ``k`` parts concatenated (another ``k``, or a replicated model).

    Raises:
        ValueError: a key is missing from the parts, or the parts do not add up to its shape.
    """
    from safetensors import safe_open

    from unbroken.sharding.parts import is_sharded

    root = Path(path) / "shards"
    dims = [json.loads((root / hsdp_part(i) / PART).read_text())["dims"] for i in range(k)]

    def read(i: int, keys: list[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for f in sorted((root / hsdp_part(i)).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                out.update({key: h.get_tensor(key) for key in h.keys() if key in keys})
        return out

    keys = list(wanted)
    missing = [key for key in keys if key not in dims[0]]
    if missing:
        raise ValueError(f"{path}: the HSDP checkpoint's parts hold no {missing[:3]}")
    sharded = [wanted[key] for key in keys if is_sharded(wanted[key])]
    if sharded and len(sharded) == len(keys) and all(
            t.device_mesh.size() == k and t.placements[0].dim == dims[0][key]  # type: ignore[attr-defined]
            for key, t in zip(keys, sharded)):
        index = sharded[0].device_mesh.get_local_rank()  # type: ignore[attr-defined]
        return read(index, keys), True
    parts = [read(i, keys) for i in range(k)]
    out = {}
    for key in keys:
        whole = torch.cat([p[key] for p in parts if key in p], dim=dims[0][key])
        if tuple(whole.shape) != tuple(wanted[key].shape):
            raise ValueError(f"{path}: the parts of {key} make {tuple(whole.shape)}, the model has "
                             f"{tuple(wanted[key].shape)}")
        out[key] = whole
    return out, False
