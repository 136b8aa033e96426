"""Capacity: when each lost worker was back at full strength, and what every gap between a worker's exit and its
next start waited for. Pure functions of a run's event records (:func:`unbroken.runtime.ledger.read_events`).

A loss of worker ``w`` begins at the first record of its death after it was last a member of the job (its
own fault, an injected one naming it, its agent's fence, its exit; or, from outside, the time a fault was
sent to its process: ``faults``) and ends when ``w`` adopts a view it is a member of again (admitted as a
joiner, a member of a restored view, or of the next view of a step it survived): the worker is back and
the job at its strength. A whole-job restore ends the losses of every member it names that loads the state.
A member stopped from outside (SIGSTOP) and continued (the fault's ``cont_wall``) before anything recorded
its loss (a fence, an exit, a view without it, up to ``SLACK_S`` after the continue) was a stall the job rode
through: that loss ends when it was continued (``continued``).

A gap is the time from a worker's unclean exit to its next start (a process of its agent's, or a standby
handed the worker). Each is explained by what the agent recorded: the restart it scheduled
(``restart_in_s``, ``restart_at_step``), a restart it refused (``restart: none``), a node lost with its
agent; a gap longer than its explanation by more than ``SLACK_S`` is reported unexplained.

A loss slower than ``BACK_TARGET_S`` names the other workers lost meanwhile (``meanwhile``: a joiner is
admitted at a step boundary, and the steps wait while another member's hang is being detected) and the
faults that hit the worker's new incarnation while it came back (``hit_again``).

Invariant: a loss is counted once, however many records its death left; a loss still open at the end of the
run has ``back_s`` None and says why (no later start, or a start that never adopted a view).
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

__all__ = ["SLACK_S", "gaps", "losses", "summarize"]

SLACK_S = 1.0
"""A gap may exceed the delay its explanation states by this much (an agent's tick, a process start)."""
BACK_TARGET_S = 5.0
"""A lost worker should be back at full strength this soon (the 99th percentile's target)."""


def _t(e: dict[str, Any]) -> float:
    return float(e.get("t", e.get("time", 0.0)))


def _pids(events: list[dict[str, Any]]) -> dict[int, int]:
    """pid -> worker of every process that was a worker (its agent's start, or a standby's handover)."""
    out = {}
    for e in events:
        if e.get("event") in ("worker_start", "standby_assign", "worker_exit") and e.get("pid") is not None \
                and e.get("worker") is not None:
            out[int(e["pid"])] = int(e["worker"])
    return out


def losses(events: list[dict[str, Any]], faults: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Each loss of a worker (module docstring): ``worker``, ``lost_at``, ``back_at``, ``back_s``, ``how``
    (rejoin, restore, view) and ``cause`` (the first record of it)."""
    pid_of = _pids(events)
    starts: list[tuple[float, int, str]] = []
    for f in faults:  # outside faults: a worker's pid then
        if f.get("pid") in pid_of and "wall" in f:
            starts.append((float(f["wall"]), pid_of[f["pid"]], f"{f.get('signal')} from outside"))
    for e in events:
        name, w = e.get("event"), e.get("worker")
        if name in ("fault_self", "fence") and w is not None:
            starts.append((_t(e), int(w), name))
        elif name == "worker_exit" and w is not None and not e.get("clean") and not e.get("stopped_by_agent"):
            starts.append((_t(e), int(w), "exit"))
        elif name == "fault_injected" and e.get("targets"):
            starts += [(_t(e), int(x), "node fault") for x in e["targets"]]
    backs = sorted((_t(e), int(e["worker"]), _how(e)) for e in events
                   if e.get("event") == "view_adopted" and e.get("worker") in (e.get("members") or []))
    views = [(_t(e), -1, (int(e.get("gen", 0)), tuple(e.get("members") or ()))) for e in events
             if e.get("event") == "view_adopted"]
    conts = [(float(f["cont_wall"]) + SLACK_S, pid_of[f["pid"]], float(f["cont_wall"])) for f in faults
             if f.get("signal") == "SIGSTOP" and f.get("cont_wall") is not None and f.get("pid") in pid_of]
    out: list[dict[str, Any]] = []
    open_: dict[int, dict[str, Any]] = {}
    view: tuple[int, tuple[int, ...]] = (-1, ())
    timeline: list[tuple[float, int, int, Any]] = (  # (time, kind, worker, what), kinds in the order below
        [(t, 0, w, c) for t, w, c in starts] + [(t, 1, w, h) for t, w, h in backs]
        + [(t, 2, w, c) for t, w, c in conts] + [(t, 3, -1, v) for t, _, v in views])
    for t, kind, w, what in sorted(timeline):
        if kind == 3:  # a view: members it leaves out were noticed lost
            view = max(view, what)
            for loss in open_.values():
                loss["noticed"] = loss["noticed"] or loss["worker"] not in what[1]
        elif kind == 0:
            if w not in open_:
                open_[w] = {"worker": w, "lost_at": t, "cause": what, "back_at": None, "back_s": None, "how": None,
                            "noticed": not what.endswith("from outside"),
                            "member": w in view[1]}
                out.append(open_[w])
            elif not what.endswith("from outside"):
                open_[w]["noticed"] = True
        elif kind == 2:  # continued: a member stalled and resumed before the job noticed it had stopped
            stalled = open_.get(w)
            if stalled is not None and stalled["member"] and not stalled["noticed"] \
                    and stalled["cause"] == "SIGSTOP from outside":
                open_.pop(w)
                stalled.update(back_at=what, back_s=round(what - stalled["lost_at"], 3), how="continued")
        elif w in open_:
            loss = open_.pop(w)
            loss.update(back_at=t, back_s=round(t - loss["lost_at"], 3), how=what)
    for loss in out:
        del loss["noticed"], loss["member"]
    for loss in out:  # what else was lost meanwhile: a joiner waits for a step boundary, which waits for them
        end = loss["back_at"] if loss["back_at"] is not None else float("inf")
        loss["meanwhile"] = sorted({x["worker"] for x in out if x is not loss and loss["lost_at"] <= x["lost_at"] < end})
        loss["hit_again"] = sum(1 for t, w, cause in starts if w == loss["worker"] and loss["lost_at"] < t < end
                                and cause.endswith("from outside"))  # its new incarnation, hit while it came back
    return out


def _how(e: dict[str, Any]) -> str:
    reason = str(e.get("reason", ""))
    if reason.startswith("restored"):
        return "restore"
    if e.get("worker") in (e.get("joiners") or []):
        return "rejoin"
    return "view"


def gaps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each gap from a worker's unclean exit to its next start, with the delay the agent stated for it and
    whether that explains it (module docstring)."""
    out = []
    pending: dict[int, dict[str, Any]] = {}
    for e in sorted((e for e in events if "time" in e or "t" in e), key=_t):
        name, w = e.get("event"), e.get("worker")
        if w is None:
            if name == "agent_lost" or name == "spare_took_over":
                for g in pending.values():
                    g.setdefault("why", name)
            continue
        if name == "worker_exit" and not e.get("clean") and not e.get("stopped_by_agent"):
            delay = e.get("restart_in_s")
            why = ("restart in %.1f s" % delay if delay is not None else
                   f"restart at step {e['restart_at_step']}" if e.get("restart_at_step") is not None else
                   "no restart (policy)")
            pending[int(w)] = {"worker": int(w), "exit_at": _t(e), "why": why, "delay_s": delay}
        elif name in ("worker_start", "standby_assign") and int(w) in pending:
            g = pending.pop(int(w))
            g["start_at"] = _t(e)
            g["gap_s"] = round(g["start_at"] - g["exit_at"], 3)
            g["explained"] = g["delay_s"] is None or g["gap_s"] <= g["delay_s"] + SLACK_S
            out.append(g)
    return out


def summarize(events: list[dict[str, Any]], faults: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Losses and gaps in figures: count, back within 5 s at p50/p90/p99, those never back, unexplained gaps."""
    ls, gs = losses(events, faults), gaps(events)
    back = sorted(x["back_s"] for x in ls if x["back_s"] is not None)

    def q(p: float) -> float | None:
        return back[min(len(back) - 1, int(p * len(back)))] if back else None

    slow = [x for x in ls if x["back_s"] is not None and x["back_s"] > BACK_TARGET_S]
    return {"losses": len(ls), "back": len(back), "never_back": [x for x in ls if x["back_s"] is None],
            "slower_than_target": len(slow), "target_s": BACK_TARGET_S,
            "slower_with_another_loss_meanwhile": sum(1 for x in slow if x["meanwhile"]),
            "slower_hit_again": sum(1 for x in slow if x["hit_again"]),
            "slower_for_no_reason_found": [x for x in slow if not x["meanwhile"] and not x["hit_again"]],
            "back_s": {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": back[-1] if back else None,
                       "mean": round(statistics.fmean(back), 3) if back else None},
            "by_how": {h: sum(1 for x in ls if x["how"] == h) for h in ("rejoin", "restore", "view", "continued")},
            "gaps": len(gs), "unexplained_gaps": [g for g in gs if not g["explained"]],
            "slowest": sorted(ls, key=lambda x: -(x["back_s"] or 0.0))[:10]}
