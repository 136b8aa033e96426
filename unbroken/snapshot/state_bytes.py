"""The training state as one flat byte string: a JSON layout plus the raw bytes of each tensor.

What is in it: every trainable parameter, its AdamW state (``exp_avg``,
``exp_avg_sq``, ``step``), the CPU RNG state and, on CUDA, the device's RNG
state: the names of :func:`unbroken.runtime.checkpoint.training_state`. The
schedule and the data position need no bytes: both are pure functions of the
step, which the snapshot's seal records.

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

from unbroken.runtime.checkpoint import ADAM_KEYS, step_device, training_state
from unbroken.sharding.parts import laid_out_as, local_of

__all__ = ["StateLayout", "StateLoader", "capture", "copy_range", "layout_hash", "tensors_of"]

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.int8,
    torch.bool)}


class StateLayout:
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
    state = {name: local_of(t) for name, t in training_state(model, optimizer).items()}
    if device is not None and device.type == "cuda":
        state["rng.cuda"] = torch.cuda.get_rng_state(device)
    return state


def describe(tensors: dict[str, torch.Tensor]) -> StateLayout:
    """The layout of ``tensors`` (in their dict order)."""
    entries, offset = [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, n])
        offset += n
    return StateLayout(entries)


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

    Each range handed to :meth:`write` goes straight into the tensors it
    covers (parameters and AdamW moments on their device, created where the
    optimizer has none yet), so no copy of the whole state is ever built in
    host memory; the RNG states are set by :meth:`finish`. A sharded
    optimizer (one with ``load_full``) takes its moments whole, at the end.

    Raises:
        ValueError: the layout does not fit the model (a parameter missing or of
            another shape, or a tensor of another dtype).
    """

    def __init__(self, layout: list[list], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        live = self._live(layout, model, optimizer)
        self.targets: list[tuple[int, int, torch.Tensor]] = []
        self.host: dict[str, torch.Tensor] = {}
        for name, dtype, shape, offset, n in layout:
            if dtype not in _DTYPES:
                raise ValueError(f"snapshot tensor {name!r} has unsupported dtype {dtype!r}")
            t = live.get(name)
            if t is None:  # an RNG state, a sharded optimizer's moments: on the host, applied by finish()
                t = self.host[name] = torch.empty(shape, dtype=_DTYPES[dtype])
            elif t.dtype != _DTYPES[dtype] or tuple(t.shape) != tuple(shape):
                raise ValueError(f"snapshot does not fit the model: {name!r} is {dtype} {tuple(shape)}, "
                                 f"the live tensor {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}")
            self.targets.append((int(offset), int(n), t.detach().view(-1).view(torch.uint8)))

    @staticmethod
    def _live(layout: list[list], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """The live tensors the layout's parameters and moments load into (moments created if absent)."""
        names = {name for name, *_ in layout}
        params = dict(model.named_parameters())
        for name, p in params.items():
            if f"model.{name}" not in names:
                raise ValueError(f"snapshot does not fit the model: parameter {name!r} missing")
        live = {f"model.{name}": local_of(p) for name, p in params.items()}  # HSDP: this rank's shards
        if hasattr(optimizer, "load_full"):
            return live
        shapes = {name: (dtype, shape) for name, dtype, shape, *_ in layout}
        for name, p in params.items():
            keys = [k for k in ADAM_KEYS if f"optim.{name}.{k}" in names]
            if not keys:
                continue
            st = optimizer.state[p]
            for k in keys:
                dtype, shape = shapes[f"optim.{name}.{k}"]
                have = local_of(st[k]) if torch.is_tensor(st.get(k)) else None
                if have is None or have.dtype != _DTYPES.get(dtype) or tuple(have.shape) != tuple(shape):
                    where = step_device(optimizer, p) if k == "step" else local_of(p).device
                    fresh = torch.zeros(shape, dtype=_DTYPES[dtype], device=where)
                    st[k] = fresh if k == "step" else laid_out_as(p, fresh)  # a moment is laid out as its parameter
                live[f"optim.{name}.{k}"] = local_of(st[k])
        return live

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
        """Set what is not written in place: the RNG states (and a sharded optimizer's moments)."""
        params = dict(self.model.named_parameters())
        if hasattr(self.optimizer, "load_full"):
            self.optimizer.load_full({name: (self.host.get(f"optim.{name}.exp_avg"),
                                             self.host.get(f"optim.{name}.exp_avg_sq"),
                                             self.host.get(f"optim.{name}.step")) for name in params})
        torch.set_rng_state(self.host["rng.cpu"].clone())
        if "rng.cuda" in self.host and self.device.type == "cuda":
            torch.cuda.set_rng_state(self.host["rng.cuda"].clone(), self.device)


