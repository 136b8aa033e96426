"""The CLI's output (``unbroken.console``): exact lines for given records, in a log and on a terminal.

Also the events it is handed: :class:`unbroken.agent.events.EventMerger` merges the
per-process event files into ``events.jsonl`` (sources, dedupe, order, new files).
"""

from __future__ import annotations

import io
import json

import pytest

from unbroken.agent.events import EventMerger
from unbroken.console import LOG_WIDTH, CLEAR_LINE, Console, RunState, every_n_steps, format_event, format_status, \
    format_summary, format_val

pytestmark = pytest.mark.timeout(30)


def train(step: int, **extra: object) -> dict[str, object]:
    rec = {"kind": "train", "step": step, "loss": 5.0, "lr": 1e-3, "tokens_per_s": 1234.4, "generation": 1,
           "live_workers": 4, "degraded": []}
    return {**rec, **extra}


DEATH = {"kind": "event", "event": "worker_exit", "node": 0, "worker": 1, "signal": 9, "code": None,
         "clean": False, "fenced": False, "progress": 41, "restart_at_step": 60, "restart_in_s": None}


def state(**kw: object) -> RunState:
    return RunState(**{"workers": 4, "step": 41, "gen": 2, "members": [0, 1, 2, 3], **kw})


# -- formatting ----------------------------------------------------------------


def test_status_line_has_every_field():
    rec = train(41, loss=5.123456, lr=3e-4, tokens_per_s=12345.6, generation=2, live_workers=3, degraded=[1])
    line = "  ".join(format_status(rec, total=100, workers=4, stall=(1.934, 40)))
    assert line == ("step 41/100  loss 5.1235  12,346 tok/s  g2  live 3/4  degraded 1  stall 1.93 s (step 40)  "
                    "lr 3.00e-04")
    assert "  ".join(format_status(train(1), total=100, workers=4, stall=None)) == \
        "step 1/100  loss 5.0000  1,234 tok/s  g1  live 4/4  degraded -  stall -  lr 1.00e-03"


def test_status_line_of_the_simulator():
    """The simulator's records list the live workers and the degraded slots' details, and have no generation."""
    rec = train(3, live_workers=[0, 2, 3], degraded=[{"slot": 1, "mode": "approx"}])
    del rec["generation"]
    assert "  ".join(format_status(rec, total=10, workers=4, stall=None)) == \
        "step 3/10  loss 5.0000  1,234 tok/s  live 3/4  degraded 1  stall -  lr 1.00e-03"


def test_val_line():
    assert format_val({"kind": "val", "step": 12, "val_loss": 5.5, "val_ppl": 244.69}, total=12) == \
        "step 12/12  val loss 5.5000  ppl 244.69"


@pytest.mark.parametrize("event, line", [
    (DEATH, "step 41  g2  worker 1 died (SIGKILL): 3 of 4 live; restart at step 60"),
    ({**DEATH, "signal": None, "code": 3, "fenced": True, "restart_at_step": None, "restart_in_s": 0.0},
     "step 41  g2  worker 1 was fenced (exit code 3): 3 of 4 live; restart in 0.0 s"),
    ({"event": "reconfigured", "worker": 0, "step": 41, "gen": 3, "members": [0, 2, 3], "seconds": 0.4321},
     "step 41  g3  new view in 0.43 s: 3 of 4 live (0,2,3), slot 1 degraded"),
    ({"event": "takeover", "worker": 2, "step": 41, "gen": 3, "items": [[1, 0, 4, "approx"]]},
     "step 41  g3  worker 2 covers slot 1 rows 0-4 (approx)"),
    ({"event": "rejoined", "worker": 1, "gen": 4, "step": 60, "wait_s": 1.94},
     "step 60  g4  worker 1 rejoined after 1.9 s"),
    ({"event": "view_adopted", "worker": 0, "gen": 4, "step": 60, "members": [0, 1, 2, 3], "joiners": [1]},
     "step 60  g4  view admits worker 1: 4 of 4 live"),
    ({"event": "fault_injected", "node": 0, "worker": 1, "spec": "step=41:worker=1:kill", "signal": "SIGKILL",
      "targets": [1], "progress": 41, "lost_node": False},
     "step 41  g2  fault step=41:worker=1:kill injected: SIGKILL to worker 1"),
    ({"event": "fence", "node": 0, "worker": 3, "pid": 77, "reason": "no heartbeat for 2.0 s"},
     "step 41  g2  worker 3 fenced (pid 77): no heartbeat for 2.0 s"),
    ({"event": "worker_start", "node": 0, "worker": 1, "join": True, "standby": True, "incarnation": 2,
      "progress": 60}, "step 60  g2  worker 1 restarted from the warm standby (incarnation 2), asks to join"),
    ({"event": "worker_start", "node": 0, "worker": 1, "join": True, "forked": True, "incarnation": 3,
      "progress": 61}, "step 61  g2  worker 1 restarted forked from its node's template (incarnation 3), asks to join"),
    ({"event": "worker_start", "node": 0, "worker": 1, "join": True, "forked": False, "incarnation": 4,
      "progress": 62}, "step 62  g2  worker 1 restarted as a fresh process (incarnation 4), asks to join"),
    ({"event": "snapshot_restored", "worker": 2}, "step 41  g2  worker 2: snapshot_restored"),
    ({"event": "attempt_aborted", "worker": 0, "step": 41, "gen": 2,
      "reason": "gloo failed:\n  [pair.cc:537] Connection reset by peer. This is typically caused by..."},
     "step 41  g2  attempt aborted: gloo failed: / [pair.cc:537] Connection reset by peer"),
    ({"event": "fence", "node": 0, "worker": 3, "pid": 77, "reason": "no heartbeat:\n  2.0 s\n"},
     "step 41  g2  worker 3 fenced (pid 77): no heartbeat: / 2.0 s"),
    ({"event": "snapshot_interval", "worker": 0, "step": 30, "interval": 3, "recovery_point_steps": 6,
      "write_s": 0.0123, "step_s": 0.05},
     "step 30  g2  snapshot every 3 steps (writes of 0.01 s; a whole-job failure goes back at most 6 steps)"),
    ({"event": "snapshot_interval", "worker": 0, "step": 90, "interval": 9, "recovery_point_steps": 18,
      "write_s": 0.95, "step_s": 0.165, "cost_s": 0.0213},
     "step 90  g2  snapshot every 9 steps (writes of 0.95 s, each costing the training 0.021 s; a whole-job "
     "failure goes back at most 18 steps)"),
    ({"event": "snapshot_interval", "worker": 0, "step": 1, "interval": 1, "recovery_point_steps": 2,
      "write_s": None, "step_s": None},
     "step 1  g2  snapshot every step (first snapshot, not measured yet; a whole-job failure goes back at "
     "most 2 steps)"),
])
def test_event_lines(event, line):
    assert format_event(event, state()) == line


@pytest.mark.parametrize("event", [
    {**DEATH, "clean": True},
    {**DEATH, "stopped_by_agent": True},
    {"event": "view_adopted", "worker": 0, "gen": 0, "step": 0, "members": [0, 1, 2, 3], "joiners": []},
    {"event": "worker_start", "node": 0, "worker": 1, "join": False, "progress": 0},
    {"event": "snapshot_interval", "worker": 2, "step": 30, "interval": 3, "recovery_point_steps": 6},  # one line
    {"event": "snapshot_sealed", "worker": 0, "step": 9, "bytes": 100, "stage_s": 0.1, "write_s": 0.5,
     "started_at": 1.0, "sealed_at": 1.6},  # one per snapshot: for the benchmarks, not the console
])
def test_events_without_a_line(event):
    assert format_event(event, state()) is None


def test_a_snapshot_interval_that_wanders_by_a_step_or_two_is_one_line():
    st = state()
    shown = [format_event({"event": "snapshot_interval", "worker": 0, "step": step, "interval": n,
                           "recovery_point_steps": 2 * n, "write_s": 0.01}, st) is not None
             for step, n in [(6, 1), (9, 21), (12, 33), (233, 30), (376, 32), (391, 34), (396, 40), (400, 60),
                             (410, 1)]]
    assert shown == [True, True, True, False, False, False, False, True, True]


def test_summary_lines():
    assert format_summary({"steps": 12, "final_loss": 5.12345, "workers_agree": True}) == [
        "run summary", "  steps          12", "  final_loss     5.1235", "  workers_agree  True"]


def test_log_cadence():
    assert [every_n_steps(t, le) for t, le in [(12, 1), (100, 1), (100, 2), (1000, 1), (1000, 30)]] == \
        [1, 5, 6, 50, 60]


# -- output ----------------------------------------------------------------------


def test_log_output_one_whole_line_per_cadence_and_event():
    """Not a terminal: a status line every 5 steps, every event, the status after an event, the last one;
    whole lines of at most LOG_WIDTH columns whatever the terminal's width: the status line drops its
    least wanted fields whole (the new view's duration is on the event line)."""
    out = io.StringIO()
    console = Console(total=100, workers=4, stream=out, live=False, width=lambda: 20)
    console.event({"event": "view_adopted", "worker": 0, "gen": 1, "step": 0, "members": [0, 1, 2, 3]})
    for step in range(1, 8):
        console.record(train(step))
        if step == 2:
            console.event({**DEATH, "progress": 2})
            console.event({"event": "reconfigured", "worker": 0, "step": 2, "gen": 2, "members": [0, 2, 3],
                           "seconds": 0.5})
    console.close()
    tail = "1,234 tok/s  g1  live 4/4  degraded -"  # "stall 0.50 s (step 2)" would pass 80 columns
    assert out.getvalue().splitlines() == [
        "step 2  g1  worker 1 died (SIGKILL): 3 of 4 live; restart at step 60",
        "step 2  g2  new view in 0.50 s: 3 of 4 live (0,2,3), slot 1 degraded",
        f"step 3/100  loss 5.0000  {tail}",
        f"step 5/100  loss 5.0000  {tail}",
        f"step 7/100  loss 5.0000  {tail}",
    ]


def test_terminal_output_rewrites_one_line_and_keeps_whole_fields():
    out = io.StringIO()
    console = Console(total=100, workers=4, stream=out, live=True, width=lambda: 41)
    console.record(train(1))
    assert out.getvalue() == CLEAR_LINE + "step 1/100  loss 5.0000  1,234 tok/s  g1"  # "live 4/4" does not fit
    console.record(train(2))
    console.event({"event": "rejoined", "worker": 1, "gen": 1, "step": 2, "wait_s": 1.0})
    console.close()
    status2 = CLEAR_LINE + "step 2/100  loss 5.0000  1,234 tok/s  g1"
    assert out.getvalue() == (CLEAR_LINE + "step 1/100  loss 5.0000  1,234 tok/s  g1" + status2
                              + CLEAR_LINE + "step 2  g1  worker 1 rejoined after 1.0 s\n" + status2 + "\n")


# -- the merged events -----------------------------------------------------------


def _append(path, *records: dict[str, object], end: str = "\n") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records).removesuffix("\n") + end)


def test_event_merger_sources_dedupe_order_and_new_files(tmp_path):
    ev = tmp_path / "events"
    view = {"kind": "event", "event": "view_adopted", "gen": 1, "members": [0, 1]}
    _append(ev / "w0.jsonl", {**view, "worker": 0, "time": 5.0}, {"kind": "event", "event": "old", "time": 1.0},
            {"kind": "work", "step": 0, "time": 6.0})
    _append(ev / "w1.jsonl", {**view, "worker": 1, "time": 5.5})
    _append(ev / "agent0.jsonl", {"kind": "event", "event": "worker_exit", "worker": 1, "t": 4.0, "time": 4.0})
    _append(ev / "other.jsonl", {"kind": "event", "event": "ignored", "time": 9.0})
    merger = EventMerger(tmp_path, since=2.0)
    first = merger.poll()
    assert [(e["source"], e["event"]) for e in first] == [
        ("events/agent0.jsonl", "worker_exit"), ("events/w0.jsonl", "view_adopted")]
    assert merger.poll() == []  # nothing new
    _append(ev / "w1.jsonl", {"kind": "event", "event": "rejoined", "worker": 1, "time": 7.0})
    _append(ev / "w2.jsonl", {**view, "worker": 2, "gen": 2, "time": 8.0})
    _append(ev / "w2.jsonl", {"kind": "event", "event": "takeover", "time": 8.5}, end="")  # being written
    second = merger.poll()
    merger.close()
    assert [(e["source"], e["event"], e.get("gen")) for e in second] == [
        ("events/w1.jsonl", "rejoined", None), ("events/w2.jsonl", "view_adopted", 2)]
    merged = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert merged == first + second
    assert merged[0] == {"source": "events/agent0.jsonl", "kind": "event", "event": "worker_exit", "worker": 1,
                         "t": 4.0, "time": 4.0}


def test_a_long_event_line_keeps_its_leading_clauses_within_the_log_width():
    out = io.StringIO()
    console = Console(total=100, workers=4, stream=out, live=False)
    reason = ("CollectiveFailed: all-reduce of view 4 failed: [/src/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:65182: Connection reset by peer")
    console.event({"event": "attempt_aborted", "worker": 0, "step": 160, "gen": 4, "reason": reason})
    console.state.gen = 4  # an agent's event names no generation: the run's is shown
    console.event({"event": "fault_injected", "node": 1, "worker": None, "spec": "step=160:node=1:kill",
                   "signal": "SIGKILL", "targets": [2, 3], "progress": 160, "lost_node": True})
    assert out.getvalue().splitlines() == [
        "step 160  g4  attempt aborted: CollectiveFailed: all-reduce of view 4 failed \u2026",
        "step 160  g4  node lost: SIGKILL to workers 2,3 + agent (step=160:node=1:kill)",
    ]
    assert all(len(line) <= LOG_WIDTH for line in out.getvalue().splitlines())


def test_status_line_shows_eta_mfu_flops_and_device_memory() -> None:
    rec = {"kind": "train", "step": 10, "loss": 5.0, "tokens_per_s": 1234.0, "eta_s": 3725.0, "mfu": 0.412,
           "flops_per_s": 4.1e14, "device_memory_bytes": 3 * 2**30}
    assert format_status(rec, total=100, workers=1, stall=None) == \
        ["step 10/100", "loss 5.0000", "1,234 tok/s", "ETA 1h02m", "stall -", "MFU 41.2%", "mem 3.0 GiB"]
    cpu = {"kind": "train", "step": 10, "loss": 5.0, "tokens_per_s": 1234.0, "eta_s": 65.0, "flops_per_s": 2.5e11}
    assert format_status(cpu, total=100, workers=1, stall=None)[3:] == ["ETA 1m05s", "stall -", "0.25 TFLOP/s"]


def test_per_worker_events_fold_into_one_line_per_event() -> None:
    out = io.StringIO()
    console = Console(total=100, workers=4, stream=out, live=False)
    console.event({"event": "view_adopted", "gen": 0, "members": [0, 1, 2, 3], "step": 0})
    for w in (2, 0, 3, 1):
        console.event({"event": "snapshot_plan", "worker": w, "gen": 0, "step": 1})
    console.event({"event": "start_phases", "worker": 1, "gen": 0})
    console.event({"event": "start_phases", "worker": 0, "gen": 0})
    console.event({"event": "first_step_after_recovery", "worker": 3, "gen": 0, "step": 5})
    console.close()
    assert out.getvalue().splitlines() == [
        "step 1  g0  snapshot plan agreed by 4 of 4 workers",
        "step 0  g0  training started by 2 of 4 workers",
        "step 5  g0  worker 3: first_step_after_recovery",
    ]
