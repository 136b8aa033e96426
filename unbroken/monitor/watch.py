"""Starting and ending the job's monitor process from the one process that runs once per job (the launcher of
``unbroken train``; under a scheduler, the agent of node 0).

:func:`watch_job` starts ``python -m unbroken.monitor.process`` when the run's ``monitor`` section (or
``$UNBROKEN_WEBHOOK``) asks for anything, in a session of its own (a terminal's Ctrl-C stops the job, and the
monitor still reports how it ended), its log in ``RUN/logs/monitor.log``, its warnings also on this process's
standard error. At the end it tells the monitor how the job ended on its standard input and waits for it at most
:data:`END_TIMEOUT_S`. Nothing here can stop or slow the job: a monitor that cannot start is said once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import IO, Iterator

from unbroken.config import Config, config_from_dict
from unbroken.monitor.webhook import webhook_url

logger = logging.getLogger(__name__)

END_TIMEOUT_S = 60.0
"""How long the monitor may take, after the job, to hand its last lines and alerts to the sinks."""
LIBRARIES = {"tensorboard": "tensorboard", "wandb": "wandb", "prometheus_port": "prometheus_client"}


def wanted(cfg: Config) -> list[str]:
    """The watchers ``cfg`` asks for (empty: no monitor process)."""
    mo = cfg.monitor
    out = [name for name, on in (("tensorboard", mo.tensorboard), ("wandb", mo.wandb),
                                 ("prometheus_port", mo.prometheus_port is not None)) if on]
    return out + (["webhook"] if webhook_url(mo.webhook) else [])


class JobWatch:
    """The running monitor process of a job; :meth:`end` tells it how the job ended."""

    def __init__(self, proc: subprocess.Popen[bytes] | None) -> None:
        self.proc = proc
        self.ended = False

    def end(self, *, finished: bool, message: str = "") -> None:
        if self.proc is None or self.ended:
            return
        self.ended = True
        stdin: IO[bytes] | None = self.proc.stdin
        try:
            if stdin is not None:
                stdin.write((json.dumps({"finished": finished, "message": message}) + "\n").encode())
                stdin.close()
        except OSError:  # the monitor is gone already: nothing to tell
            pass
        try:
            self.proc.wait(timeout=END_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the monitor did not end %.0f s after the job: stopping it", END_TIMEOUT_S)
            self.proc.kill()
            self.proc.wait(timeout=10.0)


def start_watch(run_dir: Path) -> JobWatch:
    """Start the monitor of ``run_dir`` if its config asks for one (module docstring)."""
    try:
        cfg = config_from_dict(json.loads((run_dir / "config.json").read_text()))
    except (OSError, ValueError) as exc:
        logger.warning("no monitor: %s/config.json unreadable (%s)", run_dir, exc)
        return JobWatch(None)
    names = wanted(cfg)
    if not names:
        return JobWatch(None)
    missing = sorted({LIBRARIES[n] for n in names if n in LIBRARIES and importlib.util.find_spec(LIBRARIES[n]) is None})
    if missing:
        logger.warning("monitor: %s not installed (pip install 'unbroken[monitor]'): those watchers stay off",
                       ", ".join(missing))
    log = run_dir / "logs" / "monitor.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as fh:  # the monitor writes its log itself; a library that prints lands there too
        proc = subprocess.Popen([sys.executable, "-m", "unbroken.monitor.process", "--run-dir", str(run_dir)],
                                stdin=subprocess.PIPE, stdout=fh, start_new_session=True)
    return JobWatch(proc)


@contextlib.contextmanager
def watch_job(run_dir: str | Path, *, enabled: bool = True) -> Iterator[JobWatch]:
    """The job's monitor for the ``with`` block: an exception leaving it is the job's stop (its message alerted);
    a block that ends normally finished the job, unless it called :meth:`JobWatch.end` itself."""
    watch = start_watch(Path(run_dir)) if enabled else JobWatch(None)
    try:
        yield watch
    except BaseException as exc:
        watch.end(finished=False, message=str(exc) or type(exc).__name__)
        raise
    watch.end(finished=True)
