"""Persistent checkpoints of a sharded run: every worker writes its part, the leader commits.

Each member writes its range's ``exp_avg`` and ``exp_avg_sq`` (flat float32,
safetensors files by :mod:`unbroken.checkpoint.writer`, no pickle)
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

A worker writes one part at a time (:class:`~unbroken.checkpoint.slot.WriteSlot`):
a save waits up to ``timeout_s`` for its previous part's write, and if that
still runs it is skipped (logged, ``skipped_steps``, ``on_skip``) rather than
copied into the host buffers the write still reads; the leader's commit of
that step then lacks the part and is not made. A part given up on
(:meth:`ShardCheckpointer.wait` out of patience) never writes its marker.

A commit removes every stage it supersedes: those of earlier steps, and those
of its own step in the same or an earlier generation, whoever's writer
(a replica that took the final checkpoint over from a dead leader, whatever
their ids, leaves no stage of the dead one's behind).

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
from pathlib import Path
from typing import Callable

import torch

from unbroken.checkpoint.dcp import dcp
from unbroken.checkpoint.slot import WriteClaim, WriteSlot
from unbroken.checkpoint.writer import write_state, writer_threads
from unbroken.sharding.layout import hsdp_part

__all__ = ["PART_TIMEOUT_S", "SHARD_WAIT_S", "ShardCheckpointer", "collect_shards", "hsdp_part_keys",
           "load_hsdp_parts", "load_moments", "staging_dir"]

logger = logging.getLogger(__name__)

SHARD_WAIT_S = 60.0
"""Longest the leader waits for the other members' ranges of one checkpoint."""
PART_TIMEOUT_S = 600.0
"""Longest a worker waits for its previous part's write (before a save, which is skipped if it still runs,
and at the end)."""
MARKER = "shard.json"
PART = "part.json"


_STAGE = re.compile(r"step_(\d+)-g(\d+)(?:w(\d+))?")


def staging_dir(run_dir: str | Path, step: int, gen: int | str) -> Path:
    """``gen``: the view's generation, or a stage of its own within it (:meth:`Trainer._stage`)."""
    return Path(run_dir) / "checkpoints" / ".shards" / f"step_{step:07d}-g{gen}"


class ShardCheckpointer:
    """One worker's half of a sharded checkpoint: its range's moments, written in the background.

    Args:
        run_dir: the run directory.
        timeout_s: longest wait for the previous part's write (then a save is skipped; at the end, the part is
            given up on).
        on_skip: called with ``step=`` and ``writing=`` (the step still being written) when a save is skipped.
    """

    def __init__(self, run_dir: str | Path, *, timeout_s: float = PART_TIMEOUT_S,
                 on_skip: Callable[..., None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.timeout_s = timeout_s
        self.on_skip = on_skip
        self.skipped_steps: list[int] = []
        """Steps whose part was not saved: the previous part's write still ran."""
        self._slot = WriteSlot("shard-checkpoint")

    def save(self, step: int, gen: int | str, lo: int, hi: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Stage the range's moments now and write them asynchronously (the previous save is waited for)."""
        self.save_part(step, gen, f"{lo}-{hi}", {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})

    def save_part(self, step: int, gen: int | str, name: str, state: dict[str, torch.Tensor],
                  about: dict | None = None, live: bool = False) -> None:
        """Stage part ``name`` (host copies of ``state``; ``live``: ``state`` itself, which does not change
        until :meth:`wait`) now and write it asynchronously; ``about`` is kept beside it (``part.json``).

        The previous part's write is waited for first (up to ``timeout_s``); if it still runs, this save is
        skipped (``live``: the previous part is given up on instead, and this one follows it)."""
        writing = self._slot.settle(self.timeout_s)
        if writing is not None and not live:
            self.skipped_steps.append(step)
            logger.warning("checkpoint part %s of step %d skipped: the part of step %d is still being written after "
                           "%.0f s (from the host buffers this save would copy into)", name, step, writing,
                           self.timeout_s)
            if self.on_skip is not None:
                self.on_skip(step=step, writing=writing)
            return
        if writing is not None:  # the final part needs no buffer and supersedes the older one
            self._give_up(writing)
        out = staging_dir(self.run_dir, step, gen) / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        staged = state if live else self._slot.stage.copy(state)
        if about is not None:
            (out / PART).write_text(json.dumps(about))
        self._slot.submit(step, self._finish, out, staged, {"step": step, "gen": gen, "part": name},
                          reads_stage=not live)

    @staticmethod
    def _finish(out: Path, state: dict[str, torch.Tensor], marker: dict, claim: WriteClaim) -> None:
        """Background: write the part, then its marker unless it was given up on (then remove it). A failure is
        logged: the leader's commit then lacks this part, and the checkpoint is not committed."""
        try:
            written = write_state(out, state)  # part.json is hashed (and fsynced) with the commit
            if not claim.commit():
                shutil.rmtree(out, ignore_errors=True)
                logger.warning("checkpoint part %s of step %d given up on before its marker: removed", marker["part"],
                               marker["step"])
                return
            tmp = out / (MARKER + ".tmp")
            tmp.write_text(json.dumps({**marker, "files": written.files}))
            os.replace(tmp, out / MARKER)
        except Exception as exc:
            logger.error("checkpoint part %s of step %d not written: %s", marker["part"], marker["step"], exc)

    def wait(self) -> None:
        """Block until the pending part is written (or has failed and been logged), at most ``timeout_s``; a part
        still not written then is given up on: it never writes its marker."""
        step = self._slot.pending.step if self._slot.pending else None
        if step is not None and not self._slot.wait(self.timeout_s):
            self._give_up(step)

    def _give_up(self, step: int) -> None:
        outcome = self._slot.give_up()
        if outcome is not None:
            logger.error("checkpoint part of step %d still not written after %.0f s: %s", step, self.timeout_s,
                         "given up on, it will not be marked done" if outcome else "its marker is being written")

    def close(self) -> None:
        self.wait()
        self._slot.close()


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
    writer took as it wrote it (by path relative to ``dest``). Every stage this commit supersedes is removed:
    earlier steps', and this step's of this or an earlier generation, whoever's writer.

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
    own = _stage_order(stage.name)[:2]
    for old in stage.parent.glob("step_*"):
        # earlier steps', and this step's of this or an earlier generation by any writer (a replica taking the
        # final checkpoint over from a dead leader stages apart from it, whichever id is lower): nobody commits
        # them any more; a later generation's stage of this step may be a save in flight
        if _stage_order(old.name)[:2] <= own:
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

    from unbroken.state.parts import is_sharded

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
