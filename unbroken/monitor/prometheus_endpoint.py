"""A Prometheus endpoint (``prometheus_client``) serving the job's :class:`~unbroken.monitor.job_state.JobState`.

Bound to ``monitor.prometheus_host`` (loopback by default) on ``monitor.prometheus_port`` (0: a free port);
the address is written to ``RUN/monitor/endpoint.json`` once it listens. A port in use fails :meth:`open`,
which the runner retries with backoff. Every scrape reads the state as it is (one collector, no copies).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

from unbroken.monitor.job_state import JobState

ENDPOINT_FILE = "endpoint.json"


class JobCollector:
    """The job's figures as Prometheus metric families (names ``unbroken_*``)."""

    def __init__(self, state: JobState) -> None:
        self.state = state

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, now = self.state, time.time()
        gauges = {
            "step": ("committed training steps", s.step),
            "loss": ("training loss of the newest step", s.loss),
            "tokens_per_second": ("tokens trained per second, all workers", s.tokens_per_s),
            "mfu": ("model FLOPs utilisation (GPUs of known peak)", s.mfu),
            "flops_per_second": ("training FLOP/s, all workers", s.flops_per_s),
            "eta_seconds": ("seconds to the last step at the current pace", s.eta_s),
            "workers": ("data-parallel slots of the job", s.workers),
            "live_workers": ("workers in the current view", s.live),
            "degraded_workers": ("slots covered by another worker", s.degraded),
            "stall_seconds": ("duration of the newest view change", s.stall_s),
            "seconds_since_last_step": ("seconds since the newest step was logged", s.seconds_since_step(now)),
            "snapshot_age_steps": ("steps since the newest sealed snapshot",
                                   None if s.snapshot_step is None else s.step - s.snapshot_step),
            "snapshot_age_seconds": ("seconds since the newest sealed snapshot",
                                     None if s.snapshot_time is None else max(0.0, now - s.snapshot_time)),
        }
        for name, (doc, value) in gauges.items():
            if value is not None:
                yield GaugeMetricFamily(f"unbroken_{name}", doc, value=float(value))
        counters = {
            "failures": ("workers that died or were fenced", s.failures),
            "rejoins": ("workers that rejoined", s.rejoins),
            "restores": ("whole-job restores (snapshot memory or checkpoint)", s.restores),
            "failed_restores": ("restores that failed", s.failed_restores),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"unbroken_{name}", doc, value=float(value))
        if s.store_latency:
            latency = GaugeMetricFamily("unbroken_store_request_seconds", "each worker's store requests' latency "
                                        "(quantile over the requests of its newest report)",
                                        labels=["worker", "quantile"])
            for worker, ev in sorted(s.store_latency.items()):
                for quantile, field in (("0.5", "p50_s"), ("0.99", "p99_s")):
                    if isinstance(ev.get(field), (int, float)):
                        latency.add_metric([str(worker), quantile], float(ev[field]))
            yield latency


class PrometheusEndpoint:
    name = "prometheus"

    def __init__(self, state: JobState, *, host: str, port: int, monitor_dir: Path) -> None:
        self.state, self.host, self.port, self.monitor_dir = state, host, port, monitor_dir
        self._server: Any = None

    def open(self) -> None:
        from prometheus_client import CollectorRegistry, start_http_server  # unbroken[monitor]

        registry = CollectorRegistry(auto_describe=False)
        registry.register(JobCollector(self.state))  # type: ignore[arg-type]  # a collector by its collect()
        server, _ = start_http_server(self.port, addr=self.host, registry=registry)
        self._server = server
        port = server.server_address[1]
        self.monitor_dir.mkdir(parents=True, exist_ok=True)
        path = self.monitor_dir / ENDPOINT_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"host": self.host, "port": port, "url": f"http://{self.host}:{port}/metrics"}))
        tmp.replace(path)

    def handle(self, kind: str, payload: dict[str, Any]) -> None:
        pass  # every scrape reads the state itself

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
