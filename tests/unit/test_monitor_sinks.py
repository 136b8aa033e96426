"""The monitor's parts without a job: alerts, a failing sink's runner, and what a later monitor of the same job
sends again (:mod:`unbroken.monitor`)."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from unbroken.config import MonitorConfig, load_config
from unbroken.monitor import process as monitor_process
from unbroken.monitor import sink_runner
from unbroken.monitor.alerts import Alerts
from unbroken.monitor.job_state import JobState
from unbroken.monitor.sink_runner import SinkRunner

pytestmark = pytest.mark.timeout(60)


def test_capacity_and_no_step_alerts_are_said_once_per_episode() -> None:
    cfg = MonitorConfig(alert_capacity=0.5, alert_capacity_s=10.0, alert_no_step_s=30.0)
    alerts, s = Alerts("run", cfg, started=0.0, hint="see X"), JobState(workers=4)
    s.record({"kind": "train", "step": 3, "loss": 1.0, "live_workers": 1, "time": 0.0})
    assert alerts.check(s, 5.0) == []
    assert alerts.check(s, 11.0) == []  # low since the check at 5 s: 6 s
    assert alerts.check(s, 16.0) == ["unbroken run: 1 of 4 workers live for 11 s (below 50%) at step 3"]
    assert alerts.check(s, 20.0) == []
    quiet = alerts.check(s, 31.0)
    assert quiet == ["unbroken run: no step for 31 s (last: step 3); see X"]
    assert alerts.check(s, 40.0) == []
    s.record({"kind": "train", "step": 4, "loss": 1.0, "live_workers": 4, "time": 41.0})
    assert alerts.check(s, 42.0) == []
    s.event({"event": "job_restore", "failed_restores": [["RuntimeError at x.py:3"]]})
    assert alerts.check(s, 43.0) == ["unbroken run: a restore failed (1 so far): ['RuntimeError at x.py:3']"]


class _Flaky:
    name = "flaky"

    def __init__(self, failures: int) -> None:
        self.left, self.got, self.done = failures, [], threading.Event()

    def open(self) -> None:
        pass

    def handle(self, kind: str, payload: dict[str, Any]) -> None:
        if self.left:
            self.left -= 1
            raise ConnectionRefusedError("no service")
        self.got.append(payload["n"])
        if len(self.got) == 3:
            self.done.set()

    def close(self) -> None:
        pass


def test_a_failing_sink_is_said_once_retried_and_gets_every_item_in_order(monkeypatch, caplog) -> None:
    monkeypatch.setattr(sink_runner, "FIRST_BACKOFF_S", 0.01)
    sink = _Flaky(failures=3)
    runner = SinkRunner(sink)
    with caplog.at_level(logging.WARNING, logger="unbroken.monitor.sink_runner"):
        for n in range(3):
            runner.put("record", {"n": n})  # never blocks, whatever the sink does
        assert sink.done.wait(30)
        runner.close(5.0)
    assert sink.got == [0, 1, 2]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["monitor: flaky failed (ConnectionRefusedError: no service); retrying with backoff, training "
                     "goes on", "monitor: flaky works again after 3 failed tries"], lines


class _Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.items: list[tuple[str, Any]] = []
        self.started = threading.Event()
        self.started.set()

    def put(self, kind: str, payload: dict[str, Any]) -> None:
        self.items.append((kind, payload.get("step")))

    def close(self, timeout_s: float) -> None:
        pass


def _lines(path: Path, steps: range) -> None:
    with path.open("a") as fh:
        for s in steps:
            fh.write(json.dumps({"kind": "train", "step": s, "loss": 1.0, "tokens_per_s": 1.0, "time": float(s)}) + "\n")


def test_a_later_monitor_sends_each_step_once_and_rewinds_to_where_the_job_continues(tmp_path, monkeypatch) -> None:
    cfg = load_config(overrides=["monitor.tensorboard=true"])
    recorder = _Recorder()
    monkeypatch.setattr(monitor_process, "build_sinks", lambda *a: [recorder])
    metrics = tmp_path / "metrics.jsonl"
    _lines(metrics, range(1, 11))
    first = monitor_process.Monitor(tmp_path, cfg)
    first.poll()
    first.finish(True, "")
    assert recorder.items == [("record", s) for s in range(1, 11)]

    recorder.items.clear()  # --resume from step 6: the metrics are cut back to it, then steps 7.. come again
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:6]))
    second = monitor_process.Monitor(tmp_path, cfg)
    second.poll()
    _lines(metrics, range(7, 9))
    second.poll()
    assert recorder.items == [("rewind", 7), ("record", 7), ("record", 8)]

    recorder.items.clear()  # a restore inside the job goes back to step 5: its steps are written again
    _lines(metrics, range(6, 7))
    second.poll()
    assert recorder.items == [("rewind", 6), ("record", 6)]


def test_a_rewind_keeps_the_failure_marks_it_would_hide(tmp_path: Path) -> None:
    """A whole-job failure is marked at the newest step written (25); the restore goes back to step 20, whose
    rewind purges steps 20 on: the mark comes back at step 20 instead of vanishing with them."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from unbroken.monitor.tensorboard_sink import TensorBoardSink

    sink = TensorBoardSink(tmp_path / "tb")
    sink.open()
    for step in range(1, 26):
        sink.handle("record", {"kind": "train", "step": step, "loss": 1.0})
        if step == 5:
            sink.handle("event", {"event": "worker_exit", "worker": 1, "code": -9, "step": 5})
    sink.handle("event", {"event": "worker_exit", "worker": 0, "code": -9, "step": 25})
    sink.handle("rewind", {"step": 20})
    for step in range(20, 31):
        sink.handle("record", {"kind": "train", "step": step, "loss": 0.5})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    failures = [(e.step, e.value) for e in acc.Scalars("events/failures")]
    assert failures == [(5, 1.0), (20, 2.0)]
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 31))
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("events/text_summary")]
    assert {(5, "worker 1 died (exit code -9)"), (20, "worker 0 died (exit code -9)")} <= set(texts), texts
