"""TensorBoard event files in ``RUN/tensorboard``: one directory per job, its step axis the training step.

Each ``train`` line becomes scalars under ``train/`` (loss, lr, grad norm, tokens/s, live workers, degraded
slots, MFU or FLOP/s where present), each ``val`` line ``val/loss`` and ``val/ppl``; an event worth seeing
(:func:`~unbroken.monitor.job_state.annotation`) is a text under ``events`` and a step of the cumulative
``events/failures``, ``events/rejoins`` or ``events/restores``, next to the loss, at its step or the newest
step written if that is later (an earlier step reads to TensorBoard as a restart). A ``rewind``
(the job continues from an earlier step: ``--resume``, a restart from a checkpoint) reopens the writer
with ``purge_step``, so TensorBoard hides the steps that were trained again; the marks it would hide with
them (a failure that caused the rewind is marked at the newest step written, past the step the job goes back
to) are written again at that step, so no failure, rejoin or restore is lost from the axis. A worker's
``store_latency`` event is ``store/p50_ms/w<worker>`` and ``store/p99_ms/w<worker>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unbroken.monitor.job_state import annotation, is_failure

TRAIN_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "flops_per_s", "eta_s")


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._writer: Any = None
        self._purge: int | None = None
        self._step = 0
        self._counts = {"failures": 0, "rejoins": 0, "restores": 0}
        self._marks: list[tuple[str, Any, int]] = []  # (tag, value, step) of each event mark written

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (unbroken[monitor])

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self._purge, flush_secs=5)
        self._purge = None

    def handle(self, kind: str, payload: dict[str, Any]) -> None:
        if kind == "rewind":
            self._purge = self._step = int(payload["step"])
            hidden = [(tag, value) for tag, value, step in self._marks if step >= self._step]
            self._marks = [m for m in self._marks if m[2] < self._step]
            self.close()
            self.open()
            for tag, value in hidden:  # the marks the purge hides, again at the step the job goes on from
                self._mark(tag, value, self._step)
        elif kind == "record" and payload.get("kind") == "train":
            self._train(payload)
        elif kind == "record" and payload.get("kind") == "val":
            self._writer.add_scalar("val/loss", payload["val_loss"], payload["step"])
            self._writer.add_scalar("val/ppl", payload["val_ppl"], payload["step"])
        elif kind == "event":
            self._event(payload)

    def _train(self, rec: dict[str, Any]) -> None:
        step = int(rec["step"])
        self._step = max(self._step, step)
        for name in TRAIN_SCALARS:
            if isinstance(rec.get(name), (int, float)):
                self._writer.add_scalar(f"train/{name}", rec[name], step)
        live = rec.get("live_workers")
        if isinstance(live, (list, int)):
            self._writer.add_scalar("train/live_workers", len(live) if isinstance(live, list) else live, step)
        if isinstance(rec.get("degraded"), list):
            self._writer.add_scalar("train/degraded_slots", len(rec["degraded"]), step)

    def _event(self, ev: dict[str, Any]) -> None:
        if ev.get("event") == "store_latency":
            step = max(int(ev.get("step") or 0), self._step)
            for name in ("p50", "p99"):
                if isinstance(ev.get(f"{name}_s"), (int, float)):
                    self._writer.add_scalar(f"store/{name}_ms/w{ev.get('worker')}", 1000 * ev[f"{name}_s"], step)
            return
        text = annotation(ev)
        if text is None:
            return
        # Never behind the newest step written: TensorBoard takes an earlier step for a restart and hides what
        # follows it (a restore's event names the step it goes back to; its ``rewind`` does that job).
        step = max(int(ev.get("step", ev.get("progress")) or 0), self._step)
        counter = ("failures" if is_failure(ev) else "rejoins" if ev.get("event") == "rejoined"
                   else "restores" if ev.get("event") == "job_restore" else None)
        if counter is not None:
            self._counts[counter] += 1
            self._mark(f"events/{counter}", self._counts[counter], step)
        self._mark("events", text, step)

    def _mark(self, tag: str, value: Any, step: int) -> None:
        if isinstance(value, str):
            self._writer.add_text(tag, value, step)
        else:
            self._writer.add_scalar(tag, value, step)
        self._marks.append((tag, value, step))

    def close(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # closing a writer whose directory went away: nothing more to save
                pass
            self._writer = None
