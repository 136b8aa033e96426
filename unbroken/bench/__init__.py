"""Benchmarks: each is ``main(argv) -> dict``, prints a table and writes JSON.

Figures are ratios measured side by side in one run (machines are shared and
noisy), or deterministic counts (FLOPs, bytes, steps). One-off studies (convergence
grids, the cluster model against real runs, the plain-loop reference, ...) are
scripts in the repository's ``benchmarks/`` that import the package.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def _lazy(module: str) -> Callable[[list[str] | None], dict[str, Any]]:
    def run(argv: list[str] | None = None) -> dict[str, Any]:
        return importlib.import_module(f"unbroken.bench.{module}").main(argv)

    return run


BENCHMARKS: dict[str, Callable[[list[str] | None], dict[str, Any]]] = {
    "throughput": _lazy("throughput"),
    "mecefo-cost": _lazy("mecefo_cost"),
    "failover": _lazy("failover"),
    "snapshot": _lazy("snapshot"),
    "store": _lazy("store"),
    "sharded": _lazy("sharded"),
    "soak": _lazy("soak"),
    "hsdp": _lazy("hsdp"),
    "takeover": _lazy("takeover"),
    "recovery": _lazy("recovery"),
    "straggler": _lazy("straggler"),
}

__all__ = ["BENCHMARKS"]
