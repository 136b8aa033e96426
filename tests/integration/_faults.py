"""Run a real job with injected faults, then check what must hold whatever failed.

:func:`run_job` launches agents and workers through
:func:`unbroken.agent.launcher.launch` (CPU, gloo, real signals) and returns a
:class:`Job` with the summary and every event and ledger record of the run.
:func:`check_invariants` asserts the end state every failover scenario shares:
the run finished, every ``(step, slot, row)`` was trained exactly once, the
live workers agree bit for bit, and nothing of the job is left running or
listening.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from unbroken.agent.launcher import launch
from unbroken.config import Config, config_from_dict, load_config
from unbroken.jsonl import read_jsonl
from unbroken.runtime.ledger import check_ledger, read_events

MICRO_BATCH = 4
RECONFIGURE_SLACK_S = 10.0
"""A view change may take this much longer than the heartbeat timeout (generous: the machine may be loaded)."""
Item = tuple[int, int, int, int, str]
"""``(worker, slot, first row, end row, mode)`` of one piece of a step's work."""


def failover_config(corpus_overrides: list[str], steps: int, *extra: str) -> Config:
    """The debug model on small micro-batches (steps of tens of milliseconds on two cores).

    The takeover policy is ``neighbor`` (MeCeFO) unless ``extra`` says otherwise:
    scenarios assert who covers which rows, so they must not follow the default.
    """
    return load_config(preset_name="debug", overrides=corpus_overrides + [
        f"train.steps={steps}", "train.val_every=0", "train.val_batches=1", "optim.warmup_steps=2",
        "optim.eps=1e-6", f"data.micro_batch={MICRO_BATCH}", "data.seq_len=32", "mecefo.policy=neighbor", *extra])


@dataclasses.dataclass(kw_only=True)
class Job:
    """A finished run: its config (as launched), summary and records."""

    run_dir: Path
    cfg: Config
    summary: dict[str, Any]
    pids: set[int]
    wall_s: float
    store: str | None = None
    """The job's etcd cluster; None: the launcher's embedded store."""

    @functools.cached_property
    def records(self) -> list[dict[str, Any]]:
        """Every record of the run's event files (read once: the run is over)."""
        return read_events(self.run_dir)

    def events(self, name: str, **match: Any) -> list[dict[str, Any]]:
        """Event records named ``name`` whose fields equal ``match``, in file order."""
        return [r for r in self.records if r.get("kind") == "event" and r.get("event") == name
                and all(r.get(k) == v for k, v in match.items())]

    def commit_gen(self, step: int) -> int:
        gens = {r["gen"] for r in self.records if r.get("kind") == "commit" and r["step"] == step}
        assert len(gens) == 1, f"step {step} committed under generations {sorted(gens)}"
        return gens.pop()

    def committed_items(self, step: int) -> list[Item]:
        """The work of ``step``'s committed attempt, sorted by slot and row."""
        gen = self.commit_gen(step)
        items = [(r["worker"], *it) for r in self.records
                 if r.get("kind") == "work" and r["step"] == step and r["gen"] == gen for it in r["items"]]
        return sorted(items, key=lambda i: (i[1], i[2], i[0]))

    def slot_items(self, step: int, slot: int) -> list[Item]:
        return [i for i in self.committed_items(step) if i[1] == slot]

    def committers(self, step: int) -> set[int]:
        return {r["worker"] for r in self.records if r.get("kind") == "commit" and r["step"] == step}

    def train_records(self) -> list[dict[str, Any]]:
        return [r for r in read_jsonl(self.run_dir / "metrics.jsonl") if r["kind"] == "train"]

    def final_view(self) -> dict[str, Any]:
        return max(self.events("view_adopted"), key=lambda e: e["gen"])


class Pace:
    """Holds a job back while a restarted worker gets ready, so that the job cannot run out of steps first however
    slow the machine: from a joiner's start (``worker_start`` with ``join``, or a standby handed a worker) until it
    is admitted (``rejoined``) or gone (``worker_exit``), every other worker the job started runs only a slice of
    :attr:`SLICE_S` in every :attr:`PERIOD_S` (SIGSTOP / SIGCONT), while the joiner runs freely.

    The pause is far below the heartbeat timeout (a stopped member is not judged hung), and a joiner's admission
    still goes through its members, only slower. Pass it as ``run_job(..., pace=True)``; it sees the launcher's
    merged events.
    """

    SLICE_S = 0.02
    PERIOD_S = 0.2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pids: dict[int, int] = {}
        """Worker -> the pid of its newest process."""
        self._waiting: dict[int, int] = {}
        """Joiners not admitted yet: worker -> pid."""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pace", daemon=True)
        self._thread.start()

    def __call__(self, e: dict[str, Any]) -> None:
        name, w, pid = e.get("event"), e.get("worker"), e.get("pid")
        with self._lock:
            if name in ("worker_start", "standby_assign") and isinstance(w, int) and isinstance(pid, int):
                self._pids[w] = pid
                if e.get("join") or name == "standby_assign":
                    self._waiting[w] = pid
            elif name == "rejoined" or (name == "worker_exit" and self._waiting.get(w) == e.get("pid")):
                self._waiting.pop(w, None)

    def _others(self) -> list[int]:
        with self._lock:
            if not self._waiting:
                return []
            return [pid for w, pid in self._pids.items() if w not in self._waiting]

    def _run(self) -> None:
        while not self._done.is_set():
            held = self._others()
            if not held:
                self._done.wait(self.SLICE_S)
                continue
            _signal_all(held, signal.SIGSTOP)
            self._done.wait(self.PERIOD_S - self.SLICE_S)
            _signal_all(held, signal.SIGCONT)
            self._done.wait(self.SLICE_S)

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)
        with self._lock:
            _signal_all(list(self._pids.values()), signal.SIGCONT)


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_job(cfg: Config, run_dir: Path, *, nodes: int, workers_per_node: int, fail_at: str = "",
            restart: str = "never", store: str | None = None, standby: bool = False,
            on_record: Callable[[dict[str, Any]], None] | None = None,
            on_event: Callable[[dict[str, Any]], None] | None = None, pace: bool = False) -> Job:
    """Launch the job (on the etcd cluster ``store``, if given; with a warm standby per node if ``standby``);
    records every pid the run directory names.

    ``on_record`` and ``on_event``: a scenario's own reactions to the run's records and events (as the launcher
    merges them), for faults that follow what the job does rather than its steps. ``pace``: the job is held back
    while a restarted worker gets ready (:class:`Pace`), for scenarios that need it back before the end.
    """
    pids: set[int] = set()
    pacer = Pace() if pace else None
    if pacer is not None:
        user_on_event = on_event

        def on_event(e: dict[str, Any]) -> None:
            pacer(e)
            if user_on_event is not None:
                user_on_event(e)

    def seen(record: dict[str, Any]) -> None:
        pids.update(_pid_files(run_dir))
        if on_record is not None:
            on_record(record)

    t0 = time.monotonic()
    try:
        summary = launch(cfg, run_dir, nodes=nodes, workers_per_node=workers_per_node, fail_at=fail_at,
                         restart=restart, on_record=seen, on_event=on_event, store=store, standby=standby)
    finally:
        if pacer is not None:
            pacer.close()
    wall = time.monotonic() - t0
    pids.update(_pid_files(run_dir))
    for path in (run_dir / "events").glob("agent*.jsonl"):
        for e in read_jsonl(path):
            pids.update([e["pid"]] if "pid" in e else [])
            pids.update(e.get("pids", []))
    launched = config_from_dict(cfg.to_dict())
    launched.train.workers = nodes * workers_per_node
    return Job(run_dir=run_dir, cfg=launched, summary=summary, pids=pids, wall_s=wall, store=store)


def check_invariants(job: Job, *, live: list[int]) -> None:
    """What every scenario must end with; ``live``: the workers alive at the end.

    Leaks are checked first: they must be judged right after ``launch`` returned.
    """
    leaked = [pid for pid in sorted(job.pids) if _ours_alive(pid, job.run_dir)]
    assert job.pids, "no process of the job was seen"
    assert not leaked, f"processes of the job still running after launch returned: {leaked}"
    if job.store is None:
        port = store_port(job.run_dir)
        assert port_free(port), f"the store port {port} is still in use after launch returned"
    else:
        left = etcd_keys_left(job)
        assert left == 0, f"{left} keys of the job are still on {job.store} after launch returned"

    cfg, s = job.cfg, job.summary
    assert s["steps"] == cfg.train.steps, f"the run stopped at step {s['steps']} of {cfg.train.steps}"
    ledger = check_ledger(job.run_dir, n_slots=cfg.n_slots, n_workers=cfg.train.workers, micro_batch=cfg.data.micro_batch,
                          steps=cfg.train.steps)
    assert ledger.ok, f"ledger violated: {ledger.to_json()}"
    assert ledger.committed == cfg.train.steps
    final = job.final_view()
    assert sorted(final["members"]) == live, f"final view {final}"
    last = job.train_records()[-1]
    assert last["live_workers"] == len(live)
    assert last["degraded"] == [k for k in range(cfg.n_slots) if k % cfg.train.workers not in live]
    reports = sorted(int(p.stem[1:]) for p in (job.run_dir / "workers").glob("w*.json"))
    assert reports == live, f"reports from workers {reports}, live at the end: {live}"
    assert s["workers_agree"], f"live workers hold different parameters: {s['param_digest']}"
    assert job.committers(cfg.train.steps - 1) == set(live), "every live worker applies the last step"
    # Failover must be quick: no blocking wait may stand in for failure detection.
    bound = cfg.fault.heartbeat_timeout_s + RECONFIGURE_SLACK_S
    slow = [e for e in job.events("reconfigured") if e["seconds"] > bound]
    assert not slow, f"view changes took longer than {bound} s: {[(e['worker'], e['gen'], e['seconds']) for e in slow]}"


def check_fenced_and_taken_over(job: Job, *, worker: int, step: int, by: int, rejoined: str) -> None:
    """``worker`` left fenced in ``step`` of view 0, the rest moved on in view 1 and its neighbour ``by`` took its
    slot of that step over once, approximated; its agent replaced it (``rejoined``: the message otherwise)."""
    (exit_,) = job.events("worker_exit", worker=worker, clean=False)
    assert exit_["code"] == 3 and exit_["fenced"], "it left fenced"
    (view,) = [v for v in job.events("view_adopted", worker=0) if v["step"] == step and v["gen"] == 1]
    assert view["members"] == sorted({0, 1, 2} - {worker}) and view["reason"] == f"dead [{worker}]"
    assert job.commit_gen(step) == 1 and [i for i in job.committed_items(step) if i[1] == worker] == [
        (by, worker, 0, MICRO_BATCH, "approx")], f"its rows of step {step} taken over by its neighbour, once"
    assert len(job.events("rejoined", worker=worker)) == 1, rejoined


def etcd_keys_left(job: Job) -> int:
    """How many keys of the job (under its secret's namespace) are still on its etcd cluster."""
    from unbroken.store.etcd_backend import EtcdBackend
    from unbroken.store.backend import job_secret

    return EtcdBackend(job.store, job_secret(job.run_dir), timeout_s=10).num_keys()


def store_port(run_dir: Path) -> int:
    """The store's port, from the command line logged at a worker's start."""
    header = (run_dir / "logs" / "w0.log").read_text().splitlines()[0]
    found = re.search(r"--store \S+:(\d+)", header)
    assert found, f"no --store in {header!r}"
    return int(found.group(1))


def port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` again (connections in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def _pid_files(run_dir: Path) -> set[int]:
    out = set()
    for p in (run_dir / "pids").glob("*"):
        try:
            out.add(int(p.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass  # removed or being replaced right now
    return out


def _ours_alive(pid: int, run_dir: Path) -> bool:
    """A live (not zombie) process of this run; a recycled pid of someone else's process does not count.

    Ours: the run directory on its command line, or its output going to the run's logs (a process forked
    without ``exec``, such as an agent from the agent server or a worker from its template, keeps its
    parent's command line).
    """
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, IndexError):
        return False
    outputs = []
    for fd in (1, 2):
        try:
            outputs.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return state != "Z" and any(str(run_dir) in where for where in (cmdline, *outputs))

