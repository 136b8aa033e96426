"""Tables, JSON and the goodput-vs-cluster-size plot of the cluster simulator."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from unbroken.cluster.montecarlo import Estimate
from unbroken.cluster.scaling import SimCosts

__all__ = ["costs_lines", "estimates_json", "plot_sweep", "table_lines"]

logger = logging.getLogger(__name__)


def costs_lines(costs: SimCosts) -> list[str]:
    """One line per figure: name, value, unit and where it came from."""
    return [f"  {name:<17} {fig.value:>10.4g} {fig.unit:<20} <- {fig.source}" for name, fig in costs.figures().items()]


def _pm(e: Estimate, m: str, scale: float = 1.0, fmt: str = ".3g") -> str:
    return f"{e.mean[m] * scale:{fmt}} ± {e.half_width[m] * scale:{fmt}}"


def table_lines(estimates: list[Estimate], *, batch_rows: int, hours: float) -> list[str]:
    """The result table: goodput, lost / redone / approximated samples, degraded and blocked time."""
    head = (f"{'strategy':<32} {'goodput':>17} {'lost samples':>19} {'redone samples':>19} "
            f"{'approx samples':>17} {'degraded h':>15} {'stalled h':>15} {'failures':>8}")
    lines = [head, "-" * len(head)]
    for e in estimates:
        lines.append(f"{e.name:<32} {_pm(e, 'goodput', 1, '.4f'):>17} {_pm(e, 'lost_samples'):>19} "
                     f"{_pm(e, 'redone_samples'):>19} {_pm(e, 'approx_samples'):>17} "
                     f"{_pm(e, 'degraded_s', 1 / 3600):>15} {_pm(e, 'blocked_s', 1 / 3600):>15} "
                     f"{e.mean['failures']:>8.1f}")
    lines.append(f"(mean ± 95% half-width over seeds; {hours:g} h simulated; a failure-free step trains "
                 f"{batch_rows} samples)")
    return lines


def estimates_json(estimates: list[Estimate]) -> list[dict[str, Any]]:
    """JSON-ready list of the estimates."""
    return [{"strategy": e.name, "mean": e.mean, "ci95_half_width": e.half_width, "setup": e.detail}
            for e in estimates]


def plot_sweep(sweep: dict[int, list[Estimate]], path: Path, *, title: str) -> None:
    """Goodput vs cluster size, one line per strategy, with the 95% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(sweep)
    names = [e.name for e in sweep[sizes[0]]]
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, name in enumerate(names):
        est = [next(e for e in sweep[g] if e.name.split(" (")[0] == name.split(" (")[0]) for g in sizes]
        mean = [e.mean["goodput"] for e in est]
        hw = [e.half_width["goodput"] for e in est]
        label = name.split(" (")[0]
        ax.plot(sizes, mean, marker="o", label=label)
        ax.fill_between(sizes, [m - h for m, h in zip(mean, hw)], [m + h for m, h in zip(mean, hw)], alpha=0.2)
    ax.set_xscale("log")
    ax.set_xlabel("data-parallel workers")
    ax.set_ylabel("goodput (useful samples per GPU-hour / failure-free)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)
