"""A Weights & Biases run, one per job: its id is kept in ``RUN/monitor/wandb_run_id`` and taken up again by every
later monitor of the job (a new leader, ``--resume``, a Slurm requeue), with ``resume="allow"``.

``train`` and ``val`` lines are logged against the ``trainer/step`` axis, each step once (a step trained again
after a restore keeps its first value), events worth seeing (:func:`~unbroken.monitor.job_state.annotation`) as
``events/*`` counters and a text beside them, a worker's ``store_latency`` event as ``store/p50_ms/w<worker>``
and ``store/p99_ms/w<worker>``. ``monitor.wandb_mode=offline`` writes under ``RUN/wandb`` only.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from unbroken.monitor.job_state import annotation, is_failure

RUN_ID_FILE = "wandb_run_id"


def job_run_id(monitor_dir: Path) -> str:
    """The job's W&B run id: read from ``monitor_dir``, or made and written there once."""
    path = monitor_dir / RUN_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    monitor_dir.mkdir(parents=True, exist_ok=True)
    run_id = secrets.token_hex(4)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(run_id)
    tmp.replace(path)
    return run_id


class WandbSink:
    name = "wandb"

    def __init__(self, run_dir: Path, monitor_dir: Path, *, project: str, entity: str, mode: str,
                 config: dict[str, Any]) -> None:
        self.run_dir, self.monitor_dir = run_dir, monitor_dir
        self.project, self.entity, self.mode, self.config = project, entity, mode, config
        self._run: Any = None
        self._step = 0
        self._counts = {"failures": 0, "rejoins": 0, "restores": 0}

    def open(self) -> None:
        import wandb  # unbroken[monitor]

        run = wandb.init(project=self.project, entity=self.entity or None, id=job_run_id(self.monitor_dir),
                         resume="allow", mode=self.mode,  # type: ignore[arg-type]  # a Literal the config checked
                         dir=str(self.run_dir), name=self.run_dir.name,
                         config=self.config, settings=wandb.Settings(silent=True, console="off"))
        run.define_metric("trainer/step")
        for prefix in ("train/*", "val/*", "events/*", "store/*"):
            run.define_metric(prefix, step_metric="trainer/step")
        self._run = run

    def handle(self, kind: str, payload: dict[str, Any]) -> None:
        if kind == "record" and payload.get("kind") == "train":
            if int(payload["step"]) <= self._step:
                return  # a step trained again (a restore, a rewind): W&B keeps its first value, its axis never turns back
            self._step = int(payload["step"])
            row: dict[str, Any] = {f"train/{k}": v for k, v in payload.items()
                   if k not in ("kind", "step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}
            live = payload.get("live_workers")
            if isinstance(live, list):
                row["train/live_workers"] = len(live)
            if isinstance(payload.get("degraded"), list):
                row["train/degraded_slots"] = len(payload["degraded"])
            self._run.log({"trainer/step": self._step, **row})
        elif kind == "record" and payload.get("kind") == "val":
            self._run.log({"trainer/step": int(payload["step"]), "val/loss": payload["val_loss"],
                           "val/ppl": payload["val_ppl"]})
        elif kind == "event" and payload.get("event") == "store_latency":
            row = {f"store/{name}_ms/w{payload.get('worker')}": 1000 * payload[f"{name}_s"] for name in ("p50", "p99")
                   if isinstance(payload.get(f"{name}_s"), (int, float))}
            self._run.log({"trainer/step": max(int(payload.get("step") or 0), self._step), **row})
        elif kind == "event":
            text = annotation(payload)
            if text is None:
                return
            counter = ("failures" if is_failure(payload) else "rejoins" if payload.get("event") == "rejoined"
                       else "restores" if payload.get("event") == "job_restore" else None)
            row = {"trainer/step": max(int(payload.get("step", payload.get("progress")) or 0), self._step),
                   "events/text": text}
            if counter is not None:
                self._counts[counter] += 1
                row[f"events/{counter}"] = self._counts[counter]
            self._run.log(row)

    def close(self) -> None:
        if self._run is not None:
            try:
                self._run.finish()
            except Exception:  # finishing a run whose service is gone: what was logged is on disk
                pass
            self._run = None
