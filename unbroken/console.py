"""The command line's output of a run: a status line, event lines, the summary.

:class:`Console` is handed the run's records as they appear (``train`` and
``val`` records of ``metrics.jsonl``; the merged events of ``events.jsonl``,
see :mod:`unbroken.agent.events`) and prints them:

- on a terminal, one live status line (step/total, loss, tokens/s, ETA,
  generation, live workers, degraded slots, last stall, MFU or FLOP/s, device
  memory, lr; each where the record has it) rewritten in place;
  events and validation results are printed above it as lines of their own;
- anywhere else (a pipe, a log file), one plain line per ``every`` steps
  (about 5% of the run, a multiple of ``train.log_every``), a line per event,
  and the status line right after an event; each at most :data:`LOG_WIDTH`
  columns (the terminal width fallback), so a log never wraps.

An event every worker records on its own and that has no wording of its own
(``snapshot_plan``, ``start_phases``...) is folded into one line per event and
view ("snapshot plan agreed by 4 of 4 workers"), printed once every live
worker said it, or with the count so far before the next line; each worker's
record stays in ``events.jsonl``.

Invariants: a line is never wrapped nor cut inside a field: a line that does
not fit drops whole trailing fields (the status line's least wanted ones; an
event's trailing clauses, marked ``…``: the whole record is in
``events.jsonl``); only :class:`Console` writes, the ``format_*`` and
``describe_event`` functions only format.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import signal
import sys
from typing import Any, Callable, TextIO

Record = dict[str, Any]

SEP = "  "
"""Between the fields of a line."""
LOG_WIDTH = 80
"""The most columns a line takes when the output is not a terminal (the usual terminal width fallback)."""
MORE = " …"
"""Ends an event line whose trailing clauses were dropped to fit."""
CLEAR_LINE = "\r\x1b[K"
"""Back to the start of the terminal's line and erase it."""


@dataclasses.dataclass
class RunState:
    """What the status line shows besides the last ``train`` record, kept up to date from events."""

    workers: int
    step: int = 0
    """Committed steps (the step in progress, 0-based, for an event that names none)."""
    gen: int | None = None
    members: list[int] | None = None
    stall: tuple[float, int] | None = None
    """The last view change: its duration in seconds and the step it happened at."""
    interval_shown: int | None = None
    """The snapshot interval (``snapshot.every=auto``) the last line about it showed."""
    store_p99: dict[int, float] = dataclasses.field(default_factory=dict)
    """Each worker's newest ``store_latency`` p99 (seconds): the status line shows the slowest."""

    def observe(self, ev: Record) -> None:
        if ev.get("event") in ("view_adopted", "reconfigured") and "members" in ev:
            self.gen, self.members = ev.get("gen", self.gen), sorted(ev["members"])
        if ev.get("event") == "reconfigured" and "seconds" in ev:
            self.stall = (float(ev["seconds"]), int(ev.get("step", self.step)))
        if ev.get("event") == "store_latency" and isinstance(ev.get("p99_s"), (int, float)):
            self.store_p99[int(ev["worker"])] = float(ev["p99_s"])


# ---------------------------------------------------------------------------
# formatting


def format_status(rec: Record, *, total: int, workers: int, stall: tuple[float, int] | None,
                  store_p99_s: float | None = None) -> list[str]:
    """The fields of the status line for a ``train`` record (join them with :data:`SEP`).

    Most wanted first: a narrow terminal shows the leading ones (:func:`fit`).
    """
    fields = [f"step {rec['step']}/{total}", f"loss {rec['loss']:.4f}", f"{rec['tokens_per_s']:,.0f} tok/s"]
    if isinstance(rec.get("eta_s"), (int, float)):
        fields.append(f"ETA {format_duration(rec['eta_s'])}")
    if rec.get("generation") is not None:
        fields.append(f"g{rec['generation']}")
    if "live_workers" in rec:
        live = rec["live_workers"]
        fields.append(f"live {len(live) if isinstance(live, list) else live}/{workers}")
    if "degraded" in rec:
        slots = [d["slot"] if isinstance(d, dict) else d for d in rec["degraded"]]
        fields.append(f"degraded {','.join(map(str, slots)) or '-'}")
    fields.append("stall -" if stall is None else f"stall {stall[0]:.2f} s (step {stall[1]})")
    if isinstance(rec.get("mfu"), (int, float)):
        fields.append(f"MFU {100 * rec['mfu']:.1f}%")
    elif isinstance(rec.get("flops_per_s"), (int, float)):
        fields.append(f"{rec['flops_per_s'] / 1e12:.2f} TFLOP/s")
    if isinstance(rec.get("device_memory_bytes"), (int, float)):
        fields.append(f"mem {rec['device_memory_bytes'] / 2**30:.1f} GiB")
    if store_p99_s is not None:  # the slowest worker's store requests (store_latency events)
        fields.append(f"store p99 {1000 * store_p99_s:.1f} ms")
    if "lr" in rec:
        fields.append(f"lr {rec['lr']:.2e}")
    return fields


def format_duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h07m``, ``2d04h``: the two largest units."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_val(rec: Record, *, total: int) -> str:
    return SEP.join([f"step {rec['step']}/{total}", f"val loss {rec['val_loss']:.4f}", f"ppl {rec['val_ppl']:.2f}"])


def format_event(ev: Record, state: RunState) -> str | None:
    """``step S  gG  what happened`` for an event, or None for one not worth a line (a clean exit...).

    ``state`` is the run before the event: it supplies the step and generation an event does not
    name (the agents' events) and who was live.
    """
    text = describe_event(ev, state)
    if text is None:
        return None
    step = ev.get("step", ev.get("progress"))
    gen = ev.get("gen", state.gen)
    return SEP.join([f"step {state.step if step is None else step}", f"g{'-' if gen is None else gen}",
                     one_line(text)])


FOLDED_WORDS: dict[str, str] = {
    "snapshot_plan": "snapshot plan agreed by",
    "start_phases": "training started by",
    "state_loaded": "state loaded by",
    "compiled": "model compiled by",
}
"""How a folded per-worker event reads (``<words> K of N workers``); another reads ``<event>: K of N workers``."""


def foldable(ev: Record) -> bool:
    """A worker's own record of an event every worker records, with no wording of its own (module docstring)."""
    return ev.get("worker") is not None and ev.get("event", "?") not in _DESCRIBE


def format_folded(name: str, count: int, of: int) -> str:
    words = FOLDED_WORDS.get(name)
    return f"{words} {count} of {of} workers" if words else f"{name}: {count} of {of} workers"


def describe_event(ev: Record, state: RunState) -> str | None:
    name = ev.get("event", "?")
    describe = _DESCRIBE.get(name)
    if describe is not None:
        return describe(ev, state)
    who = f"worker {ev['worker']}: " if ev.get("worker") is not None else ""
    return f"{who}{name}"


def _worker_exit(ev: Record, state: RunState) -> str | None:
    if ev.get("clean") or ev.get("stopped_by_agent"):
        return None
    w = ev.get("worker")
    text = f"worker {w} {'was fenced' if ev.get('fenced') else 'died'} ({_exit_how(ev)})"
    if state.members is not None:
        live = [m for m in state.members if m != w]
        text += f": {len(live)} of {state.workers} live"
    if ev.get("restart_at_step") is not None:
        return text + f"; restart at step {ev['restart_at_step']}"
    if ev.get("restart_in_s") is not None:
        return text + f"; restart in {ev['restart_in_s']:.1f} s"
    return text + "; not restarted"


def _exit_how(ev: Record) -> str:
    if ev.get("signal") is not None:
        try:
            return signal.Signals(ev["signal"]).name
        except ValueError:
            return f"signal {ev['signal']}"
    return f"exit code {ev.get('code')}"


def _fault_injected(ev: Record, state: RunState) -> str:
    if ev.get("by") == "worker":  # a gray failure (slow, bitflip, nan) the worker inflicts on itself
        return f"fault {ev.get('spec', '?')} injected by worker {ev.get('worker')} at step {ev.get('step')}"
    targets = ev.get("targets") or []
    to = f"workers {_ids(targets)}" if len(targets) != 1 else f"worker {targets[0]}"
    by = " by chaos" if ev.get("by") == "chaos" else ""
    if ev.get("lost_node"):
        return f"node lost{by}: {ev.get('signal', 'signal')} to {to} + agent ({ev.get('spec', '?')})"
    return f"fault {ev.get('spec', '?')} injected{by}: {ev.get('signal', 'signal')} to {to}"


def _reconfigured(ev: Record, state: RunState) -> str:
    members = sorted(ev.get("members", []))
    degraded = sorted(set(range(state.workers)) - set(members))
    text = f"new view in {ev.get('seconds', 0.0):.2f} s: {len(members)} of {state.workers} live ({_ids(members)})"
    return text + (f", slot{'s' if len(degraded) > 1 else ''} {_ids(degraded)} degraded" if degraded else "")


def _view_adopted(ev: Record, state: RunState) -> str | None:
    joiners = ev.get("joiners") or []
    if not joiners:
        return None  # the first view, or a failure's (its ``reconfigured`` says it, with the stall)
    members = ev.get("members", [])
    return f"view admits worker{'s' if len(joiners) > 1 else ''} {_ids(joiners)}: {len(members)} of " \
           f"{state.workers} live"


def _takeover(ev: Record, state: RunState) -> str:
    rows = ", ".join(f"slot {s} rows {a}-{b} ({mode})" for s, a, b, mode in ev.get("items", []))
    return f"worker {ev.get('worker')} covers {rows or 'nothing'}"


def _worker_start(ev: Record, state: RunState) -> str | None:
    if not ev.get("join"):
        return None  # the run's first workers
    how = ("from the warm standby" if ev.get("standby") else "forked from its node's template" if ev.get("forked")
           else "as a fresh process")
    return f"worker {ev.get('worker')} restarted {how} (incarnation {ev.get('incarnation')}), asks to join"


def _late_result(ev: Record, state: RunState) -> str:
    what = ev.get("what", "all-reduce")
    if ev.get("ok"):
        return f"worker {ev.get('worker')}: false alarm, its {what} completed {ev.get('seconds', 0.0):.2f} s late"
    return f"worker {ev.get('worker')}: false alarm, its {what} failed; it leaves and rejoins"


INTERVAL_NEWS = 0.25
"""A snapshot interval within this share of the one last shown is not news (no line)."""


def _snapshot_interval(ev: Record, state: RunState) -> str | None:
    """Every member decides the same interval at the same step: one line, from the first live member; and
    only when it moved by more than :data:`INTERVAL_NEWS` from the one last shown (the auto cadence follows
    the measured writes, so it wanders by a step or two: 33, 30, 32, 34 is one line)."""
    if state.members and ev.get("worker") != state.members[0]:
        return None
    interval, shown = ev.get("interval"), state.interval_shown
    if isinstance(interval, int) and isinstance(shown, int) and interval > 1 and shown > 1 \
            and abs(interval - shown) <= INTERVAL_NEWS * shown:
        return None
    state.interval_shown = interval if isinstance(interval, int) else None
    write = ev.get("write_s")
    measured = f"writes of {write:.2f} s" if isinstance(write, (int, float)) else "first snapshot, not measured yet"
    cost = ev.get("cost_s")
    if isinstance(cost, (int, float)):
        measured += f", each costing the training {cost:.3f} s"
    every = "snapshot every step" if ev.get("interval") == 1 else f"snapshot every {ev.get('interval')} steps"
    return f"{every} ({measured}; a whole-job failure goes back at most {ev.get('recovery_point_steps')} steps)"


_DESCRIBE: dict[str, Callable[[Record, RunState], str | None]] = {
    "worker_exit": _worker_exit,
    "snapshot_interval": _snapshot_interval,
    "fault_injected": _fault_injected,
    "reconfigured": _reconfigured,
    "view_adopted": _view_adopted,
    "takeover": _takeover,
    "worker_start": _worker_start,
    "late_result": _late_result,
    # The first sentence of the reason: the rest of a gloo error is advice (it stays in events.jsonl).
    "attempt_aborted": lambda ev, st: f"attempt aborted: {str(ev.get('reason', '?')).split('. ')[0]}",
    "rejoined": lambda ev, st: f"worker {ev.get('worker')} rejoined after {ev.get('wait_s', 0.0):.1f} s",
    "fence": lambda ev, st: f"worker {ev.get('worker')} fenced (pid {ev.get('pid')}): {ev.get('reason')}",
    "standby_assign": lambda ev, st: f"warm standby takes over worker {ev.get('worker')} "
                                     f"(waited {ev.get('wait_s', 0.0):.2f} s)",
    "join_refused": lambda ev, st: f"join of worker {ev.get('worker_refused')} refused: {ev.get('reason')}",
    "fault_self": lambda ev, st: f"worker {ev.get('worker')} injects {ev.get('how')} at {ev.get('phase')}",
    "fault_resumed": lambda ev, st: f"SIGCONT to pids {_ids(ev.get('pids', []))}",
    "fault_deferred": lambda ev, st: f"fault {ev.get('spec')} waits: fault.max_down={ev.get('max_down')} "
                                     f"workers are down",
    "store_latency": lambda ev, st: None,  # a figure of the status line (RunState.observe), not a line
    "standby_ready": lambda ev, st: None,  # routine: a warm standby started (its start's CPU, for the check)
    "snapshot_sealed": lambda ev, st: None,  # routine: one per snapshot, for the benchmarks (the interval has its line)
}


def one_line(text: str) -> str:
    """``text`` with its line breaks replaced by `` / `` (a reason may quote a multi-line error) and without
    the source-file locations a collective's error carries (``[/path/pair.cc:537] ``)."""
    return re.sub(r"\[/[^\]]*\]\s*", "", re.sub(r"\s*\n\s*", " / ", text.strip()))


def shorten(line: str, width: int) -> str:
    """``line`` if it fits in ``width`` columns, else its leading clauses (cut after ``:``, ``;`` or ``,`` and
    at the fields' separator, never inside a word) and :data:`MORE`."""
    if len(line) <= width:
        return line
    parts = re.split(r"(?<=[:;,])(?= )|(?=  )", line)
    out = parts[0]
    for part in parts[1:]:
        if len(out) + len(part) + len(MORE) > width:
            break
        out += part
    return out.rstrip(" :;,") + MORE


def _ids(values: list[Any]) -> str:
    return ",".join(map(str, values)) or "none"


def format_summary(summary: Record) -> list[str]:
    """``run summary`` and one ``key  value`` line per entry, keys aligned."""
    width = max((len(k) for k in summary), default=0)
    lines = ["run summary"]
    for key, value in summary.items():
        text = f"{value:.4f}" if isinstance(value, float) else str(value)
        lines.append(f"  {key.ljust(width)}  {one_line(text)}")
    return lines


def format_verdict(v: Record) -> list[str]:
    """The demo's headline: what failed, what it cost, and the checks that say nothing was lost."""
    def seconds(xs: list[float]) -> str:
        return ", ".join(f"{x:.2f} s" for x in xs) if xs else "-"

    rel = v["val_ppl_vs_failure_free"]
    lines = [
        f"what happened   {v['steps']}/{v['of_steps']} steps; {v['failures_survived']} failures survived "
        f"({one_line(v['faults_injected']) or 'no faults injected'})",
        f"stall per failure   {seconds(v['stalls_s'])}",
        f"back at full strength after   {seconds(v['rejoins_s'])} ({v['standby_handovers']} by warm standby)",
        f"lost steps   {v['lost_steps']};  rows trained never {v['rows_trained_never']}, twice "
        f"{v['rows_trained_twice']};  degraded steps {v['degraded_steps']}",
        f"validation perplexity   {v['val_ppl']:.3f}, failure-free {v['failure_free_val_ppl']:.3f}"
        + (f" ({100 * rel:+.2f}%)" if rel is not None else ""),
    ]
    lines += [f"  {'ok  ' if ok else 'FAIL'}  {name}" for name, ok in v["checks"].items()]
    lines.append("unbroken: survived every failure, nothing lost" if v["ok"] else "unbroken: CHECKS FAILED (see above)")
    return lines


def every_n_steps(total: int, log_every: int) -> int:
    """Steps between two status lines in a log: ~5% of the run, a multiple of ``log_every`` (>= 1)."""
    log_every = max(1, log_every)
    return math.ceil(max(1, total // 20) / log_every) * log_every


# ---------------------------------------------------------------------------
# output


class Console:
    """Prints a run's progress and events (module docstring); hand it records, then :meth:`close`.

    Args:
        total: the run's last step.
        workers: data-parallel slots (``train.workers``).
        log_every: ``train.log_every``: records come every this many steps.
        stream: where to write (default ``sys.stdout``).
        live: rewrite one status line in place (default: whether ``stream`` is a terminal).
        width: the terminal's width in columns, asked at each redraw (default: the terminal's).
    """

    def __init__(self, *, total: int, workers: int, log_every: int = 1, stream: TextIO | None = None,
                 live: bool | None = None, width: Callable[[], int] | None = None) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.width = width or (lambda: shutil.get_terminal_size((80, 24)).columns)
        self.total, self.every = total, every_n_steps(total, log_every)
        self.state = RunState(workers=workers)
        self._status: list[str] | None = None  # fields of the newest status line
        self._shown = True  # the newest status line has been printed (pipe) / drawn (terminal)
        self._after_event = False
        self._folding: dict[tuple[str, Any], list[Any]] = {}  # (event, gen) -> [step shown, gen, workers seen]

    def record(self, rec: Record) -> None:
        """A ``metrics.jsonl`` record (``train`` or ``val``; others are ignored)."""
        if rec.get("kind") in ("train", "val"):
            self._flush_folded()
        if rec.get("kind") == "val":
            self._line(format_val(rec, total=self.total))
        elif rec.get("kind") == "train":
            self.state.step = int(rec["step"])
            self.state.gen = rec.get("generation", self.state.gen)
            self._status = format_status(rec, total=self.total, workers=self.state.workers, stall=self.state.stall,
                                         store_p99_s=max(self.state.store_p99.values(), default=None))
            self._shown = False
            due = rec["step"] % self.every == 0 or rec["step"] >= self.total or self._after_event
            if self.live or due:
                self._show_status()

    def event(self, ev: Record) -> None:
        """A merged event (``events.jsonl``): a line of its own when it says something; a per-worker one folded
        with the other workers' (module docstring)."""
        if foldable(ev):
            self._fold(ev)
            return
        self._flush_folded()
        line = format_event(ev, self.state)
        self.state.observe(ev)
        if line is not None:
            self._line(line)
            self._after_event = True

    def _fold(self, ev: Record) -> None:
        gen = ev.get("gen", self.state.gen)
        key = (ev.get("event", "?"), gen)
        step = ev.get("step", ev.get("progress"))
        entry = self._folding.setdefault(key, [self.state.step if step is None else step, gen, set()])
        entry[2].add(ev["worker"])
        if len(entry[2]) >= self._expected():
            self._flush_folded(key)

    def _expected(self) -> int:
        return len(self.state.members) if self.state.members else self.state.workers

    def _flush_folded(self, only: tuple[str, Any] | None = None) -> None:
        """Print the folded lines (``only``'s, or every pending one with its count so far)."""
        for key in [only] if only is not None else list(self._folding):
            step, gen, seen = self._folding.pop(key)
            of = max(len(seen), self._expected())
            # One worker's record, where more were expected, is its own: name the worker as an unfolded line would.
            text = f"worker {next(iter(seen))}: {key[0]}" if len(seen) == 1 < of else format_folded(key[0], len(seen), of)
            self._line(SEP.join([f"step {step}", f"g{'-' if gen is None else gen}", text]))
            self._after_event = True

    def summary(self, summary: Record) -> None:
        self._flush_folded()
        for line in format_summary(summary):
            self._line(line)

    def close(self) -> None:
        """End the output: the live line stays as the last line; a log gets the last status if not yet printed."""
        self._flush_folded()
        if self.live:
            if self._status is not None:
                self.stream.write("\n")
                self.stream.flush()
                self._status = None
        elif not self._shown:
            self._show_status()

    def _line(self, text: str) -> None:
        """A permanent line (above the live status line on a terminal)."""
        if self.live and self._status is not None:
            self.stream.write(CLEAR_LINE + text + "\n")
            self._draw()
        else:
            self.stream.write(shorten(text, LOG_WIDTH) + "\n")
        self.stream.flush()

    def _show_status(self) -> None:
        if self._status is None:
            return
        if self.live:
            self._draw()
        else:
            self.stream.write(fit(self._status, LOG_WIDTH) + "\n")
        self.stream.flush()
        self._shown, self._after_event = True, False

    def _draw(self) -> None:
        assert self._status is not None
        self.stream.write(CLEAR_LINE + fit(self._status, self.width() - 1))


def fit(fields: list[str], width: int) -> str:
    """The leading fields that fit in ``width`` columns, joined; whole fields only (the first always)."""
    out = fields[0]
    for f in fields[1:]:
        if len(out) + len(SEP) + len(f) > width:
            break
        out += SEP + f
    return out
