"""The training state as one flat byte string: a JSON layout plus the raw bytes of each tensor.

What is in it: the training state of :mod:`unbroken.state.training_state`
(every parameter, the optimizer's whole state and its groups' values, the CPU
RNG state and, on CUDA, the device's). The schedule and the data position need
no bytes: both are pure functions of the step, which the snapshot's seal
records.

Invariants: the layout lists ``[name, dtype, shape, offset, nbytes]`` in one
fixed order, offsets are contiguous from 0, each tensor keeps its own dtype
(bf16 stays bf16), and nothing is pickled. :func:`layout_hash` names the
layout, so bytes written under one model shape are never loaded into another.
"""

from __future__ import annotations

import hashlib
import json
import warnings

import numpy as np
import torch

from unbroken.state.parts import local_of
from unbroken.state.training_state import Restorer, capture as capture_state

__all__ = ["ByteLayout", "StateLoader", "capture", "copy_range", "layout_hash", "tensors_of"]

class ByteLayout:
    """Where each tensor of the flat state lives: ``entries[i] = [name, dtype, shape, offset, nbytes]``."""

    def __init__(self, entries: list[list]) -> None:
        self.entries = entries
        self.nbytes = sum(int(e[4]) for e in entries)

    def to_json(self) -> list[list]:
        return self.entries

    @property
    def hash(self) -> str:
        return layout_hash(self.entries)


def layout_hash(entries: list[list]) -> str:
    """A short, stable name of a layout (names, dtypes, shapes, offsets)."""
    return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()[:16]


def tensors_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The live tensors of the state, by name (views, not copies; read them before the next update). Under
    HSDP a parameter and its moments are this rank's shards (FSDP2's local parts)."""
    return {name: local_of(t) for name, t in capture_state(model, optimizer, device).items()}


def describe(tensors: dict[str, torch.Tensor]) -> ByteLayout:
    """The layout of ``tensors`` (in their dict order)."""
    entries, offset = [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, n])
        offset += n
    return ByteLayout(entries)


def capture(tensors: dict[str, torch.Tensor], out: memoryview, start: int, stop: int) -> None:
    """Copy bytes ``[start, stop)`` of the flat state of ``tensors`` into ``out`` (len ``stop - start``)."""
    dst = torch.frombuffer(out, dtype=torch.uint8) if len(out) else torch.empty(0, dtype=torch.uint8)
    copy_range(tensors, dst, start, stop)


def copy_range(tensors: dict[str, torch.Tensor], dst: torch.Tensor, start: int, stop: int, *,
               non_blocking: bool = False) -> None:
    """Copy bytes ``[start, stop)`` of the flat state of ``tensors`` into the ``uint8`` tensor ``dst``.

    Only the overlapping slice of each tensor is read (a device tensor's slice
    is copied straight off the device; ``non_blocking`` queues that copy on the
    current stream, for a pinned or device ``dst``). A host tensor's bytes (the
    RNG states) bound for a device ``dst`` go through a pinned copy of them and
    are queued too: a copy from pageable memory would make the host wait for
    everything queued on the stream before it.
    """
    offset = 0
    for t in tensors.values():
        n = t.numel() * t.element_size()
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            src = t.detach().reshape(-1).view(torch.uint8)[lo - offset:hi - offset]
            queued = non_blocking and (t.device.type != "cpu" or dst.device.type != "cpu")
            if queued and t.device.type == "cpu":
                src = src.pin_memory()  # a fresh copy: the host tensor may change before the stream reads it
            if t.device.type == "cpu" and dst.device.type == "cpu":
                # numpy's copy, on this thread alone: torch's copy_ of a large tensor starts a team of intra-op
                # threads, and a background thread that has started one keeps it: with the training's team
                # beside it the cores are oversubscribed, and every step of a CPU job ran 30-50 % slower for
                # as long as the snapshot thread lived
                np.copyto(dst[lo - start:hi - start].numpy(), src.numpy())
            else:
                dst[lo - start:hi - start].copy_(src, non_blocking=queued)
        offset += n
        if offset >= stop:
            break


class StateLoader:
    """Loads a flat state (bytes of ``layout``) into a live model and optimizer as its bytes arrive.

    Each range handed to :meth:`write` goes straight into the tensors it covers
    (:class:`~unbroken.state.training_state.Restorer`'s destinations: the
    parameters and the optimizer's state on their device, created where the
    optimizer has none yet), so no copy of the whole state is ever built in
    host memory; :meth:`finish` installs the optimizer's state, its groups'
    values and the RNG states. A sharded optimizer (one with ``load_full``)
    takes its moments whole, at the end.

    Raises:
        ValueError: the layout does not fit the model (a parameter missing or of
            another shape, or a tensor of another dtype).
    """

    def __init__(self, layout: list[list], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device) -> None:
        self.restorer = Restorer(layout, model, optimizer, device)
        into = self.restorer.destinations
        self.targets: list[tuple[int, int, torch.Tensor]] = [
            (int(offset), int(n), into[name].detach().view(-1).view(torch.uint8)) for name, _, _, offset, n in layout]

    def write(self, start: int, data: bytes | bytearray | memoryview) -> None:
        """Bytes ``[start, start + len(data))`` of the flat state into the tensors they belong to."""
        stop = start + len(data)
        if start >= stop:
            return
        with warnings.catch_warnings():  # read only: the buffer is never written through the tensor
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8)
        with torch.no_grad():
            for offset, n, flat in self.targets:
                lo, hi = max(start, offset), min(stop, offset + n)
                if lo < hi:
                    flat[lo - offset:hi - offset].copy_(src[lo - start:hi - start])

    def finish(self) -> None:
        """Install what is not written in place: the optimizer's state and groups, the RNG states."""
        self.restorer.finish()
