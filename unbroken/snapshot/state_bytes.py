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

import torch

from unbroken.runtime.checkpoint import load_training_state, training_state

__all__ = ["StateLayout", "capture", "layout_hash", "load_into", "tensors_of"]

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
    """The live tensors of the state, by name (views, not copies; read them before the next update)."""
    state = training_state(model, optimizer)
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
    """Copy bytes ``[start, stop)`` of the flat state of ``tensors`` into ``out`` (len ``stop - start``).

    Reads each tensor once, on the host (a device tensor is copied to the host first).
    """
    offset = 0
    dst = torch.frombuffer(out, dtype=torch.uint8) if len(out) else torch.empty(0, dtype=torch.uint8)
    for t in tensors.values():
        n = t.numel() * t.element_size()
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            src = t.detach()
            if src.device.type != "cpu":
                src = src.cpu()
            flat = src.contiguous().reshape(-1).view(torch.uint8)
            dst[lo - start:hi - start].copy_(flat[lo - offset:hi - offset])
        offset += n
        if offset >= stop:
            break


def load_into(data: bytes | memoryview, layout: list[list], model: torch.nn.Module,
              optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Load a whole flat state (bytes of ``layout``) into ``model``, ``optimizer`` and the RNGs.

    Raises:
        ValueError: the layout does not fit the model (a parameter missing or of another shape).
    """
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    state: dict[str, torch.Tensor] = {}
    for name, dtype, shape, offset, n in layout:
        if dtype not in _DTYPES:
            raise ValueError(f"snapshot tensor {name!r} has unsupported dtype {dtype!r}")
        state[name] = raw[offset:offset + n].view(_DTYPES[dtype]).reshape(shape)
    params = dict(model.named_parameters())
    for name, p in params.items():
        got = state.get(f"model.{name}")
        if got is None or tuple(got.shape) != tuple(p.shape):
            raise ValueError(f"snapshot does not fit the model: parameter {name!r} "
                             f"{'missing' if got is None else f'has shape {tuple(got.shape)}, model {tuple(p.shape)}'}")
    load_training_state(state, model, optimizer)
    if "rng.cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["rng.cuda"].clone(), device)
