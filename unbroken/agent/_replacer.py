"""The launcher's play of a cluster scheduler: lost nodes replaced, spare nodes adopted and renewed.

A lost node is one whose agent died by SIGKILL (its workers with it). With
spare nodes (agents started with ``--spare``), a spare takes the rank by
itself (:func:`unbroken.agent.rendezvous.wait_for_lost_node`) and this module
only adopts it, once the node's ``pids/agent<R>`` names it, then starts a new
spare; without one, it starts a new agent for that rank after a delay.
"""

from __future__ import annotations

import logging
import signal
import subprocess
from pathlib import Path
from typing import Callable

from unbroken.faults.chaos import read_pid

__all__ = ["NodeReplacer", "spare_count"]

logger = logging.getLogger(__name__)


class NodeReplacer:
    """Brings up a replacement for a lost node (its agent killed by SIGKILL), as a scheduler would.

    With spare nodes (agents started with ``--spare``, already imported and prepared), a spare takes the
    lost node's rank by itself as soon as the node's agent and workers are known dead, and the scheduler
    brings a new spare ``delay_s`` later; without one, a new agent for that rank comes up ``delay_s``
    after the loss. Either way its workers start as joiners and the survivors admit them at a step
    boundary.
    """

    def __init__(self, delay_s: float | None, spawn: Callable[[int], subprocess.Popen[bytes]], *,
                 run_dir: Path) -> None:
        self.delay_s, self.spawn, self.run_dir = delay_s, spawn, run_dir
        self.lost: dict[int, float] = {}  # node -> when its agent was seen dead
        self.spares: list[subprocess.Popen[bytes]] = []
        self._spares_due: list[float] = []  # when the scheduler brings a new spare

    def tick(self, agents: list[subprocess.Popen[bytes]], now: float) -> None:
        for node, agent in enumerate(agents):
            if agent.poll() == -signal.SIGKILL and node not in self.lost:
                self.lost[node] = now
                if self._live_spares():
                    logger.warning("node %d lost: a spare node takes it over", node)
                elif self.delay_s is not None:
                    logger.warning("node %d lost: a replacement comes up in %.1f s", node, self.delay_s)
        for node in range(len(agents)):
            taker = self._spare_holding(node)
            if taker is not None:
                agents[node] = taker
                self.spares.remove(taker)
                self.lost.pop(node, None)
                logger.warning("node %d taken over by a spare (agent pid %d)", node, taker.pid)
                if self.delay_s is not None:
                    self._spares_due.append(now + self.delay_s)
        for node, since in list(self.lost.items()):
            if not self._live_spares() and self.delay_s is not None and now - since >= self.delay_s:
                del self.lost[node]
                agents[node] = self.spawn(node)
                logger.warning("node %d replaced (agent pid %d)", node, agents[node].pid)
        for due in [d for d in self._spares_due if d <= now]:
            self._spares_due.remove(due)
            self.spares.append(self.spawn(-1))
            logger.info("a new spare node is up (agent pid %d)", self.spares[-1].pid)

    def _live_spares(self) -> list[subprocess.Popen[bytes]]:
        return [s for s in self.spares if s.poll() is None]

    def _spare_holding(self, node: int) -> subprocess.Popen[bytes] | None:
        """The spare whose pid node ``node``'s agent pid file names (it took that rank)."""
        if not self.spares:
            return None
        pid = read_pid(self.run_dir / "pids" / f"agent{node}")
        return next((s for s in self.spares if s.pid == pid), None)


def spare_count(run_dir: Path) -> int:
    """The next spare agent's number (its log file's)."""
    return len(list((run_dir / "logs").glob("agent-spare*.log"))) if (run_dir / "logs").is_dir() else 0
