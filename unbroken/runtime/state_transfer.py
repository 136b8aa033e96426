"""Training state streamed to a joining worker, tensor by tensor, in bounded chunks.

What crosses: the training state of :mod:`unbroken.state.training_state`,
the same entries a snapshot or a checkpoint holds (every parameter, the
optimizer's whole state and its groups' values, the CPU RNG state and, on
CUDA, the RNG state of the group's device). The data position needs no
transfer: batches are a pure function of the step, which the joiner reads from
its view.

How (:func:`transfer_state`): the source first broadcasts a header (JSON bytes,
no pickle: every entry's name, dtype, shape and whether it lives on the group's
device), so that a receiver whose optimizer holds no state yet creates it
where the source keeps it. Then every tensor crosses as its raw bytes, in its
own dtype, on the group's device:

- a contiguous tensor on the group's device of at least ``DIRECT_MIN_BYTES``
  goes *in place*, in slices of at most ``chunk_bytes`` (the source sends views
  of its tensor; a receiver receives each slice into the stream's buffer and
  copies it into its own tensor once the broadcast completed, so a broadcast
  it gave up on, whose source comes back later, never writes its state);
- everything else (norm gains, step counters, numbers, RNG states; tensors
  kept on the host while the group is on a GPU) is packed into one staging
  buffer of at most ``chunk_bytes`` on the group's device.

Sharded parameters (FSDP2's DTensors, inside an HSDP replica) cross as their
local shards, and so does their optimizer state: rank ``i`` of a live replica
sends shard ``i`` to rank ``i`` of a joining one, over the group of shard
index ``i``; a receiver without optimizer state yet gets DTensors laid out as
its parameters.

Roles: the source sends; receivers (joiners) write into their own tensors; the
other members take part in each broadcast (a group broadcast needs every rank)
through a scratch chunk and keep their state untouched.

Invariants: the state arrives bit-exact; no full copy of the state is ever
made, so the extra memory is one chunk (plus the header) on each side; no
receive is ever posted into a live tensor of the state; all
ranks derive the same sequence of broadcasts from the header alone; a
receiver's state is defined only once the call has returned (an interrupted
transfer is simply redone: loading twice is harmless).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import torch

from unbroken.state.parts import local_of
from unbroken.state.training_state import Restorer, capture

__all__ = ["CHUNK_BYTES", "DIRECT_MIN_BYTES", "Broadcast", "TransferStats", "transfer_state"]

CHUNK_BYTES = 64 << 20
"""The largest single broadcast of the state, and the size of the staging buffer."""

DIRECT_MIN_BYTES = 1 << 20
"""Tensors at least this large on the group's device cross in place; smaller ones are packed together."""

Broadcast = Callable[[torch.Tensor, int], object]
"""``broadcast(tensor, src)``: in place over the group, e.g.
:meth:`~unbroken.runtime.process_group.ViewGroup.broadcast_into` with the caller's check bound."""


@dataclass
class TransferStats:
    """What one :func:`transfer_state` call moved (the header not counted)."""

    broadcasts: int = 0
    bytes: int = 0
    largest: int = 0
    """The largest single broadcast, in bytes (at most ``chunk_bytes``)."""
    buffer_bytes: int = 0
    """Size of the staging buffer this rank allocated (0: none)."""


def transfer_state(broadcast: Broadcast, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                   src: int, rank: int, receive: bool, device: torch.device,
                   chunk_bytes: int = CHUNK_BYTES) -> TransferStats:
    """Send the training state from group rank ``src`` to every rank with ``receive`` set.

    Every rank of the group calls this with the same ``src`` and ``chunk_bytes``.

    Args:
        broadcast: in-place broadcast over the group (see :data:`Broadcast`).
        rank: this process's rank in the group; ``rank == src`` sends.
        receive: load the state into ``model``, ``optimizer`` and the RNGs.
        device: the group's device (where every broadcast tensor lives).
        chunk_bytes: the largest single broadcast.

    Raises:
        ValueError: the state was made for a different model, or bad arguments.
        StateNotCapturable: the source's optimizer keeps a value the schema cannot hold.
        Whatever ``broadcast`` raises (a collective that failed or was abandoned).
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes}: need at least 1")
    send = rank == src
    if send and receive:
        raise ValueError(f"rank {rank} is the source and cannot receive its own state")
    state = {name: local_of(t) for name, t in capture(model, optimizer, device).items()} if send else None
    header = _header(broadcast, src, device, _describe(state, model, device) if state is not None else None)
    _check_model(header, model, device)
    entries = header["entries"]
    plan = [(_nbytes(dtype, shape), direct and _nbytes(dtype, shape) >= DIRECT_MIN_BYTES)
            for _, dtype, shape, direct in entries]
    restorer = None
    if state is not None:
        tensors: list[torch.Tensor] | None = [state[name] for name, *_ in entries]
    elif receive:
        on_device = {name for name, _, _, direct in entries if direct}
        restorer = Restorer([e[:3] for e in entries], model, optimizer, device, on_device=on_device)
        into = restorer.destinations
        tensors = [into[name] for name, *_ in entries]
    else:
        tensors = None
    stats = _Stream(broadcast, src, device, chunk_bytes, plan).run(tensors, send)
    if restorer is not None:
        restorer.finish()
    return stats


# -- header ---------------------------------------------------------------------


def _describe(state: dict[str, torch.Tensor], model: torch.nn.Module, device: torch.device) -> dict[str, list]:
    """The source's header: every entry of the state (:mod:`unbroken.state.training_state`: its name, dtype,
    this rank's shape, and whether it lives on the group's device, contiguous), in the stream's order."""
    params = {f"model.{name}" for name, _ in model.named_parameters()}
    entries = []
    for name, t in state.items():
        on_device = t.device.type == device.type and t.is_contiguous() and not name.startswith(("rng.", "group."))
        entries.append([name, _dtype_name(t.dtype), list(t.shape), on_device or name in params])
    return {"entries": entries}


def _header(broadcast: Broadcast, src: int, device: torch.device, header: dict | None) -> dict:
    """Broadcast the header from ``src`` (length, then JSON bytes); every rank returns it."""
    if header is not None:
        raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(device)
        length = torch.tensor([raw.numel()], dtype=torch.int64, device=device)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=device)
    broadcast(length, src)
    if header is None:
        raw = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    broadcast(raw, src)
    return json.loads(bytes(raw.cpu().numpy()).decode())


def _check_model(header: dict, model: torch.nn.Module, device: torch.device) -> None:
    params = list(model.named_parameters())
    theirs = [[name[len("model."):], dtype, shape] for name, dtype, shape, _ in header["entries"]
              if name.startswith("model.")]
    mine = [[name, _dtype_name(p.dtype), list(local_of(p).shape)] for name, p in params]
    if mine != theirs:
        raise ValueError(f"state of {len(theirs)} parameters does not match this model "
                         f"({len(mine)} parameters, or different names, shapes or dtypes, or another shard)")
    off = [name for name, p in params if local_of(p).device.type != device.type or not local_of(p).is_contiguous()]
    if off:
        raise ValueError(f"parameters {off[:5]} are not contiguous on the group's device {device}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _nbytes(dtype: str, shape: list[int]) -> int:
    n = getattr(torch, dtype).itemsize
    for s in shape:
        n *= s
    return n


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t``'s storage (writing into it writes ``t``)."""
    return t.detach().reshape(-1).view(torch.uint8)


# -- the stream -------------------------------------------------------------------


class _Stream:
    """Runs the plan: in-place slices and packed staging chunks, the same broadcasts on every rank."""

    def __init__(self, broadcast: Broadcast, src: int, device: torch.device, chunk_bytes: int,
                 plan: list[tuple[int, bool]]) -> None:
        self.broadcast, self.src, self.device, self.chunk, self.plan = broadcast, src, device, chunk_bytes, plan
        self.stats = TransferStats()
        self._buf: torch.Tensor | None = None
        self._pending: list[tuple[int, int, int]] = []  # (tensor index, byte offset, bytes)
        self._fill = 0

    def run(self, tensors: list[torch.Tensor] | None, send: bool) -> TransferStats:
        """``tensors``: the source's or a receiver's, in plan order; None: receive into scratch."""
        self.tensors, self.send = tensors, send
        for i, (nbytes, direct) in enumerate(self.plan):
            if direct:
                for a in range(0, nbytes, self.chunk):
                    n = min(self.chunk, nbytes - a)
                    if send:
                        assert tensors is not None  # a source sends its own
                        self._cast(_bytes_of(tensors[i])[a:a + n])
                        continue
                    # Into this stream's own buffer, into the state only once the broadcast completed: a
                    # broadcast given up on (its source judged dead) stays posted in its parked group, and
                    # whatever arrives later lands in that buffer, never in a tensor trained on since.
                    buf = self._buffer()[:n]
                    self._cast(buf)
                    if tensors is not None:
                        _bytes_of(tensors[i])[a:a + n].copy_(buf)
            else:
                self._pack(i, nbytes)
        self._flush()
        return self.stats

    def _pack(self, i: int, nbytes: int) -> None:
        a = 0
        while a < nbytes:
            n = min(nbytes - a, self.chunk - self._fill)
            self._pending.append((i, a, n))
            self._fill += n
            a += n
            if self._fill == self.chunk:
                self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        buf = self._buffer()
        if self.send:
            assert self.tensors is not None  # a source sends its own
            pos = 0
            for i, a, n in self._pending:
                buf[pos:pos + n].copy_(_bytes_of(self.tensors[i])[a:a + n])
                pos += n
        self._cast(buf[:self._fill])
        if self.tensors is not None and not self.send:
            pos = 0
            for i, a, n in self._pending:
                _bytes_of(self.tensors[i])[a:a + n].copy_(buf[pos:pos + n])
                pos += n
        self._pending, self._fill = [], 0

    def _buffer(self) -> torch.Tensor:
        """The one staging/scratch chunk, sized for the largest use this stream has of it."""
        if self._buf is None:
            packed = sum(n for n, direct in self.plan if not direct)
            scratch = max((n for n, direct in self.plan if direct), default=0) if not self.send else 0
            size = min(self.chunk, max(packed, scratch))
            self._buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.stats.buffer_bytes = size
        return self._buf

    def _cast(self, t: torch.Tensor) -> None:
        self.broadcast(t, self.src)
        self.stats.broadcasts += 1
        self.stats.bytes += t.numel()
        self.stats.largest = max(self.stats.largest, t.numel())
