"""TensorBoard event files in ``RUN/tensorboard``: one directory per job, its step axis the training step.

Each ``train`` line becomes scalars under ``train/`` (loss, lr, grad norm, tokens/s, live workers, degraded
slots, MFU or FLOP/s where present), each ``val`` line ``val/loss`` and ``val/ppl``; an event worth seeing
(:func:`~unbroken.monitor.job_state.annotation`) is a text under ``events`` and a step of the cumulative
``events/failures``, ``events/rejoins`` or ``events/restores``, next to the loss, at its step or the newest
step written if that is later (an earlier step reads to TensorBoard as a restart). A ``rewind``
(the job continues from an earlier step: ``--resume``, a restart from a checkpoint) reopens the writer
with ``purge_step``, so TensorBoard hides the steps that were trained again.
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

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (unbroken[monitor])

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self._purge, flush_secs=5)
        self._purge = None

    def handle(self, kind: str, payload: dict[str, Any]) -> None:
        if kind == "rewind":
            self._purge = self._step = int(payload["step"])
            self.close()
            self.open()
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
            self._writer.add_scalar(f"events/{counter}", self._counts[counter], step)
        self._writer.add_text("events", text, step)

    def close(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # closing a writer whose directory went away: nothing more to save
                pass
            self._writer = None
