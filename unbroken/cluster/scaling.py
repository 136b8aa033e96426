"""Scale measured costs to a target model and cluster: the figures one simulation uses, in seconds.

The rules are stated in :mod:`unbroken.cluster.costs`; this module applies
them. What describes the target hardware is a :class:`TargetHardware`
parameter, never a measured figure, and is printed as such.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from unbroken.cluster.costs import Figure, MeasuredCosts, model_size
from unbroken.snapshot.plan import GROUP_NODES

__all__ = ["SimCosts", "TargetHardware", "scale_costs"]

logger = logging.getLogger(__name__)

_GB = 1e9


@dataclass(frozen=True, kw_only=True)
class TargetHardware:
    """The target cluster, as parameters (not measured here).

    Attributes:
        gpu_tflops: peak dense bf16 TFLOP/s of one worker (989: an H100 SXM).
        mfu: model FLOPs utilisation of a failure-free step.
        seq_len: tokens per row.
        rows: rows (samples) per worker per step.
        step_s: failure-free step time in seconds; None: ``6 P seq_len rows / (gpu_tflops mfu)``.
        net_gbs: GB/s of a state transfer from a live peer to a rejoining worker.
        snapshot_gbs: GB/s of one worker's snapshot write; None: the measured CPU rate.
        ckpt_gbs: GB/s of the blocking part of a checkpoint save per writer; None: measured.
        disk_gbs: GB/s of a checkpoint restore per worker; None: measured.
        startup_s: seconds to start every worker of a job again; None: measured.
        ckpt_writers: workers that share a checkpoint save; None: all workers (sharded save).
    """

    gpu_tflops: float = 989.0
    mfu: float = 0.4
    seq_len: int = 4096
    rows: int = 4
    step_s: float | None = None
    net_gbs: float = 25.0
    snapshot_gbs: float | None = None
    ckpt_gbs: float | None = None
    disk_gbs: float | None = None
    startup_s: float | None = None
    ckpt_writers: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and not v > 0:
                raise ValueError(f"{f.name}={v!r} must be > 0 (or left out for the default)")


@dataclass(frozen=True, kw_only=True)
class SimCosts:
    """Every cost one simulation uses (seconds unless stated), each with its provenance.

    ``protocol_s``, ``snapshot_s`` are added to every step of the strategies that pay them;
    ``ckpt_save_s`` to every checkpoint; the ``detect_*`` are stalls of the whole job per failure;
    ``rejoin_warm_s`` / ``rejoin_cold_s`` the time from a process failure to the worker back at full
    strength, ``rejoin_stall_s`` the whole job's stall when it is admitted;
    ``restart_memory_s`` / ``restart_disk_s`` the time from a whole-job failure to the next step.
    """

    step_s: Figure
    rows: int
    protocol_s: Figure
    snapshot_s: Figure
    ckpt_save_s: Figure
    detect_crash_s: Figure
    detect_hang_s: Figure
    rejoin_warm_s: Figure
    rejoin_cold_s: Figure
    rejoin_stall_s: Figure
    restart_memory_s: Figure
    restart_disk_s: Figure
    approx_ratio: Figure
    svd_share: Figure

    def figures(self) -> dict[str, Figure]:
        """Name -> figure, for printing and JSON."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Figure)}


def _param(name: str, value: float, unit: str) -> Figure:
    return Figure(value, unit, f"parameter {name}")


def scale_costs(m: MeasuredCosts, *, model: str, workers: int, workers_per_node: int,
                hw: TargetHardware) -> SimCosts:
    """The figures of ``m`` scaled to ``model`` on ``workers`` workers (rules in :mod:`unbroken.cluster.costs`)."""
    params, s_t = model_size(model)
    s_m = m.get("snapshot.state_bytes").value
    w_m = m.get("snapshot.workers").value
    n_t = max(2, workers // workers_per_node)
    if hw.step_s is not None:
        step = _param("--step-s", hw.step_s, "s")
    else:
        v = 6.0 * params * hw.seq_len * hw.rows / (hw.gpu_tflops * 1e12 * hw.mfu)
        step = Figure(v, "s", f"rule 6 * {params:.4g} params * {hw.seq_len} tokens * {hw.rows} rows / "
                              f"({hw.gpu_tflops:g} TFLOP/s * mfu {hw.mfu:g})  [parameters]")
    proto = m.get("protocol.added_s")
    g_t = -(-n_t // -(-n_t // GROUP_NODES))  # the largest coding group of n_t nodes (snapshot.plan)
    per_worker = s_t / workers * g_t / (g_t - 1)
    write_s, added_s = m.get("snapshot.write_s"), m.get("snapshot.added_s")
    n_m = max(2.0, m.get("snapshot.nodes").value)  # parity factor N/(N-1) of the measured layout
    rate = hw.snapshot_gbs * _GB if hw.snapshot_gbs else (s_m / w_m * n_m / (n_m - 1)) / write_s.value
    critical = min(1.0, added_s.value / write_s.value)
    snap = Figure(per_worker / rate * critical, "s/step",
                  f"rule {per_worker / 1e6:.4g} MB per worker (S/G * g/(g-1), g = {g_t} nodes a coding group) / "
                  f"{rate / 1e6:.4g} MB/s "
                  f"({'parameter --snapshot-gbs' if hw.snapshot_gbs else write_s.source}) * on-step share "
                  f"{critical:.3g} ({added_s.source})")
    writers = hw.ckpt_writers or workers
    dcp = m.get("snapshot.dcp_added_s")
    ck_rate = hw.ckpt_gbs * _GB if hw.ckpt_gbs else s_m / dcp.value
    ckpt = Figure(s_t / writers / ck_rate, "s/save", f"rule {s_t / writers / 1e6:.4g} MB per writer ({writers} "
                  f"writers) / {ck_rate / 1e6:.4g} MB/s ({'parameter --ckpt-gbs' if hw.ckpt_gbs else dcp.source})")
    crash, hang = m.get("failover.crash_stall_s"), m.get("failover.hang_stall_s")
    extra = max(0.0, s_t - s_m) / (hw.net_gbs * _GB)
    warm, cold = m.get("failover.rejoin_warm_s"), m.get("failover.rejoin_cold_s")
    rejoin_warm = Figure(warm.value + extra, "s", f"{warm.source} + {extra:.3g} s transfer of the extra "
                         f"state at parameter --net-gbs {hw.net_gbs:g}")
    rejoin_cold = Figure(cold.value + extra, "s", f"{cold.source} + {extra:.3g} s transfer (--net-gbs)")
    adm = m.get("failover.rejoin_stall_s")
    rejoin_stall = Figure(max(0.0, adm.value) + extra, "s", f"{adm.source} + {extra:.3g} s transfer (--net-gbs)")
    mem, disk, job = (m.get("snapshot.restore_memory_s"), m.get("snapshot.restore_disk_s"),
                      m.get("snapshot.job_restart_s"))
    startup = hw.startup_s if hw.startup_s is not None else job.value - mem.value
    startup_src = "parameter --startup-s" if hw.startup_s is not None else f"({job.source}) - restore from memory"
    mine = s_t / workers
    mem_s = mem.value * mine / s_m
    disk_s = mine / (hw.disk_gbs * _GB) if hw.disk_gbs else disk.value * mine / s_m
    restart_memory = Figure(startup + mem_s, "s", f"start-up {startup:.3g} s {startup_src} + {mem_s:.3g} s "
                            f"restore of {mine / 1e6:.4g} MB at the rate of {mem.source}")
    restart_disk = Figure(startup + disk_s, "s", f"start-up {startup:.3g} s + {disk_s:.3g} s restore of "
                          f"{mine / 1e6:.4g} MB ({'parameter --disk-gbs' if hw.disk_gbs else disk.source})")
    return SimCosts(step_s=step, rows=hw.rows,
                    protocol_s=Figure(proto.value, proto.unit, proto.source + " (absolute per step, size independent)"),
                    snapshot_s=snap, ckpt_save_s=ckpt,
                    detect_crash_s=Figure(crash.value, "s", crash.source + " (size independent)"),
                    detect_hang_s=Figure(hang.value, "s", hang.source + " (size independent)"),
                    rejoin_warm_s=rejoin_warm, rejoin_cold_s=rejoin_cold, rejoin_stall_s=rejoin_stall,
                    restart_memory_s=restart_memory, restart_disk_s=restart_disk,
                    approx_ratio=m.get("mecefo.approx_ratio"), svd_share=m.get("mecefo.svd_share"))
