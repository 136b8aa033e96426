"""The job's watchers on a real job: TensorBoard, W&B (offline), the Prometheus endpoint and the webhook alerts
(:mod:`unbroken.monitor`), across a worker's kill, a whole-job kill (restored from memory), a node's loss that
stops the job, and a ``--resume``; and watchers that cannot reach their service, which never stop the training.

Offline: W&B in offline mode, the webhook a local ``http.server``.
"""

from __future__ import annotations

import http.server
import json
import queue
import socket
import struct
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from _faults import failover_config, run_job
from unbroken.agent.launcher import JobFailed, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

WATCHERS = ["monitor.tensorboard=true", "monitor.wandb=true", "monitor.wandb_mode=offline", "monitor.prometheus_port=0"]


class _Hook(http.server.BaseHTTPRequestHandler):
    posted: queue.Queue[dict[str, Any]]

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.posted.put(json.loads(body))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, queue.Queue[dict[str, Any]]]]:
    posted: queue.Queue[dict[str, Any]] = queue.Queue()
    handler = type("Hook", (_Hook,), {"posted": posted})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", posted
    server.shutdown()
    server.server_close()


def _scrape(run: Path) -> dict[str, float]:
    """The endpoint's samples (``name value`` lines), its address read from ``RUN/monitor/endpoint.json``."""
    url = json.loads((run / "monitor" / "endpoint.json").read_text())["url"]
    assert url.startswith("http://127.0.0.1:"), "bound to loopback by default"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


def _scrape_until(run: Path, ok: Any, timeout_s: float = 60.0) -> dict[str, float]:
    """Scrape until ``ok(samples)`` (the monitor follows the files every second), within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            samples = _scrape(run)
            if ok(samples):
                return samples
        except (OSError, ValueError):
            samples = {}  # not listening yet
        assert time.monotonic() < deadline, f"the endpoint never showed what was expected: {samples}"
        time.sleep(0.1)


def _scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def _wandb_runs(run: Path) -> dict[str, list[int]]:
    """Each offline run directory's run id and the steps of its ``train/loss`` rows, read from its ``.wandb`` file
    (W&B's record log: 32 KiB blocks of CRC-checked chunks, each a ``wandb_internal_pb2.Record``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = {}
    for path in sorted(run.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunks, partial = path.read_bytes(), 7, [], b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if left < 7 or (length == 0 and kind == 0):
                pos += left
                continue
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind == 1:
                chunks.append(chunk)
            elif kind in (2, 3):
                partial = (partial if kind == 3 else b"") + chunk
            elif kind == 4:
                chunks.append(partial + chunk)
        run_id, steps = None, []
        for chunk in chunks:
            rec = pb.Record()
            rec.ParseFromString(chunk)
            if rec.WhichOneof("record_type") == "run":
                run_id = rec.run.run_id
            elif rec.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
                if "train/loss" in row:
                    steps.append(int(float(row["trainer/step"])))
        out[f"{path.parent.name}:{run_id}"] = steps
    return out


def test_one_tensorboard_directory_and_one_wandb_run_across_kills_a_stop_and_a_resume(tmp_path, corpus_overrides,
                                                                                     webhook):
    url, posted = webhook
    run = tmp_path / "run"
    cfg = failover_config(corpus_overrides, 60, *WATCHERS, f"monitor.webhook={url}")
    during: dict[str, dict[str, float]] = {}

    def scrape_during(e: dict[str, Any]) -> None:
        # The launcher hands events over while the job runs, and the monitor lives until the launcher is done.
        if e.get("event") == "job_restore" and "restore" not in during:
            during["restore"] = _scrape_until(run, lambda s: s.get("unbroken_failures_total", 0) >= 2
                                              and s.get("unbroken_restores_total", 0) >= 1)

    # A worker's kill (the survivor takes over), then the other's: a whole-job failure, restored from memory.
    first = run_job(cfg, run, nodes=1, workers_per_node=2, on_event=scrape_during,
                    fail_at="step=5:worker=1:kill,step=25:worker=0:kill")
    assert first.summary["steps"] == 60
    samples = during["restore"]
    assert samples["unbroken_step"] >= 24 and samples["unbroken_workers"] == 2
    assert {"unbroken_loss", "unbroken_tokens_per_second", "unbroken_live_workers", "unbroken_stall_seconds",
            "unbroken_seconds_since_last_step", "unbroken_flops_per_second", "unbroken_snapshot_age_steps"} <= set(samples)
    assert posted.empty(), "a job that finished alerts nobody"

    # --resume runs 30 more steps; its node is lost: the job stops, the webhook says so and how to continue.
    more = failover_config(corpus_overrides, 90, *WATCHERS, f"monitor.webhook={url}")
    with pytest.raises(JobFailed):
        launch(more, run, nodes=1, workers_per_node=2, resume=True, restart="never", fail_at="step=70:node=0:kill")
    alert = posted.get(timeout=5)["text"]  # posted before launch returned: it waits for its monitor
    assert "the job stopped" in alert and f"continue with: unbroken train --resume {run}" in alert, alert

    summary = launch(more, run, nodes=1, workers_per_node=2, resume=True, restart="never")
    assert summary["steps"] == 90

    # TensorBoard: one directory, the step axis 1..90 once each, the failures marked where they happened.
    # A node lost right after a commit may take that step's record with it (its training is kept: the job is
    # restored from memory after it), so the one step a record can be missing for is the node's loss, 70; the
    # watchers show exactly the steps metrics.jsonl holds.
    recorded = sorted({r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                       if r.get("kind") == "train"})
    assert set(range(1, 91)) - set(recorded) <= {70}, recorded
    loss = _scalars(run / "tensorboard", "train/loss")
    assert [s for s, _ in loss] == recorded, loss
    failures = _scalars(run / "tensorboard", "events/failures")
    assert [v for _, v in failures] == [1.0, 2.0] and failures[0][0] >= 5, failures
    assert _scalars(run / "tensorboard", "events/restores"), "the restores are marked too"
    # W&B: three offline directories (three monitors), one run id, each step once.
    run_id = (run / "monitor" / "wandb_run_id").read_text().strip()
    wandb_runs = _wandb_runs(run)
    assert len(wandb_runs) == 3 and {k.split(":")[1] for k in wandb_runs} == {run_id}, wandb_runs
    steps = [s for per_run in wandb_runs.values() for s in per_run]
    assert sorted(set(steps)) == recorded and len(steps) == len(set(steps)), wandb_runs


def test_an_unreachable_webhook_and_a_port_in_use_never_stop_the_training(tmp_path, corpus_overrides):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: a connection is refused
    run = tmp_path / "run"
    cfg = failover_config(corpus_overrides, 20, f"monitor.prometheus_port={taken.getsockname()[1]}",
                          f"monitor.webhook=http://127.0.0.1:{closed.getsockname()[1]}/hook",
                          "monitor.alert_no_step_s=0.01")  # an alert before the first step: something to post
    try:
        job = run_job(cfg, run, nodes=1, workers_per_node=2)
    finally:
        taken.close()
        closed.close()
    assert job.summary["steps"] == 20
    log = (run / "logs" / "monitor.log").read_text()
    assert log.count("monitor: prometheus failed (OSError") == 1, log
    assert log.count("monitor: webhook failed (URLError") == 1, log
    assert "retrying with backoff, training goes on" in log


def test_monitor_overhead_benchmark_runs(tmp_path, corpus_overrides, capsys):
    from benchmarks.monitor_overhead import main

    result = main(["--nodes", "1", "--workers-per-node", "2", "--steps", "6", "--pairs", "1", "--out", str(tmp_path),
                   *(f"--{o}" for o in corpus_overrides)])
    assert len(result["tokens_per_s_off"]) == len(result["tokens_per_s_on"]) == 1 and result["ratio"] > 0
    assert json.loads(capsys.readouterr().out)["ratio"] == result["ratio"]
    assert (tmp_path / "on0" / "tensorboard").is_dir() and not (tmp_path / "off0" / "monitor").exists()
    assert all(0 <= share < 1 for share in result["monitor_machine_share"]), "its CPU over the machine's"
    assert json.loads((tmp_path / "on0" / "monitor" / "usage.json").read_text())["cpu_s"] > 0


def test_each_workers_store_latency_reaches_the_endpoint_and_tensorboard(tmp_path, corpus_overrides):
    run = tmp_path / "run"
    cfg = failover_config(corpus_overrides, 12, "monitor.tensorboard=true", "monitor.prometheus_port=0")
    during: dict[str, dict[str, float]] = {}

    def scrape_during(e: dict[str, Any]) -> None:
        # Each worker reports at its last step at the latest; the monitor lives until the launcher is done.
        if e.get("event") == "store_latency" and "latency" not in during:
            during["latency"] = _scrape_until(run, lambda s: any(k.startswith("unbroken_store_request_seconds")
                                                                 for k in s))

    job = run_job(cfg, run, nodes=1, workers_per_node=2, on_event=scrape_during)
    assert job.summary["steps"] == 12
    reports = [e for w in (0, 1) for e in _events(run / "events" / f"w{w}.jsonl") if e.get("event") == "store_latency"]
    assert {e["worker"] for e in reports} == {0, 1} and all(
        e["calls"] > 0 and 0 < e["p50_s"] <= e["p99_s"] <= e["max_s"] for e in reports), reports
    assert any(k.startswith("unbroken_store_request_seconds{") and 'quantile="0.99"' in k for k in during["latency"])
    for w in (0, 1):
        assert _scalars(run / "tensorboard", f"store/p99_ms/w{w}"), f"worker {w}'s p99 on TensorBoard"


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
