"""The inputs of the replica engine: each recovery phase and cost a value with its source and its scaling rule.

An inputs file (``benchmarks/results/cluster_inputs.json``) is a JSON object
``{"inputs": {NAME: INPUT, ...}}``; an ``INPUT`` is an object with

* ``value`` and ``unit``;
* ``source``: where the value comes from: a results file of this project and
  the key read, or a public figure with its citation. An input without one
  is refused: a projection rests on nothing else;
* ``basis``: ``measured`` (this project measured it on the hardware named in
  the source), ``public`` (a published figure), ``fit`` (a measured figure
  carried to another model, device or size by a stated rule) or
  ``assumption`` (nothing measured it: a what-if, said as such);
* ``scaling``: how it grows with the ranks taking part: ``none`` (it does not:
  ``why`` says why) or ``log2`` (``value + per_doubling * log2(ranks /
  at_ranks)``: a tree of that depth, e.g. a view agreed over aggregating
  agents or a communicator built over a tree); ``why`` is required for both.

Invariant: :func:`load_inputs` returns only inputs that name a source, a basis
and a scaling rule; every figure the engine uses is one of them or a rule over
them (:class:`Input.at` gives the value at a rank count).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BASES", "DEFAULT_INPUTS", "REQUIRED", "Input", "load_inputs"]

DEFAULT_INPUTS = Path("benchmarks/results/cluster_inputs.json")

BASES = ("measured", "public", "fit", "assumption")

REQUIRED = {
    "detect_crash_s": "a process's death seen by its peers (sockets closed)",
    "detect_hang_s": "a stopped or lost member seen (heartbeat / progress timeout)",
    "reconfigure_s": "the next view agreed and its process groups built",
    "process_start_warm_s": "a replacement process ready from a warm standby",
    "process_start_cold_s": "a replacement process started cold (fork and model build)",
    "cuda_warm_s": "CUDA context and compiled graphs loaded from the job's cache",
    "cuda_cold_s": "CUDA context and a compile from nothing",
    "load_gbs": "GB/s at which a rank loads its unique share (peer or snapshot memory)",
    "admission_s": "the members' stall when a replica is admitted at a step boundary",
    "job_restart_s": "a whole job started again by its scheduler (processes, communicators, storage restore)",
    "storage_gbs": "GB/s per GPU of persistent storage (checkpoint save and restore)",
    "memory_write_gbs": "GB/s at which a rank writes its share to host memory (in-memory checkpoint)",
    "stage_gbs": "GB/s of the device-to-host staging that blocks a step (asynchronous save)",
    "mfu": "model FLOPs utilisation of a failure-free step",
    "peak_tflops": "peak dense bf16 TFLOP/s of one GPU",
    "overhead_unbroken": "failure-free throughput of unbroken's loop (snapshots on) relative to a plain loop",
    "overhead_drop_step": "failure-free throughput of a per-step-quorum loop without snapshots",
}


@dataclass(frozen=True)
class Input:
    """One input: value, unit, source, basis and how it scales with the ranks taking part."""

    name: str
    value: float
    unit: str
    source: str
    basis: str
    scaling: str
    why: str
    per_doubling: float = 0.0
    at_ranks: float = 1.0

    def at(self, ranks: float) -> float:
        """The value with ``ranks`` ranks taking part (``log2``: never below the measured value)."""
        if self.scaling == "none" or ranks <= self.at_ranks:
            return self.value
        return self.value + self.per_doubling * math.log2(ranks / self.at_ranks)

    def line(self, ranks: float | None = None) -> str:
        """One printable line: name, value (at ``ranks``), basis, source and scaling."""
        v = self.at(ranks) if ranks is not None else self.value
        rule = ("size independent" if self.scaling == "none" else
                f"+{self.per_doubling:g} {self.unit} per doubling of ranks from {self.at_ranks:g}")
        return f"  {self.name:<20} {v:>10.4g} {self.unit:<6} [{self.basis}] {rule}; {self.why} <- {self.source}"


def _input(name: str, d: Any, where: str) -> Input:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: input {name!r} is {d!r}, not an object with value, unit, source, basis, "
                         "scaling and why")
    missing = [k for k in ("value", "unit", "source", "basis", "scaling", "why") if not str(d.get(k, "")).strip()]
    if "source" in missing:
        raise ValueError(f"{where}: input {name!r} has no provenance: give its \"source\" (a results file of this "
                         "project and the key read, or a public figure with its citation); a figure without one "
                         "is not used")
    if missing:
        raise ValueError(f"{where}: input {name!r} lacks {', '.join(missing)}")
    if d["basis"] not in BASES:
        raise ValueError(f"{where}: input {name!r} basis={d['basis']!r}; valid: {', '.join(BASES)}")
    if d["scaling"] not in ("none", "log2"):
        raise ValueError(f"{where}: input {name!r} scaling={d['scaling']!r}; valid: none, log2")
    try:
        value = float(d["value"])
        per, at = float(d.get("per_doubling", 0.0)), float(d.get("at_ranks", 1.0))
    except (TypeError, ValueError):
        raise ValueError(f"{where}: input {name!r}: value, per_doubling and at_ranks must be numbers") from None
    if not (math.isfinite(value) and value >= 0 and per >= 0 and at >= 1):
        raise ValueError(f"{where}: input {name!r}: value={value!r} and per_doubling={per!r} must be finite and "
                         f">= 0, at_ranks={at!r} >= 1")
    if d["scaling"] == "log2" and "per_doubling" not in d:
        raise ValueError(f"{where}: input {name!r} scales by log2 but gives no per_doubling")
    return Input(name, value, str(d["unit"]), str(d["source"]), str(d["basis"]), str(d["scaling"]), str(d["why"]),
                 per, at)


def load_inputs(path: Path = DEFAULT_INPUTS, overrides: dict[str, Input] | None = None) -> dict[str, Input]:
    """The inputs of ``path`` (every one of :data:`REQUIRED`), then ``overrides`` on top.

    Raises:
        ValueError: the file is not readable JSON, an input lacks its source (provenance), basis, scaling or
            a number, or a required input is missing.
    """
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--inputs {path}: not a readable JSON file ({exc})") from exc
    raw = d.get("inputs") if isinstance(d, dict) else None
    if not isinstance(raw, dict):
        raise ValueError(f"--inputs {path}: no \"inputs\" object (NAME: {{value, unit, source, basis, scaling, why}})")
    out = {name: _input(name, v, f"--inputs {path}") for name, v in raw.items()}
    out.update(overrides or {})
    missing = [n for n in REQUIRED if n not in out]
    if missing:
        raise ValueError(f"--inputs {path}: missing {', '.join(missing)} "
                         f"({'; '.join(f'{n}: {REQUIRED[n]}' for n in missing)})")
    return out
