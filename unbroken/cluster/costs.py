"""Component costs of the cluster simulator, read from benchmark JSON files and scaled to a target model.

Every figure the simulator uses is a :class:`Figure`: a value, its unit and
where it came from (a benchmark file and the key read, a command-line
parameter, or a scaling rule applied to a measured figure). Nothing here is a
constant of the code: the measured figures come from the JSON files that
``unbroken bench failover``, ``unbroken bench snapshot`` and ``unbroken bench
mecefo-cost`` write (default: every ``*.json`` under ``benchmarks/results/``);
what describes the target cluster (GPU speed, bandwidths) is a parameter.

Which file serves which figure
------------------------------
* ``failover`` (a file with a ``failures`` part): detection + stall per crash
  and per hang, time back to full strength with a warm standby and with a
  cold start, and the members' stall when a worker is admitted: each the
  median of all samples in every such file of the chosen preset. A ``failover`` file with only an ``overhead``
  part gives the protocol's failure-free overhead (median of the ratios of the
  files of the preset nearest the target).
* ``snapshot``: state bytes, one worker's snapshot write time and the time it
  added to a step, the time DCP's asynchronous save added to a step, restore
  from own memory and from a DCP checkpoint, seconds from a whole-job kill to
  the next step through snapshot memory.
* ``mecefo_cost`` (``cost`` + ``method``): FLOPs of an approximated
  micro-batch relative to an exact one, and the amortised SVD per step.

When several files give a figure, the one measured on the preset nearest the
target in parameter count is used (ties: the larger model).

Scaling rules (measured model ``m`` -> target ``t``)
----------------------------------------------------
``S`` is the bytes of the training state (fp32 parameters and both AdamW
moments, :func:`unbroken.snapshot.capacity.state_bytes`), ``P`` the parameter
count, both computed from the presets; ``G`` the data-parallel workers.

* detection, stall per crash / hang, warm / cold process start-up: size
  independent (timeouts and process start-up), used as measured;
* failure-free step time: ``6 * P_t * tokens_per_worker / (gpu_flops * mfu)``,
  or ``--step-s``; the measured CPU step times are never scaled to a GPU;
* protocol overhead: an absolute time per step (a store round trip), ``(ratio
  - 1) * measured step``, added to the target's step;
* snapshot: each worker writes its unique slice ``S_t / G`` (times the parity
  factor ``g / (g - 1)``, ``g`` the nodes of the largest coding group of
  ``N = G / workers_per_node`` nodes: ``N`` up to 16, ``snapshot.group_nodes``'
  default) at the
  measured per-worker write rate ``S_m / (4 * write_s)`` (or ``--snapshot-gbs``);
  the share of that write that lands on the step is the measured
  ``added_s / write_s`` (at most 1);
* persistent checkpoint: the blocking part of a save of ``S_t / G`` bytes per
  worker at the measured rate ``S_m / dcp_added_s`` (or ``--ckpt-gbs``);
* restore: ``S_t / G`` bytes at the measured rates ``S_m / own_memory_s`` and
  ``S_m / dcp_disk_s`` (or ``--disk-gbs``);
* rejoin: measured time back (warm or cold) plus the transfer of the extra
  state ``S_t - S_m`` from a peer at ``--net-gbs``; the members' stall at an
  admission likewise (the transfer is part of it);
* takeover: FLOPs ratios of the measured preset nearest the target (they
  depend on the model's shape, not on the cluster).

A file measured on a model whose parameter count cannot be computed (not a
preset) has no scaling rule: :func:`load_costs` refuses it unless the target
is that same model.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Figure", "MeasuredCosts", "default_cost_files", "load_costs", "model_size"]

logger = logging.getLogger(__name__)

DEFAULT_RESULTS_DIR = Path("benchmarks/results")


@dataclass(frozen=True)
class Figure:
    """One cost figure: value, unit and provenance (file and key, parameter, or rule)."""

    value: float
    unit: str
    source: str

    def __str__(self) -> str:
        return f"{self.value:.6g} {self.unit}  <- {self.source}"


@dataclass
class MeasuredCosts:
    """The figures read from benchmark files, each with its file and key; ``preset`` per figure group."""

    figures: dict[str, Figure] = field(default_factory=dict)
    presets: dict[str, str] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)

    def get(self, name: str) -> Figure:
        """The figure ``name``; ValueError naming the benchmark that writes it when no file gave it."""
        if name not in self.figures:
            raise ValueError(f"no costs file gave {name!r}; run the benchmark that measures it "
                           f"({_WRITER.get(name.split('.')[0], 'unbroken bench ...')}) and pass its JSON with --costs")
        return self.figures[name]


_WRITER = {"failover": "unbroken bench failover", "snapshot": "unbroken bench snapshot",
           "mecefo": "unbroken bench mecefo-cost", "protocol": "unbroken bench failover --parts overhead"}


def model_size(preset: str) -> tuple[int, int]:
    """``(parameters, state bytes)`` of a named preset, computed without building the model.

    Raises:
        ValueError: ``preset`` is not a known preset (its size cannot be computed).
    """
    from unbroken.config import load_config
    from unbroken.models.llama import count_parameters, model_args
    from unbroken.snapshot.capacity import state_bytes

    try:
        cfg = load_config(preset_name=preset)
    except ValueError as exc:
        raise ValueError(f"model {preset!r}: its size cannot be computed ({exc})") from exc
    return count_parameters(model_args(cfg.model.preset, vocab_size=cfg.data.vocab_size)), state_bytes(cfg)


def default_cost_files(results_dir: Path = DEFAULT_RESULTS_DIR) -> list[Path]:
    """Every ``*.json`` under ``results_dir`` (the benchmarks' default output folder), sorted."""
    return sorted(results_dir.glob("*.json"))


def _kind(d: dict[str, Any]) -> str:
    if d.get("benchmark") == "failover":
        return "failover" if "failures" in d else ("protocol" if "overhead" in d else "other")
    if d.get("benchmark") == "snapshot":
        return "snapshot"
    if "cost" in d and "method" in d:
        return "mecefo"
    return "other"


def load_costs(paths: list[Path], target: str) -> MeasuredCosts:
    """Read the figures of ``paths`` for a simulation of model ``target``.

    Raises:
        ValueError: a file is not JSON or not readable, or was measured on a model whose size cannot
            be computed (no scaling rule) while the target is another model.
    """
    p_target = model_size(target)[0]
    groups: dict[str, list[tuple[str, Path, dict[str, Any]]]] = {}
    out = MeasuredCosts()
    for path in paths:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--costs {path}: not a readable JSON file ({exc})") from exc
        kind = _kind(d)
        if kind == "other":
            out.unused.append(f"{path} (no figure the simulator uses)")
            continue
        presets = list(d["cost"]) if kind == "mecefo" else [d.get("preset", "?")]
        for preset in presets:
            if preset != target:
                try:
                    model_size(preset)
                except ValueError:
                    raise ValueError(
                        f"--costs {path}: measured on model {preset!r}, whose size cannot be computed, so its "
                        f"figures cannot be scaled to {target!r}; measure on a preset (debug, tiny, llama-*) or "
                        f"simulate --model {preset}") from None
            groups.setdefault(kind, []).append((preset, Path(path), d))

    def nearest(kind: str) -> list[tuple[str, Path, dict[str, Any]]]:
        rows = groups.get(kind, [])
        if not rows:
            return []
        best = min({r[0] for r in rows}, key=lambda p: (abs(_log_ratio(model_size(p)[0], p_target)), -model_size(p)[0]))
        out.presets[kind] = best
        chosen = [r for r in rows if r[0] == best]
        out.unused += [f"{r[1]} ({kind}, preset {r[0]}: {best} is nearer {target})" for r in rows if r[0] != best]
        return chosen

    _read_failover(nearest("failover"), out)
    _read_protocol(nearest("protocol"), out)
    _read_snapshot(nearest("snapshot"), out)
    _read_mecefo(nearest("mecefo"), out)
    return out


def _log_ratio(a: float, b: float) -> float:
    import math

    return math.log(a / b)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _read_failover(rows: list[tuple[str, Path, dict[str, Any]]], out: MeasuredCosts) -> None:
    """Each figure: the median of every sample of it in the files of the chosen preset (pooled)."""
    if not rows:
        return
    keys = {"failover.crash_stall_s": ("crash_stall_s",), "failover.hang_stall_s": ("hang_stall_s",),
            "failover.rejoin_warm_s": ("back_to_full_strength_s", "warm_standby"),
            "failover.rejoin_cold_s": ("back_to_full_strength_s", "cold_start"),
            "failover.rejoin_stall_s": ("rejoin_stall_s", "warm_standby")}
    cpu = rows[0][2].get("machine", {}).get("cpu_count")
    if cpu:
        out.figures["failover.cpu_count"] = Figure(float(cpu), "cores", f"{rows[0][1]} machine.cpu_count")
    for name, path_keys in keys.items():
        samples, files = [], []
        for preset, path, d in rows:
            v: Any = d["failures"]
            for k in path_keys:
                v = v.get(k, {}) if isinstance(v, dict) else {}
            if isinstance(v, list) and v:
                samples += [float(x) for x in v]
                files.append(path.name)
        if samples:
            out.figures[name] = Figure(_median(samples), "s", f"median of {len(samples)} samples "
                                       f"{[round(x, 3) for x in samples]} of failures.{'.'.join(path_keys)} in "
                                       f"{', '.join(files)} [{rows[0][0]}] ({path.parent})")


def _read_protocol(rows: list[tuple[str, Path, dict[str, Any]]], out: MeasuredCosts) -> None:
    if not rows:
        return
    pairs = [(r[2]["overhead"]["ratio"], r[2]["overhead"]["alternating"]["plain_median_s"], r[1])
             for r in rows if r[2]["overhead"].get("alternating")]
    if not pairs:
        return
    added = _median([(ratio - 1.0) * step for ratio, step, _ in pairs])
    names = ", ".join(p[2].name for p in pairs)
    out.figures["protocol.added_s"] = Figure(added, "s/step", f"median of (ratio - 1) * plain step over {names} "
                                             f"[{rows[0][0]}] overhead.ratio, overhead.alternating.plain_median_s")


def _read_snapshot(rows: list[tuple[str, Path, dict[str, Any]]], out: MeasuredCosts) -> None:
    if not rows:
        return
    preset, path, d = rows[-1]
    src = f"{path} [{preset}]"
    ip, ov, kill = d["in_process"], d["overhead"], d["kill"]
    fig = out.figures
    fig["snapshot.state_bytes"] = Figure(float(d["bytes"]["state_bytes"]), "B", f"{src} bytes.state_bytes")
    fig["snapshot.write_s"] = Figure(ip["write_s_per_worker"], "s", f"{src} in_process.write_s_per_worker")
    fig["snapshot.added_s"] = Figure(ov["snapshot"]["added_s"], "s/step", f"{src} overhead.snapshot.added_s")
    fig["snapshot.step_s"] = Figure(ov["snapshot"]["median_step_s_without"], "s",
                                    f"{src} overhead.snapshot.median_step_s_without")
    fig["snapshot.dcp_added_s"] = Figure(ov["dcp_async_save"]["added_s"], "s/save",
                                         f"{src} overhead.dcp_async_save.added_s")
    fig["snapshot.restore_memory_s"] = Figure(ip["restore_s"]["own_memory"], "s",
                                              f"{src} in_process.restore_s.own_memory")
    fig["snapshot.restore_disk_s"] = Figure(ip["restore_s"]["dcp_disk"], "s", f"{src} in_process.restore_s.dcp_disk")
    fig["snapshot.job_restart_s"] = Figure(kill["snapshot_memory"]["seconds_to_next_step"], "s",
                                           f"{src} kill.snapshot_memory.seconds_to_next_step")
    fig["snapshot.ckpt_restart_s"] = Figure(kill["checkpoint_restart"]["seconds_to_next_step"], "s",
                                            f"{src} kill.checkpoint_restart.seconds_to_next_step")
    fig["snapshot.workers"] = Figure(float(d["nodes"] * d["workers_per_node"]), "workers",
                                     f"{src} nodes * workers_per_node")
    fig["snapshot.nodes"] = Figure(float(d["nodes"]), "nodes", f"{src} nodes")


def _read_mecefo(rows: list[tuple[str, Path, dict[str, Any]]], out: MeasuredCosts) -> None:
    if not rows:
        return
    preset, path, d = rows[-1]
    c = d["cost"][preset]
    src = f"{path} [{preset}]"
    out.figures["mecefo.approx_ratio"] = Figure(c["approx_microbatch"]["flops_ratio"], "x exact micro-batch",
                                                f"{src} cost.{preset}.approx_microbatch.flops_ratio")
    out.figures["mecefo.svd_share"] = Figure(c["svd"]["flops_per_step"] / c["normal"]["flops"], "x exact micro-batch",
                                             f"{src} cost.{preset}.svd.flops_per_step / normal.flops")
