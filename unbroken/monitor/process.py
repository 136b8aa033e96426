"""The job's monitor process: ``python -m unbroken.monitor.process --run-dir RUN`` (started by
:func:`unbroken.monitor.watch.watch_job`).

It follows the run directory (:class:`~unbroken.monitor.follower.RunFollower`) every :data:`POLL_S`, folds
what it reads into a :class:`~unbroken.monitor.job_state.JobState` and hands it to the sinks the config's
``monitor`` section asks for, each in its own thread (:class:`~unbroken.monitor.sink_runner.SinkRunner`). It
runs at a lower priority (:data:`NICE`) than the job: on a busy machine the training comes first.
Its standard input carries the end: one JSON line ``{"finished": bool, "message": str}`` from the process that
started it, or end-of-file if that process died (then the job is taken as stopped). A job that did not
finish is alerted with its message.

What was already sent survives this process: ``RUN/monitor/progress.json`` holds the newest step and event time
handed to the sinks, so a later monitor of the same job (``--resume``, a requeue) sends each line once, and when
the job continues from an earlier step the step-axis sinks are told to rewind.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

from unbroken.config import Config, config_from_dict
from unbroken.monitor.alerts import Alerts, stopped
from unbroken.monitor.follower import RunFollower, written_at
from unbroken.monitor.job_state import JobState
from unbroken.monitor.sink_runner import SinkRunner
from unbroken.monitor.webhook import webhook_url

logger = logging.getLogger(__name__)

MONITOR_DIR = "monitor"
"""Under the run directory: the W&B run id, the endpoint's address, what was sent."""
PROGRESS_FILE = "progress.json"
USAGE_FILE = "usage.json"
"""What this monitor cost, written when it ends: ``cpu_s``, its CPU seconds (all threads, and its children
that ended: W&B's service); ``steady_cpu_s`` and ``steady_s``, its CPU and wall seconds while the job trained
with every sink started (from the first ``train`` line read once each sink opened, or failed to, to the job's
end, before the sinks' last flush): what watching costs a running job, its start-up (importing the sinks'
libraries) left out."""
POLL_S = 1.0
"""Between two reads of the run directory: the sinks' freshness, and the monitor's whole cost per period."""
NICE = 10
"""The monitor's scheduling niceness (and its children's, W&B's service): on a machine the workers fill, the
watchers get the cycles the training leaves; measured by ``python -m benchmarks.monitor_overhead``."""
CLOSE_TIMEOUT_S = 15.0
"""How long each sink may take to hand over what is queued at the end."""


def build_sinks(cfg: Config, run_dir: Path, state: JobState) -> list[SinkRunner]:
    """The sinks ``cfg.monitor`` asks for, each started in its runner."""
    mo, mdir, runners = cfg.monitor, run_dir / MONITOR_DIR, []
    if mo.tensorboard:
        from unbroken.monitor.tensorboard_sink import TensorBoardSink

        runners.append(SinkRunner(TensorBoardSink(run_dir / "tensorboard")))
    if mo.wandb:
        from unbroken.monitor.wandb_sink import WandbSink

        runners.append(SinkRunner(WandbSink(run_dir, mdir, project=mo.wandb_project, entity=mo.wandb_entity,
                                            mode=mo.wandb_mode, config=cfg.to_dict())))
    if mo.prometheus_port is not None:
        from unbroken.monitor.prometheus_endpoint import PrometheusEndpoint

        runners.append(SinkRunner(PrometheusEndpoint(state, host=mo.prometheus_host, port=mo.prometheus_port,
                                                     monitor_dir=mdir)))
    url = webhook_url(mo.webhook)
    if url:
        from unbroken.monitor.webhook import WebhookSink

        runners.append(SinkRunner(WebhookSink(url)))
    return runners


class Monitor:
    """One run directory's monitor (module docstring)."""

    def __init__(self, run_dir: Path, cfg: Config) -> None:
        self.run_dir, self.cfg = run_dir, cfg
        self.state = JobState(workers=cfg.train.workers)
        self.runners = build_sinks(cfg, run_dir, self.state)
        self.follower = RunFollower(run_dir)
        self.alerts = Alerts(run_dir.name, cfg.monitor, started=time.time(),
                             hint=f"see {run_dir / 'logs'}")
        self._progress = run_dir / MONITOR_DIR / PROGRESS_FILE
        sent = json.loads(self._progress.read_text()) if self._progress.is_file() else {}
        self.sent_step, self.sent_event = int(sent.get("step", 0)), float(sent.get("event_time", 0.0))
        self._backlog = True  # the first read: what an earlier monitor of the job may have sent
        self._last_train = 0  # the newest train line read by this monitor
        self._steady_from: tuple[float, float] | None = None  # (wall, CPU seconds): USAGE_FILE

    def poll(self) -> None:
        items = self.follower.read()
        forwarded, backlog = False, self._backlog
        if self._backlog:
            self._backlog = False
            last = max((int(r["step"]) for k, r in items if k == "record" and r.get("kind") == "train"), default=0)
            if last < self.sent_step:  # the job continues from before what was sent: those steps come again
                self._send("rewind", {"step": last + 1})
                self.sent_step = last
        for kind, rec in items:
            getattr(self.state, kind)(rec)
            if self._steady_from is None and rec.get("kind") == "train" and all(r.started.is_set()
                                                                                 for r in self.runners):
                self._steady_from = (time.monotonic(), _cpu_s())
            if kind == "record":
                step = int(rec.get("step", 0))
                if rec.get("kind") == "train":
                    if step <= self._last_train and not backlog:  # a restore goes back: the steps come again
                        self._send("rewind", {"step": step})
                        self.sent_step = step - 1
                    self._last_train = max(self._last_train, step) if backlog else step
                if step > self.sent_step or (step == self.sent_step and rec.get("kind") == "val"):
                    self._send("record", rec)
                    self.sent_step, forwarded = max(self.sent_step, step), True
            elif written_at(rec) > self.sent_event:
                self._send("event", rec)
                self.sent_event, forwarded = written_at(rec), True
        for text in self.alerts.check(self.state, time.time()):
            logger.warning("monitor: alert: %s", text)
            self._send("alert", {"text": text})
        if forwarded:
            self._save_progress()

    def finish(self, finished: bool, message: str) -> None:
        steady = None if self._steady_from is None else (time.monotonic() - self._steady_from[0],
                                                         _cpu_s() - self._steady_from[1])
        self.poll()
        if not finished:
            text = stopped(self.run_dir.name, message)
            logger.warning("monitor: alert: %s", text)
            self._send("alert", {"text": text})
        for runner in self.runners:
            runner.close(CLOSE_TIMEOUT_S)
        self._save_progress()
        self._save_usage(steady)

    def _send(self, kind: str, payload: dict[str, Any]) -> None:
        for runner in self.runners:
            runner.put(kind, payload)

    def _save_usage(self, steady: tuple[float, float] | None) -> None:
        usage = {} if steady is None else {"steady_s": round(steady[0], 3), "steady_cpu_s": round(steady[1], 3)}
        (self.run_dir / MONITOR_DIR / USAGE_FILE).write_text(json.dumps({"cpu_s": round(_cpu_s(), 3), **usage}))

    def _save_progress(self) -> None:
        self._progress.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._progress.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": self.sent_step, "event_time": self.sent_event}))
        tmp.replace(self._progress)


def _cpu_s() -> float:
    """CPU seconds of this process and of its children that ended."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _read_end(end: threading.Event, outcome: dict[str, Any]) -> None:
    """Wait for the starter's line on stdin (or its end-of-file: the starter is gone)."""
    line = sys.stdin.readline()
    try:
        outcome.update(json.loads(line) if line.strip() else {})
    except ValueError:
        pass
    end.set()


def _yield_to_training() -> None:
    """Lower this process's priority by :data:`NICE` before any sink starts (their imports, W&B's service)."""
    try:
        os.nice(NICE)
    except OSError as exc:  # a platform without it: the watchers run at the training's priority
        logger.info("monitor: could not lower its priority (%s)", exc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m unbroken.monitor.process", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    a = ap.parse_args(argv)
    run_dir = a.run_dir
    _yield_to_training()
    # Everything in the monitor's log; its warnings (a sink failing, an alert) also on the standard error it
    # shares with the process that started it, where the user watches the job.
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    to_log, to_user = logging.FileHandler(run_dir / "logs" / "monitor.log"), logging.StreamHandler(sys.stderr)
    to_log.setFormatter(fmt)
    to_user.setFormatter(logging.Formatter("%(message)s"))
    to_user.setLevel(logging.WARNING)
    logging.basicConfig(level=logging.INFO, handlers=[to_log, to_user])
    cfg = config_from_dict(json.loads((run_dir / "config.json").read_text()))
    monitor = Monitor(run_dir, cfg)
    end, outcome = threading.Event(), dict[str, Any]()
    threading.Thread(target=_read_end, args=(end, outcome), name="monitor-end", daemon=True).start()
    while not end.wait(POLL_S):
        monitor.poll()
    monitor.finish(bool(outcome.get("finished", False)),
                   str(outcome.get("message") or f"the process that ran it ended; continue with: unbroken train "
                                                  f"--resume {run_dir}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
