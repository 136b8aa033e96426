"""Seeded Monte Carlo over failure realisations: every strategy on the same events, confidence intervals over seeds.

Each seed draws one realisation (:func:`unbroken.cluster.failures.generate_events`);
every strategy runs over that same realisation, so the strategies' differences
are paired. A figure's confidence interval is the mean +- 1.96 standard
errors over seeds (a normal approximation; with few seeds it is optimistic).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unbroken.cluster.failures import FailureSpec, generate_events
from unbroken.cluster.scaling import SimCosts
from unbroken.cluster.strategies import STRATEGIES, Strategy, daly_interval_s, simulate_strategy

__all__ = ["Estimate", "SimOptions", "build_strategies", "run_monte_carlo"]

logger = logging.getLogger(__name__)

METRICS = ("goodput", "lost_samples", "redone_samples", "approx_samples", "degraded_s", "blocked_s", "failures")


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    """How to run: strategies, seeds, checkpoint interval given (``None``: Young/Daly only), and the what-ifs."""

    strategies: tuple[str, ...] = STRATEGIES
    seeds: int = 20
    seed: int = 0
    ckpt_every: int | None = None
    snapshot_every: int = 1
    standby: bool = True
    cores: int | None = None

    def __post_init__(self) -> None:
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"strategies {unknown}: valid are {', '.join(STRATEGIES)}")
        if self.seeds < 1:
            raise ValueError(f"seeds={self.seeds} must be >= 1")
        if self.snapshot_every < 1:
            raise ValueError(f"snapshot_every={self.snapshot_every} must be >= 1 step")
        if self.ckpt_every is not None and self.ckpt_every < 1:
            raise ValueError(f"ckpt_every={self.ckpt_every} must be >= 1 step")


@dataclass
class Estimate:
    """Mean and 95% half-width over seeds of one strategy's figures; ``detail``: how it was set up."""

    name: str
    mean: dict[str, float] = field(default_factory=dict)
    half_width: dict[str, float] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)


def _daly_steps(save_s: float, mtbf_s: float, step_s: float) -> int:
    return max(1, round(daly_interval_s(save_s, mtbf_s) / step_s))


def build_strategies(spec: FailureSpec, costs: SimCosts, opts: SimOptions) -> list[Strategy]:
    """The strategies of ``opts`` with their checkpoint intervals (Young/Daly and, if given, ``ckpt_every``)."""
    takeover = [n for n in opts.strategies if n in ("neighbor", "spread", "spread-approx", "spread-disk")]
    if takeover and spec.workers < 2:
        raise ValueError(f"workers={spec.workers}: the takeover strategies ({', '.join(takeover)}) need at least 2 "
                         "workers (a live one covers a dead one's rows); use --workers >= 2 or "
                         "--strategies checkpoint-restart,step-discard")
    step, save = costs.step_s.value, costs.ckpt_save_s.value
    k_all = _daly_steps(save, spec.job_mtbf_h * 3600.0, step)
    job_frac = spec.mix.get("job", 0.0)
    k_job = _daly_steps(save, spec.job_mtbf_h * 3600.0 / job_frac, step) if job_frac > 0 else None
    out: list[Strategy] = []
    for name in opts.strategies:
        if name == "checkpoint-restart":
            out.append(Strategy(f"checkpoint-restart (Daly K={k_all})", "checkpoint", ckpt_every=k_all))
            if opts.ckpt_every is not None:
                out.append(Strategy(f"checkpoint-restart (K={opts.ckpt_every})", "checkpoint",
                                    ckpt_every=opts.ckpt_every))
        elif name == "step-discard":
            out.append(Strategy(name, "discard", ckpt_every=k_job))
        elif name == "spread-disk":
            out.append(Strategy(name, "takeover", policy="spread", ckpt_every=k_job))
        else:
            out.append(Strategy(name, "takeover", policy=name, memory=True, snapshot_every=opts.snapshot_every))
    return out


def run_monte_carlo(spec: FailureSpec, costs: SimCosts, opts: SimOptions,
                    progress: Callable[[int], None] | None = None) -> list[Estimate]:
    """Every strategy over ``opts.seeds`` realisations of ``spec``; one :class:`Estimate` per strategy."""
    strategies = build_strategies(spec, costs, opts)
    rows: dict[str, list[dict[str, float]]] = {s.name: [] for s in strategies}
    for i in range(opts.seeds):
        events = generate_events(spec, opts.seed + i)
        for st in strategies:
            o = simulate_strategy(st, spec, costs, events, cores=opts.cores,
                                  standby=opts.standby)
            rows[st.name].append(o.as_dict())
        if progress is not None:
            progress(i + 1)
    out = []
    for st in strategies:
        est = Estimate(st.name, detail={k: v for k, v in dataclasses.asdict(st).items() if v is not None})
        for m in METRICS:
            xs = np.array([r[m] for r in rows[st.name]], dtype=float)
            est.mean[m] = float(xs.mean())
            est.half_width[m] = float(1.96 * xs.std(ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else 0.0
        out.append(est)
    return out
