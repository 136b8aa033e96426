"""Checkpoint files written at storage speed: safetensors, several writers, each file hashed as it is written.

A state (name -> tensor, in order) is split into contiguous groups of about equal bytes, one file per writer
thread (``model-0000i-of-0000N.safetensors``, the Hugging Face sharded layout, with
``model.safetensors.index.json`` beside them). Each thread writes its file's header and then every tensor's
bytes straight from the tensor (a CPU tensor is written from its own memory; a CUDA tensor goes through two
pinned blocks per thread, the copy of one overlapping the write of the other), feeding the same bytes to the
file's sha256 as it goes: the commit records the digests without reading the files again. File writes and
sha256 release the GIL, so the threads run in parallel.

The files are plain safetensors (JSON header, raw little-endian bytes, no pickle): torch DCP's
``HuggingFaceStorageReader``, ``safetensors.safe_open`` and Hugging Face tools read them.

:class:`HostStage` holds host copies of a state for a save that is written while training goes on (reused from
one save to the next; pinned when the state is on a GPU).

Invariants: a file's recorded sha256 is over exactly the bytes written to it; every file is fsynced before
:func:`write_state` returns; a tensor whose dtype safetensors cannot name is refused by name before any byte
is written; a :class:`HostStage` is never copied into while the write it was lent to is still running
(:class:`StageBusy`): that write would hash and commit another step's bytes as its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = ["INDEX_FILE", "HostStage", "StageBusy", "Written", "file_groups", "safetensors_header", "write_state",
           "writer_threads"]

INDEX_FILE = "model.safetensors.index.json"
CHUNK_BYTES = 64 << 20
"""The piece a thread writes and hashes at a time (and the size of each of a CUDA writer's two pinned blocks)."""
MIN_FILE_BYTES = 64 << 20
"""Below this much state per file the state is split into fewer files (a small state: one file)."""
MAX_THREADS = 8

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclasses.dataclass(frozen=True)
class Written:
    """What :func:`write_state` wrote: ``files`` maps each file's name (relative to the directory) to its sha256."""

    files: dict[str, str]
    bytes: int
    seconds: float
    threads: int

    @property
    def gb_s(self) -> float:
        return round(self.bytes / self.seconds / 1e9, 3) if self.seconds > 0 else 0.0


def writer_threads() -> int:
    """Writer threads: one per core the process may use, at most :data:`MAX_THREADS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def file_groups(sizes: list[int], files: int) -> list[list[int]]:
    """Indices of ``sizes`` split in order into at most ``files`` non-empty groups of about equal bytes."""
    total = sum(sizes)
    files = max(1, min(files, len(sizes), total // MIN_FILE_BYTES if total >= MIN_FILE_BYTES else 1))
    groups: list[list[int]] = [[] for _ in range(files)]
    done = 0
    for i, size in enumerate(sizes):  # each tensor to the group its middle byte falls in
        groups[min(files - 1, int((done + size / 2) * files / total) if total else 0)].append(i)
        done += size
    groups = [g for g in groups if g] or [list(range(len(sizes)))]
    return groups


def safetensors_header(entries: list[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a safetensors file holding ``entries`` in order, padded with spaces
    so the data starts 8-byte aligned (as the safetensors library writes it).

    Raises:
        TypeError: an entry's dtype has no safetensors name.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, t in entries:
        if t.dtype not in _DTYPES:
            raise TypeError(f"checkpoint entry {name!r} has dtype {t.dtype}, which safetensors cannot hold")
        size = _nbytes(t)
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


class _Sink:
    """A file and its sha256, fed the same bytes."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.h, self.bytes = f, hashlib.sha256(), 0

    def put(self, data: memoryview | bytes) -> None:
        self.f.write(data)
        self.h.update(data)
        self.bytes += len(data)


class _DeviceReader:
    """Two pinned blocks and a side stream of one writer thread: chunk i+1 is copied off the device while
    chunk i is written."""

    def __init__(self, device: torch.device, chunk: int) -> None:
        self.blocks = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.stream = torch.cuda.Stream(device)
        self.chunk = chunk

    def put(self, t: torch.Tensor, sink: _Sink) -> None:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        spans = [(lo, min(lo + self.chunk, flat.numel())) for lo in range(0, flat.numel(), self.chunk)]
        events: list[torch.cuda.Event] = []
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        for i, (lo, hi) in enumerate(spans):
            with torch.cuda.stream(self.stream):
                self.blocks[i % 2][:hi - lo].copy_(flat[lo:hi], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            events.append(ev)
            if i:
                self._drain(i - 1, spans[i - 1], events[i - 1], sink)
        if spans:
            self._drain(len(spans) - 1, spans[-1], events[-1], sink)

    def _drain(self, i: int, span: tuple[int, int], ev: torch.cuda.Event, sink: _Sink) -> None:
        ev.synchronize()
        block = self.blocks[i % 2]
        sink.put(block[:span[1] - span[0]].numpy().data)
        # the next copy into this block is issued only after this write returned (program order)


def _write_file(path: Path, entries: list[tuple[str, torch.Tensor]], chunk: int) -> tuple[str, int]:
    """Write one safetensors file (fsynced); returns its sha256 and size."""
    reader: _DeviceReader | None = None
    with open(path, "wb") as f:
        sink = _Sink(f)
        sink.put(safetensors_header(entries))
        for _, t in entries:
            if t.device.type == "cuda":
                reader = reader or _DeviceReader(t.device, chunk)
                reader.put(t, sink)
                continue
            data = _host_bytes(t)
            for lo in range(0, len(data), chunk):
                sink.put(data[lo:lo + chunk])
        f.flush()
        os.fsync(f.fileno())
    return sink.h.hexdigest(), sink.bytes


def write_state(path: str | Path, state: dict[str, torch.Tensor], *, threads: int | None = None,
                chunk: int = CHUNK_BYTES) -> Written:
    """Write ``state`` into directory ``path`` (which exists) as safetensors files plus their index.

    ``state``'s tensors must not change until this returns (a live state: the caller trains no further step
    meanwhile; otherwise pass a :class:`HostStage` copy). Returns every written file's sha256.

    Raises:
        TypeError: an entry is not a plain tensor (a DTensor: write its local shard under its own name) or
            has a dtype safetensors cannot hold, named.
        OSError: the storage failed (the caller removes the directory).
    """
    t0 = time.perf_counter()
    path = Path(path)
    entries = list(state.items())
    for name, t in entries:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            raise TypeError(f"checkpoint entry {name!r} is a {type(t).__name__}, not a plain tensor")
        if t.dtype not in _DTYPES:
            raise TypeError(f"checkpoint entry {name!r} has dtype {t.dtype}, which safetensors cannot hold")
    threads = threads or writer_threads()
    groups = file_groups([_nbytes(t) for _, t in entries], threads)
    n = len(groups)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="checkpoint-write") as pool:
        futures = [pool.submit(_write_file, path / names[i], [entries[j] for j in g], chunk)
                   for i, g in enumerate(groups)]
        results = [f.result() for f in futures]
    weight_map = {entries[j][0]: names[i] for i, g in enumerate(groups) for j in g}
    payload = sum(_nbytes(t) for _, t in entries)
    index = json.dumps({"metadata": {"total_size": payload}, "weight_map": weight_map}, indent=1).encode()
    with open(path / INDEX_FILE, "wb") as f:
        f.write(index)
        f.flush()
        os.fsync(f.fileno())
    files = {names[i]: digest for i, (digest, _) in enumerate(results)}
    files[INDEX_FILE] = hashlib.sha256(index).hexdigest()
    return Written(files=files, bytes=sum(size for _, size in results), seconds=time.perf_counter() - t0,
                   threads=n)


class StageBusy(RuntimeError):
    """A :class:`HostStage` was to be copied into while the write reading its buffers still runs."""


class HostStage:
    """Host copies of a state for a save written while training goes on, kept from one save to the next
    (the same names, dtypes and shapes reuse their buffer; a CUDA state's are pinned, copied asynchronously
    and waited for once). The write of a copy is lent the buffers (:meth:`lend`) until it ends."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._reader: Future[Any] | None = None

    @property
    def bytes(self) -> int:
        return sum(_nbytes(t) for t in self._buffers.values())

    @property
    def busy(self) -> bool:
        """The write the buffers were lent to still runs."""
        return self._reader is not None and not self._reader.done()

    def lend(self, write: Future[Any]) -> None:
        """``write`` reads the copies :meth:`copy` last returned until it is done; no copy is taken meanwhile."""
        self._reader = write

    def copy(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of ``state``'s tensors, taken now.

        Raises:
            StageBusy: the write the buffers were lent to still runs (wait for it, or skip this save).
        """
        if self.busy:
            raise StageBusy("the host buffers of a checkpoint are still being written; a copy now would put "
                            "another step's state under that checkpoint's checksums")
        out: dict[str, torch.Tensor] = {}
        cuda = None
        for name, t in state.items():
            buf = self._buffers.get(name)
            if buf is None or buf.dtype != t.dtype or buf.shape != t.shape:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
                self._buffers[name] = buf
            buf.copy_(t.detach(), non_blocking=t.device.type == "cuda")
            cuda = t.device if t.device.type == "cuda" else cuda
            out[name] = buf
        for name in set(self._buffers) - set(state):
            del self._buffers[name]
        if cuda is not None:
            torch.cuda.current_stream(cuda).synchronize()
        return out
