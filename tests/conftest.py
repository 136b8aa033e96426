"""Shared fixtures: one tokenizer/token cache per test session, small corpus slice."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Set before any test imports unbroken.data, and inherited by spawned workers. Each pytest-xdist worker is a
# session of its own: it takes its own folders rather than the ones its controller's environment handed down
# (the cleanups below would otherwise remove segments another worker's test is using).
_OWN = bool(os.environ.get("PYTEST_XDIST_WORKER"))
_SESSION_CACHE = Path(tempfile.mkdtemp(prefix="unbroken-test-cache-"))
if _OWN or "UNBROKEN_CACHE_DIR" not in os.environ:
    os.environ["UNBROKEN_CACHE_DIR"] = str(_SESSION_CACHE)
# Snapshot memory of this test session apart from any other's (a second pytest session on the machine, a job):
# the cleanup below removes what this session's tests left, never another's segments.
_SESSION_SHM = Path(tempfile.mkdtemp(prefix="unbroken-test-shm-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
if _OWN or "UNBROKEN_SHM_DIR" not in os.environ:
    os.environ["UNBROKEN_SHM_DIR"] = str(_SESSION_SHM)
# Every process that imports this file (an xdist controller too, which runs no fixture) removes the folders it
# made when it exits: nothing of a test session stays in /tmp or /dev/shm.
for _made in (_SESSION_CACHE, _SESSION_SHM):
    atexit.register(shutil.rmtree, _made, True)


@pytest.fixture(scope="session", autouse=True)
def _session_shared_memory():
    yield
    shutil.rmtree(_SESSION_SHM, ignore_errors=True)

CORPUS_BYTES = 1_500_000
"""Slice of the stdlib corpus used by multi-process tests (BPE trains in ~2 s)."""


@pytest.fixture(scope="session")
def corpus_overrides() -> list[str]:
    """The corpus slice, and a snapshot every step: scenarios assert the exact step a job restores from
    (the ``auto`` interval follows measured timings; tests/integration/test_auto_snapshot_interval.py covers it)."""
    return [f"data.max_bytes={CORPUS_BYTES}", "snapshot.every=1"]


@pytest.fixture(autouse=True)
def _snapshot_memory_is_released():
    """Remove the snapshot segments a test left behind (a job that failed keeps its memory for --resume
    by design; a test that checks for leaks asserts on them itself before this runs)."""
    from unbroken.snapshot.segment import segment_dir

    before = set(segment_dir().glob("unbroken-*"))
    yield
    for path in set(segment_dir().glob("unbroken-*")) - before:
        path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def etcd_cluster():
    """One real 3-member etcd cluster on loopback for the whole session (skipped where etcd is not installed)."""
    pytest.importorskip("etcd3gw", reason="the etcd client is not installed: pip install 'unbroken[etcd]'")
    from unbroken.store.local_etcd import EtcdNotFound, LocalEtcd

    try:
        cluster = LocalEtcd(3)
    except EtcdNotFound as exc:
        pytest.skip(str(exc))
    yield cluster
    cluster.stop()


def _paths_of(value: object) -> list[Path]:
    if isinstance(value, Path):
        return [value]
    if isinstance(value, (tuple, list)):
        return [p for v in value for p in _paths_of(v)]
    return []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A failed test shows the stacks that agents had their hung workers write before fencing them (a worker's
    log from its first ``Thread 0x`` line on): where a scenario stalled, even when it passes when run again."""
    report = yield
    if report.failed and call.when == "call":
        roots = [p for v in getattr(item, "funcargs", {}).values() for p in _paths_of(v) if p.is_dir()]
        for log in sorted({log for root in roots for log in root.rglob("logs/w*.log")}):
            text = log.read_text(errors="replace")
            if "Current thread" in text:
                report.sections.append((f"stacks of a hung worker: {log}", text[text.index("Thread 0x"):][-8000:]))
    return report
