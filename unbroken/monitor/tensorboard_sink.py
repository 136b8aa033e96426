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

The event files are written with the ``tensorboard`` package's own writer (:class:`_EventWriter`: the records
``torch.utils.tensorboard.SummaryWriter`` writes, scalars as ``simple_value``, texts for the text plugin under
``<tag>/text_summary``), so the monitor imports no torch: about a CPU second less at each job's start.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from unbroken.monitor.job_state import annotation, is_failure

TRAIN_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "flops_per_s", "eta_s")
FLUSH_S = 5
"""The event file is flushed this often (in its writer's thread), not at each record."""


class _EventWriter:
    """``add_scalar``, ``add_text`` and ``close`` of a SummaryWriter, on ``tensorboard``'s ``EventFileWriter``
    (its own thread and queue); ``purge_step`` hides the steps from it on, as SummaryWriter's does."""

    def __init__(self, log_dir: Path, *, purge_step: int | None, flush_secs: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog  # unbroken[monitor]
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._file = EventFileWriter(str(log_dir), max_queue_size=10, flush_secs=flush_secs)
        if purge_step is not None:
            self._file.add_event(Event(step=purge_step, file_version="brain.Event:2"))
            self._file.add_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._add(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))]), step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

        metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
            plugin_name="text", content=TextPluginData(version=0).SerializeToString()))
        tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode()],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        self._add(Summary(value=[Summary.Value(tag=f"{tag}/text_summary", metadata=metadata, tensor=tensor)]), step)

    def _add(self, summary: Any, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self._file.add_event(Event(wall_time=time.time(), step=int(step), summary=summary))

    def close(self) -> None:
        self._file.close()


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
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = _EventWriter(self.log_dir, purge_step=self._purge, flush_secs=FLUSH_S)
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
