"""The store a launcher hosts (or opens on etcd) for a job, and replaces between checkpoint-restart attempts."""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from unbroken.config import Config
from unbroken.store.job_store import JobStore

__all__ = ["REHOST_S", "StoreHost"]

logger = logging.getLogger(__name__)

REHOST_S = 10.0
"""Checkpoint-restart: how long the next attempt's store may wait for the previous one's port to be free."""


class StoreHost:
    """The launcher's store, the one reference to it: checkpoint-restart replaces it by a fresh one.

    A new attempt needs an empty store (no views, dead marks or progress of the last one) at the same
    address (``train.port`` may be fixed), so the old store is closed before the new one is hosted.
    On etcd (``url``) the job's keys are opened on the cluster instead, deleted between attempts and
    at the end.
    """

    def __init__(self, cfg: Config, nodes: int, secret: str, url: str | None = None,
                 run_dir: Path | None = None) -> None:
        self.cfg, self.clients, self.secret, self.url = cfg, cfg.train.workers + nodes, secret, url
        self.job = {"run_dir": str(Path(run_dir or ".").resolve()), "host": socket.gethostname(),
                    "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.store: JobStore = self._host()

    @property
    def addr(self) -> str:
        """The ``--store`` address agents and workers connect to."""
        return self.url or f"{self.cfg.train.host}:{self.store.port}"

    def _host(self) -> JobStore:
        if self.url:
            store = JobStore.create_on_etcd(self.url, timeout_s=self.cfg.train.timeout_s, secret=self.secret,
                                            job=self.job)
            store.set_store_timeout(self.cfg.fault.store_timeout_s)
            return store
        return JobStore.host(self.cfg.train.host, self.cfg.train.port, clients=self.clients, secret=self.secret)

    def close(self) -> None:
        """Stop the embedded store (its port is free when this returns); on etcd delete the job's keys."""
        if getattr(self, "store", None) is None:
            return
        if not self.url:
            self.store.close()
            return
        try:
            self.store.backend.clear()  # type: ignore[attr-defined]
        except dist.DistError as exc:
            logger.warning("could not delete the job's keys on %s (%s); once it answers: etcdctl del --prefix %s",
                           self.url, str(exc).splitlines()[0], self.store.backend.ns)  # type: ignore[attr-defined]

    def replace(self, config_text: str) -> JobStore:
        """Close the store (every agent of the attempt is stopped) and host an empty one; returns it.

        Raises:
            ValueError: the port did not become free within ``REHOST_S`` (someone else took it).
        """
        if self.url:
            self.store.backend.clear()  # type: ignore[attr-defined]
        self.store.close()  # the embedded store stops and its listening socket closes
        del self.store
        gc.collect()
        deadline = time.monotonic() + REHOST_S
        while True:
            try:
                self.store = self._host()
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.store.publish_config(config_text)
        return self.store
