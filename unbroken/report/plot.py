"""The pictures of ``unbroken report``: one run's story in four panels, or two runs overlaid.

Drawn with matplotlib's object API (``Figure.savefig`` renders on the Agg
canvas): no pyplot, no display, no global state. Input: the dicts of
:func:`unbroken.report.run_report.build_report`; steps are the ledger's (0-based).

One run (:func:`plot_run`), panels sharing the step axis:

(a) worker x step bands (live / rejoining / dead), deaths marked by kind at
    their step and worker, rejoins at the step the worker trains first, and
    the live count where it changes;
(b) the stall of each failure, a bar at its step;
(c) degraded slots per step by mode, from the committed ledger items;
(d) training loss per step, validation loss at its steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from unbroken.report import series as rs

DPI = 100
WIDTH_IN = 14.0
STATE_COLORS = {rs.LIVE: "#81c784", rs.REJOINING: "#ffd54f", rs.DEAD: "#e57373"}
DEATH_STYLE = {"crash": ("X", "#b71c1c"), "hang": ("s", "#6a1b9a"), "block": ("D", "#e65100"),
               "node loss": ("*", "#000000"), "fenced": ("v", "#37474f")}
"""Marker and colour of each kind of death (:data:`unbroken.report.series.DEATH_KINDS`)."""
REJOIN_STYLE = ("^", "#0d47a1")
SLOT_COLORS = {rs.COVERED_EXACT: "#42a5f5", rs.COVERED_APPROX: "#fb8c00", rs.OWN_APPROX: "#ffe0b2"}
LEGEND: dict[str, Any] = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": 9, "frameon": False, "borderaxespad": 0}


@dataclass(frozen=True)
class RunStyle:
    """How one run of an overlay is drawn: the first solid and wide below, the second dashed on top."""

    color: str
    line: str
    width: float
    marker: str
    marker_size: float
    zorder: int


RUN_STYLES = (RunStyle("#1f77b4", "-", 3.0, "o", 11, 2), RunStyle("#d62728", "--", 1.6, "D", 7, 3))


def plot_run(report: dict[str, Any], path: str | Path) -> Path:
    """Draw one run's report (four panels, shared step axis) to ``path`` (PNG); returns the path."""
    n = report["workers"]
    fig = Figure(figsize=(WIDTH_IN, 9.0 + 0.35 * n), dpi=DPI, layout="constrained")
    axes = fig.subplots(4, 1, sharex=True, gridspec_kw={"height_ratios": [max(1.3, 0.3 * n), 1.0, 1.0, 1.4]})
    _timeline(axes[0], report)
    _stalls(axes[1], report)
    _degraded(axes[2], report)
    _losses(axes[3], report)
    for ax in axes[1:]:
        for step in sorted({d["step"] for d in report["deaths"]} | {f["step"] for f in report["failure_details"]}):
            ax.axvline(step, color="#9e9e9e", linestyle=":", linewidth=1, zorder=0)
    steps = max(1, len(report["series"]["step"]))
    axes[-1].set_xlim(-0.5, steps - 0.5)
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(steps, 25)))
    axes[-1].set_xlabel("step (0-based, as in the ledger)")
    fig.suptitle(_title(report), fontsize=13)
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    return path


def _title(r: dict[str, Any]) -> str:
    lost = "-" if r["lost_steps"] is None else r["lost_steps"]
    kind = "simulated, " if r["simulated"] else ""
    return (f"{r['name']}  ({kind}{r['workers']} workers, policy {r['policy']}, recovery {r['recovery']})\n"
            f"{r['committed_steps']}/{r['steps']} steps committed  ·  {_count(r['failures'], 'failure')}, "
            f"{_count(r['death_count'], 'death')}, {_count(len(r['rejoins']), 'rejoin')}  ·  {lost} lost steps  ·  "
            f"ledger {rs.ledger_verdict(r['ledger_ok'])}")


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _timeline(ax: Axes, r: dict[str, Any]) -> None:
    states = r["series"]["worker_states"]
    n, steps = len(states), len(r["series"]["step"])
    codes = [[rs.STATES.index(state) for state in row] for row in states]
    ax.imshow(codes, aspect="auto", interpolation="nearest", vmin=-0.5, vmax=len(rs.STATES) - 0.5,
              cmap=ListedColormap([STATE_COLORS[s] for s in rs.STATES]), extent=(-0.5, steps - 0.5, n - 0.5, -0.5))
    for k in range(1, n):
        ax.axhline(k - 0.5, color="white", linewidth=1.5)
    wpn = r.get("workers_per_node")
    ax.set_yticks(range(n), [f"w{w}" + (f" (node {w // wpn})" if wpn else "") for w in range(n)])
    for d in r["deaths"]:
        marker, color = DEATH_STYLE.get(d["kind"], ("o", "#000000"))
        ax.plot(d["step"], d["worker"], marker=marker, color=color, markersize=13, markeredgecolor="white",
                linestyle="none", zorder=3)
        ax.annotate(d["kind"], (d["step"], d["worker"]), xytext=(9, -3), textcoords="offset points",
                    fontsize=9, color=color, fontweight="bold", zorder=4)
    near = max(1, steps // 25)  # labels closer than this (in steps) would overlap: the markers say enough
    for j in r["rejoin_steps"]:
        ax.plot(j["step"], j["worker"], marker=REJOIN_STYLE[0], color=REJOIN_STYLE[1], markersize=12,
                markeredgecolor="white", linestyle="none", zorder=3)
        if not any(d["worker"] == j["worker"] and abs(d["step"] - j["step"]) < near for d in r["deaths"]):
            ax.annotate("back", (j["step"], j["worker"]), xytext=(9, -3), textcoords="offset points",
                        fontsize=9, color=REJOIN_STYLE[1], fontweight="bold", zorder=4)
    live, shown = r["series"]["live_workers"], -near
    for s in [s for s in range(steps) if s == 0 or live[s] != live[s - 1]]:
        if s - shown < near:
            continue
        shown = s
        ax.annotate(f"{live[s]} live", (s - 0.45, -0.5), xytext=(0, 3), textcoords="offset points",
                    fontsize=9, va="bottom", annotation_clip=False)
    order = list(DEATH_STYLE)
    kinds = sorted({d["kind"] for d in r["deaths"]}, key=lambda k: order.index(k) if k in order else len(order))
    handles: list[Artist] = [Patch(color=STATE_COLORS[s], label=s) for s in rs.STATES]
    handles += [_marker(*DEATH_STYLE.get(k, ("o", "#000000")), f"death: {k}") for k in kinds]
    handles += [_marker(*REJOIN_STYLE, "rejoin")] if r["rejoin_steps"] else []
    ax.legend(handles=handles, **LEGEND)
    ax.set_title("(a) workers per step: live, rejoining, dead; deaths by kind, rejoins", loc="left", fontsize=11,
                 pad=16)


def _marker(marker: str, color: str, label: str) -> Line2D:
    return Line2D([], [], marker=marker, color=color, linestyle="none", markersize=10, label=label)


def _stalls(ax: Axes, r: dict[str, Any]) -> None:
    bars = [(f["step"], f["stall_s"]) for f in r["failure_details"] if f["stall_s"] is not None]
    if bars:
        rects = ax.bar([s for s, _ in bars], [max(v, 0.0) for _, v in bars], width=0.6, color="#c62828",
                       label="stall: the failed step's extra time")
        who = _deaths_behind([s for s, _ in bars], r["deaths"])
        ax.bar_label(rects, labels=[f"{v:.2f} s" + (f"\n{who[s]}" if who[s] else "") for s, v in bars],
                     padding=2, fontsize=9)
        ax.set_ylim(0, max(v for _, v in bars) * 1.6 + 1e-3)
        ax.legend(**LEGEND)
    else:
        ax.text(0.5, 0.5, "no failure" if not r["failure_details"] else "stall not measured",
                transform=ax.transAxes, ha="center", va="center", color="#616161")
    ax.set_ylabel("seconds")
    ax.set_title("(b) stall of each failure", loc="left", fontsize=11)


def _deaths_behind(failure_steps: list[int], deaths: list[dict[str, Any]]) -> dict[int, str]:
    """Label each failure with the deaths it handled: those since the previous failure, up to its step.

    A worker may die in one step and be found dead in the next (a blocked
    worker whose contribution was already posted): its step is named then.
    """
    out, left = {}, sorted(deaths, key=lambda d: d["step"])
    for step in sorted(failure_steps):
        mine = [d for d in left if d["step"] <= step]
        left = [d for d in left if d["step"] > step]
        out[step] = ", ".join(f"w{d['worker']} {d['kind']}" + ("" if d["step"] == step else f" (step {d['step']})")
                              for d in mine)
    return out


def _degraded(ax: Axes, r: dict[str, Any]) -> None:
    s = r["series"]
    x = s["step"]
    bottom = [0] * len(x)
    for mode in rs.SLOT_MODES:
        counts = s[rs.slots_key(mode)]
        ax.bar(x, counts, bottom=bottom, width=0.9, color=SLOT_COLORS[mode], label=_SLOT_LABELS[mode],
               edgecolor="#8d6e63" if mode == rs.OWN_APPROX else None, linewidth=0.5)
        bottom = [b + c for b, c in zip(bottom, counts)]
    ax.set_ylim(0, max(r["workers"], 1))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("slots")
    ax.legend(**LEGEND)
    ax.set_title("(c) degraded slots per step (committed ledger items)", loc="left", fontsize=11)


_SLOT_LABELS = {
    rs.COVERED_EXACT: "covered by another worker, exact",
    rs.COVERED_APPROX: "covered by another worker, approximated",
    rs.OWN_APPROX: "own slot approximated (covering worker)",
}


def _losses(ax: Axes, r: dict[str, Any]) -> None:
    _loss_lines(ax, r["series"], style=RUN_STYLES[0], label="")
    ax.set_ylabel("loss")
    ax.legend(**LEGEND)
    ax.set_title("(d) loss", loc="left", fontsize=11)


def _loss_lines(ax: Axes, s: dict[str, Any], *, style: RunStyle, label: str) -> None:
    """Training loss as a line (gaps where a step has none), validation loss as hollow markers."""
    prefix = f"{label}: " if label else ""
    ax.plot(s["step"], _nan(s["loss"]), color=style.color, linestyle=style.line, linewidth=style.width,
            marker=".", markersize=4, label=f"{prefix}training loss", zorder=style.zorder)
    val = [(x, v) for x, v in zip(s["step"], s["val_loss"]) if v is not None]
    if val:
        ax.plot([x for x, _ in val], [v for _, v in val], linestyle="none", marker=style.marker,
                markersize=style.marker_size, markerfacecolor="none", markeredgecolor=style.color,
                markeredgewidth=2, label=f"{prefix}validation loss", zorder=style.zorder)


def _nan(xs: list[float | None]) -> list[float]:
    return [float("nan") if x is None else x for x in xs]


def plot_overlay(reports: list[dict[str, Any]], path: str | Path) -> Path:
    """Draw the loss curves and live-worker counts of two runs on shared axes; returns the path.

    Panels: both loss curves; the first run's training loss minus the
    second's at the steps both have (equal runs overlap, so the gap is shown
    on its own scale); live workers per step with the deaths marked.
    """
    fig = Figure(figsize=(WIDTH_IN, 10.0), dpi=DPI, layout="constrained")
    loss_ax, gap_ax, live_ax = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [1.6, 0.8, 1.0]})
    for r, style in zip(reports, RUN_STYLES):
        _loss_lines(loss_ax, r["series"], style=style, label=r["name"])
        _live_line(live_ax, r, style)
    _loss_gap(gap_ax, reports)
    loss_ax.set_ylabel("loss")
    loss_ax.legend(**LEGEND)
    loss_ax.set_title("loss per step (lines: training, hollow markers: validation)", loc="left", fontsize=11)
    live_ax.set_ylabel("live workers")
    live_ax.set_ylim(0, max(r["workers"] for r in reports) + 0.5)
    live_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    kinds = sorted({d["kind"] for r in reports for d in r["deaths"]})
    handles, _ = live_ax.get_legend_handles_labels()
    handles += [_marker(DEATH_STYLE.get(k, ("o", ""))[0], "#616161", f"death: {k}") for k in kinds]
    live_ax.legend(handles=handles, **LEGEND)
    live_ax.set_title("live workers per step (markers: deaths by kind)", loc="left", fontsize=11)
    steps = max([1] + [len(r["series"]["step"]) for r in reports])
    live_ax.set_xlim(-0.5, steps - 0.5)
    live_ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(steps, 25)))
    live_ax.set_xlabel("step (0-based, as in the ledger)")
    fig.suptitle("  vs  ".join(_headline(r) for r in reports), fontsize=12)
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    return path


def _live_line(ax: Axes, r: dict[str, Any], style: RunStyle) -> None:
    s = r["series"]
    ax.step(s["step"], s["live_workers"], where="mid", color=style.color, linestyle=style.line,
            linewidth=style.width, label=r["name"], zorder=style.zorder)
    for d in r["deaths"]:
        if 0 <= d["step"] < len(s["step"]):
            ax.plot(d["step"], s["live_workers"][d["step"]], marker=DEATH_STYLE.get(d["kind"], ("o", ""))[0],
                    color=style.color, markersize=10, markeredgecolor="white", linestyle="none", zorder=4)


def _loss_gap(ax: Axes, reports: list[dict[str, Any]]) -> None:
    a, b = (r["series"] for r in reports[:2])
    both = [(x, la - lb) for x, la, lb in zip(a["step"], a["loss"], b["loss"]) if la is not None and lb is not None]
    ax.axhline(0.0, color="#9e9e9e", linewidth=1)
    if both:
        ax.plot([x for x, _ in both], [g for _, g in both], color="#424242", marker=".", linewidth=1.5,
                label=f"{reports[0]['name']} - {reports[1]['name']}")
        ax.legend(**LEGEND)
    else:
        ax.text(0.5, 0.5, "no step with both losses", transform=ax.transAxes, ha="center", va="center")
    ax.set_ylabel("loss gap")
    ax.set_title("training loss difference at each step", loc="left", fontsize=11)


def _headline(r: dict[str, Any]) -> str:
    checked = "simulated" if r["simulated"] else f"ledger {rs.ledger_verdict(r['ledger_ok'])}"
    return f"{r['name']} ({r['policy']}/{r['recovery']}: {_count(r['failures'], 'failure')}, {checked})"
