"""Each sink in a thread of its own, behind a bounded queue: a slow or unreachable service delays only itself.

:class:`SinkRunner` hands the items it is given to its sink in order. A failure (opening the sink or handling
an item) is logged once, with its reason, and the item is tried again after a backoff that doubles up to
:data:`MAX_BACKOFF_S`; the sink's recovery is logged once too. Items that arrive while the queue is full push
out the oldest (counted, said once): the watchers may lose lines, the training never waits.

Invariant: :meth:`SinkRunner.put` never blocks; :meth:`SinkRunner.close` returns within its timeout.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Protocol

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
QUEUE_ITEMS = 10_000
"""Items a sink may fall behind by before the oldest are dropped."""

Item = tuple[str, dict[str, Any]]
"""``(kind, payload)``: ``record`` (a metrics line), ``event``, ``rewind`` (``{"step": s}``: the steps from ``s``
on are written again) or ``alert`` (``{"text": ...}``)."""


class Sink(Protocol):
    name: str

    def open(self) -> None:
        """Connect or create; raises what stops it (the runner retries)."""

    def handle(self, kind: str, payload: dict[str, Any]) -> None:
        """One item; raises what stops it (the runner retries the same item)."""

    def close(self) -> None:
        """Flush and let go; must not raise."""


class SinkRunner:
    """Runs ``sink`` in a daemon thread (module docstring)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self._items: collections.deque[Item] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._dropped = 0
        self.failures = 0
        """Failures in a row (0: working)."""
        self.started = threading.Event()
        """Set once the sink opened, or first failed to (what it costs from then on is its steady cost)."""
        self._thread = threading.Thread(target=self._run, name=f"monitor-{sink.name}", daemon=True)
        self._thread.start()

    def put(self, kind: str, payload: dict[str, Any]) -> None:
        with self._cond:
            if len(self._items) >= QUEUE_ITEMS:
                self._items.popleft()
                self._dropped += 1
                if self._dropped == 1:
                    logger.warning("monitor: %s is %d items behind: dropping the oldest", self.sink.name, QUEUE_ITEMS)
            self._items.append((kind, payload))
            self._cond.notify()

    def close(self, timeout_s: float) -> None:
        """Hand over what is queued (within ``timeout_s``), then close the sink."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("monitor: %s did not finish within %.0f s (%d items left); closing it", self.sink.name,
                           timeout_s, len(self._items))
        self.sink.close()

    def _run(self) -> None:
        opened, backoff = False, FIRST_BACKOFF_S
        while True:
            with self._cond:
                while not self._items and not self._closing and opened:
                    self._cond.wait()
                if self._closing and (not self._items or self.failures):
                    return  # a sink still failing at the end is not waited for
                item = self._items[0] if self._items else None
            try:
                if not opened:
                    self.sink.open()
                    opened = True
                    self.started.set()
                if item is not None:
                    self.sink.handle(*item)
                    with self._cond:
                        if self._items and self._items[0] is item:
                            self._items.popleft()
            except Exception as exc:  # any failure of a watcher's service: said once, retried, never raised
                self.failures += 1
                self.started.set()
                if self.failures == 1:
                    logger.warning("monitor: %s failed (%s: %s); retrying with backoff, training goes on",
                                   self.sink.name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                with self._cond:
                    self._cond.wait_for(lambda: self._closing, timeout=backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
                continue
            if self.failures:
                logger.warning("monitor: %s works again after %d failed tries", self.sink.name, self.failures)
            self.failures, backoff = 0, FIRST_BACKOFF_S
