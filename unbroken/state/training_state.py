"""The training state: one schema for every path it takes (checkpoints, snapshots, state transfer, restores).

A flat, ordered map of names to tensors, views of the live ones where they exist (:func:`capture`)::

    model.<param>             every parameter, in ``model.named_parameters()`` order
    optim.<param>.<key>       each tensor of the optimizer's state of that parameter (keys sorted)
    optim.<param>.<key>=<t>   each number of that state (``t``: int, float, bool), as a 0-d tensor
    group.<i>.<key>           a tensor value of the optimizer's param group ``i``
    group.<i>.<key>=<t>       a number of that group (int, float), or a tuple of numbers (``tuple``: a 1-d
                              float64 tensor, int64 if they are all ints)
    rng.cpu, rng.cuda         the RNG states (``rng.cuda``: on a CUDA device)

Every optimizer's state is captured this way, whatever its keys (AdamW's
moments and step, SGD's momentum buffer, AMSGrad's ``max_exp_avg_sq``, a
user's own), and so are its param groups' values that can change as it trains
(a learning rate the schedule sets, an adaptive optimizer's estimates kept
there). ``None`` values are left out (an optimizer reads a missing key as
``None``), and so are strings and a group's bools, which are configuration
(``foreach``, ``fused``, ``amsgrad``...: the same in every worker of a job,
which the same factory built, and a device's own choice on resume). Anything else (a list, a dict, an object)
cannot be captured: :func:`check_capturable` names it, and the worker calls it
at its start and after its first optimizer step, before any snapshot,
checkpoint or transfer could leave it out. The data position needs no entry:
batches are a pure function of the step, which every path records beside the
state.

Restoring (:class:`Restorer`): a destination for every entry of a layout,
into which the bytes are written (by a snapshot's loader, a checkpoint's
reader, a transfer's stream): the live parameter; a tensor of the optimizer's
state (the optimizer's own when it has one of that dtype and shape, else a new
one where the optimizer keeps it: a step count on the host unless the
optimizer is fused or capturable, anything else on the parameter's device and
laid out as the parameter); a host tensor for numbers, group values and RNG
states. :meth:`Restorer.finish` installs the optimizer's state (each entry bit
for bit, no cast), the group values and the RNG states.

Invariants: two workers with the same model, optimizer and step lay their
state out alike (names, order, dtypes, shapes); capture then restore is
bit-exact; nothing is pickled.
"""

from __future__ import annotations

from typing import Any

import torch

from unbroken.state.parts import is_sharded, laid_out_as, local_of, local_part

__all__ = ["Restorer", "StateNotCapturable", "capture", "check_capturable", "layout_of",
           "step_device"]

class StateNotCapturable(ValueError):
    """An optimizer keeps a value the schema cannot hold (the message names it and what can be held)."""


def step_device(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.device:
    """Where an optimizer keeps ``p``'s step count (a 0-d state tensor): on the parameter's device when fused or
    capturable, else the host."""
    on_device = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    return local_of(p).device if on_device else torch.device("cpu")


def _number(value: Any) -> tuple[str, torch.Tensor] | None:
    """``(type, tensor)`` of a number, or of a tuple of numbers; None for anything else."""
    if isinstance(value, bool):
        return "bool", torch.tensor(value, dtype=torch.bool)
    if isinstance(value, int):
        return "int", torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return "float", torch.tensor(value, dtype=torch.float64)
    if isinstance(value, (tuple, list)) and value and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        ints = all(isinstance(v, int) for v in value)
        return "tuple", torch.tensor(list(value), dtype=torch.int64 if ints else torch.float64)
    return None


def _entries(where: str, key: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    """The schema's entries for one value (none for ``None`` and strings, nor for a group's bools).

    Raises:
        StateNotCapturable: a value of any other kind.
    """
    if value is None or isinstance(value, str) or (isinstance(value, bool) and where.startswith("group.")):
        return []
    if torch.is_tensor(value):
        return [(f"{where}.{key}", value.detach())]
    number = _number(value)
    if number is None:
        raise StateNotCapturable(
            f"{where}.{key} is a {type(value).__name__}: the training state holds tensors, numbers, bools and "
            f"tuples of numbers only, so snapshots, checkpoints and rejoins would lose it; keep it as a tensor "
            f"(or a number) in the optimizer's state")
    kind, tensor = number
    return [(f"{where}.{key}={kind}", tensor)]


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The training state by name (see the module docstring): views of the live tensors, numbers as new 0-d
    tensors. Parameters and their state are whole (a DTensor under HSDP: :func:`local_of` gives its shard).
    ``device``: the CUDA device whose RNG state is taken too.

    Raises:
        StateNotCapturable: the optimizer keeps a value the schema cannot hold.
    """
    state: dict[str, torch.Tensor] = {}
    params = list(model.named_parameters())
    for name, p in params:
        state[f"model.{name}"] = p.detach()
    for name, p in params:
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            state.update(_entries(f"optim.{name}", key, value))
    for i, group in enumerate(optimizer.param_groups):
        for key, value in sorted(group.items()):
            if key != "params":
                state.update(_entries(f"group.{i}", key, value))
    state["rng.cpu"] = torch.get_rng_state()
    if device is not None and device.type == "cuda":
        state["rng.cuda"] = torch.cuda.get_rng_state(device)
    return state


def check_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`StateNotCapturable` if any value of the optimizer's state or param groups cannot be held by
    the schema (called at a worker's start and after its first optimizer step)."""
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key != "params":
                _entries(f"group.{i}", key, value)
    for st in optimizer.state.values():
        for key, value in st.items():
            _entries(f"optim.<{type(optimizer).__name__}>", key, value)


def layout_of(state: dict[str, torch.Tensor]) -> list[list]:
    """``[name, dtype, whole shape]`` of every entry, in order (what a checkpoint's commit records)."""
    return [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in state.items()]


def _split(name: str) -> tuple[str, str | None]:
    """``(name without its number type, the type)``: ``("optim.w.step", "int")`` for ``optim.w.step=int``."""
    base, _, kind = name.partition("=")
    return base, kind or None


class Restorer:
    """Where each entry of a layout goes when the state is restored (see the module docstring).

    Args:
        layout: ``[name, dtype, shape, ...]`` per entry: the shape of this rank's part under HSDP when
            ``local``, else the whole shape; further fields are ignored.
        model, optimizer: what the state is restored into (a sharded optimizer with ``load_full``, ZeRO-1's,
            takes its moments whole at :meth:`finish`).
        device: the worker's device (``rng.cuda`` is set on it).
        local: the bytes of each entry are written straight into :attr:`destinations` (a snapshot, a
            transfer: this rank's parts); else each entry is handed to :meth:`load`, whole or as this rank's
            part (a checkpoint).
        on_device: entries (names) the source keeps on its parameter's device (a transfer's header says);
            None: the optimizer's rule (:func:`step_device` for a 0-d tensor, the parameter's device else).

    Raises:
        ValueError: the layout does not fit the model (a parameter missing, or of another shape or dtype).
    """

    def __init__(self, layout: list[list], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, *, local: bool = True, on_device: set[str] | None = None) -> None:
        self.model, self.optimizer, self.device, self.local = model, optimizer, device, local
        self.params = dict(model.named_parameters())
        self.targets: dict[str, torch.Tensor] = {}
        """Entry name -> the tensor it ends up in (a live parameter, a tensor of the optimizer's state, a host
        tensor for the rest)."""
        self._state: dict[str, dict[str, Any]] = {}  # parameter name -> key -> the tensor it will hold
        names = {entry[0] for entry in layout}
        for name in self.params:
            if f"model.{name}" not in names:
                raise ValueError(f"the state does not fit the model: parameter {name!r} missing")
        sharded_optimizer = hasattr(optimizer, "load_full")
        for name, dtype_name, shape, *_ in layout:
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"state entry {name!r} has unsupported dtype {dtype_name!r}")
            self.targets[name] = self._target(name, dtype, list(shape), sharded_optimizer, on_device)

    @property
    def destinations(self) -> dict[str, torch.Tensor]:
        """Entry name -> the tensor its bytes are written into (this rank's part of a parameter or moment)."""
        return {name: local_of(t) for name, t in self.targets.items()}

    def _target(self, name: str, dtype: torch.dtype, shape: list[int], sharded_optimizer: bool,
                on_device: set[str] | None) -> torch.Tensor:
        base, kind = _split(name)
        section, _, rest = base.partition(".")
        if section == "model":
            p = self.params.get(rest)
            if p is None:
                raise ValueError(f"the state does not fit the model: it holds parameter {rest!r}, the model not")
            have = local_of(p) if self.local else p
            if have.dtype != dtype or list(have.shape) != shape:
                raise ValueError(f"the state does not fit the model: {name!r} is {str(dtype)[6:]} {tuple(shape)}, "
                                 f"the parameter {str(have.dtype)[6:]} {tuple(have.shape)}")
            return p.detach()
        if section == "optim" and kind is None and not sharded_optimizer:
            pname, key = rest.rsplit(".", 1)
            p = self.params.get(pname)
            if p is None:
                raise ValueError(f"the state does not fit the model: optimizer state of unknown parameter {pname!r}")
            return self._moment(p, pname, key, dtype, shape, on_device is not None and name in on_device,
                                on_device is None)
        return torch.empty(shape, dtype=dtype)  # numbers, group values, RNG states, a sharded optimizer's moments

    def _moment(self, p: torch.Tensor, pname: str, key: str, dtype: torch.dtype, shape: list[int],
                on_param: bool, by_rule: bool) -> torch.Tensor:
        """The tensor of ``p``'s optimizer state entry ``key`` ends up in: the optimizer's own if it fits, else
        a new one where the optimizer keeps it (laid out as ``p`` when shaped as ``p``)."""
        like_param = bool(shape) and shape == list((local_of(p) if self.local else p).shape)
        if by_rule:
            where = step_device(self.optimizer, p) if not shape else local_of(p).device
        else:
            where = local_of(p).device if on_param else torch.device("cpu")
        part = list(local_of(p).shape) if like_param else shape
        laid_out = like_param and where == local_of(p).device  # a moment of a sharded parameter: a DTensor too
        have = self.optimizer.state.get(p, {}).get(key)
        if not (torch.is_tensor(have) and have.dtype == dtype and list(local_of(have).shape) == part
                and local_of(have).device == where and local_of(have).is_contiguous()
                and is_sharded(have) == (laid_out and is_sharded(p))):
            fresh = torch.empty(part, dtype=dtype, device=where)
            have = laid_out_as(p, fresh) if laid_out else fresh
        self._state.setdefault(pname, {})[key] = have
        return have

    def load(self, name: str, t: torch.Tensor, *, part: bool = False) -> None:
        """Entry ``name`` from ``t``: the whole tensor, or (``part``) already this rank's part of it."""
        target = self.targets[name]
        with torch.no_grad():
            local_of(target).copy_(t if part else local_part(t, target))

    def finish(self) -> None:
        """Install what is not written in place: the optimizer's state and numbers (a sharded optimizer's
        moments whole), the group values, the RNG states."""
        if hasattr(self.optimizer, "load_full"):  # ZeRO-1's optimizer: flat moments, per-parameter steps
            got = self.targets
            self.optimizer.load_full({name: (got.get(f"optim.{name}.exp_avg"), got.get(f"optim.{name}.exp_avg_sq"),
                                             got.get(f"optim.{name}.step")) for name in self.params})
        else:
            numbers: dict[str, dict[str, Any]] = {}
            for name, t in self.targets.items():
                base, kind = _split(name)
                if base.startswith("optim.") and kind is not None:
                    pname, key = base[len("optim."):].rsplit(".", 1)
                    numbers.setdefault(pname, {})[key] = _value(t, kind)
            for pname, p in self.params.items():
                keys = {**self._state.get(pname, {}), **numbers.get(pname, {})}
                if keys:
                    self.optimizer.state[p] = keys
                else:
                    self.optimizer.state.pop(p, None)
        for name, t in self.targets.items():
            base, kind = _split(name)
            if base.startswith("group."):
                _, index, key = base.split(".", 2)
                group, value = self.optimizer.param_groups[int(index)], _value(t, kind)
                have = group.get(key)
                if kind is None and torch.is_tensor(have) and have.shape == value.shape and have.dtype == value.dtype:
                    with torch.no_grad():
                        have.copy_(value)  # a tensor value (a capturable learning rate) stays where it lives
                else:
                    group[key] = value
        torch.set_rng_state(self.targets["rng.cpu"].clone())
        if "rng.cuda" in self.targets and self.device.type == "cuda":
            torch.cuda.set_rng_state(self.targets["rng.cuda"].clone(), self.device)


def _value(t: torch.Tensor, kind: str | None) -> Any:
    """A group's or the state's value back from its entry: the tensor itself, or the Python number it holds."""
    if kind is None:
        return t
    if kind == "tuple":
        return tuple(t.tolist())
    return {"int": int, "float": float, "bool": bool}[kind](t.item())
