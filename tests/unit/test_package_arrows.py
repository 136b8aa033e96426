"""The package's imports go downward only: each package imports only packages in layers below its own, and no
module imports itself through others (counting imports inside functions and under ``TYPE_CHECKING``).

The layers are docs/design.md's ("The house"); a new arrow upward, or a new circle between modules, fails here
with the importing module named.
"""

from __future__ import annotations

import ast
from pathlib import Path

import unbroken

ROOT = Path(unbroken.__file__).parent

LAYERS: list[set[str]] = [
    {"unbroken", "cli", "cli_parser", "cli_resume", "api", "demo", "console", "export"},  # commands (may use each other)
    {"bench"},  # benchmarks: they run jobs and read their reports
    {"report", "cluster"},  # a run's report; clusters (Slurm) around the agent
    {"agent"},  # one per node: starts, watches and restarts workers
    {"monitor"},  # one per job, started by the launcher or node 0's agent: TensorBoard, W&B, Prometheus, alerts
    {"runtime"},  # one worker: the step protocol, membership, the training loop
    {"job"},  # what is trained: the model, data, optimizer and schedule built from the config
    {"faults"},  # fault injection and traces
    {"checkpoint"},  # persistent checkpoints
    {"sharding"},  # where the state lives: replicated, ZeRO-1, HSDP
    {"snapshot"},  # per-step snapshots in node memory
    {"mecefo"},  # takeover: who trains a failed worker's rows, and how cheaply
    {"store"},  # the coordination store and its keys
    {"models", "data"},  # a model in one sitting; token windows
    {"state"},  # a training state's names; a tensor's part on this rank
    {"config"},  # the settings and their checks
    {"jsonl", "completion"},  # leaf helpers
]
"""Top to bottom. A package (or a top-level module) may import only what lies in a lower layer."""

LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}

FORBIDDEN = {("runtime", "faults")}
"""Downward, yet not allowed: faults install themselves on the protocol's hook points from the worker's entry
point (``agent/worker_process.py``); the runtime never imports them."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``path`` imports, anywhere in it (``from a import b`` counts ``a.b`` if a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "unbroken"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.split(".")[0] == "unbroken":
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            out |= subs or {node.module}
    return out & modules.keys()


def _unit(module: str) -> str:
    """The package a module belongs to (``unbroken.runtime.worker`` → ``runtime``), or a top-level module's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def test_every_package_is_in_a_layer() -> None:
    assert {_unit(m) for m in _modules()} == set(LAYER_OF)


def test_packages_import_only_downward() -> None:
    upward = sorted(
        f"{m} imports {t} ({_unit(m)} -> {_unit(t)})"
        for m, targets in _graph().items() for t in targets
        if _unit(m) != _unit(t) and LAYER_OF[_unit(t)] <= LAYER_OF[_unit(m)] and LAYER_OF[_unit(m)] > 0
    )
    assert upward == []


def test_forbidden_arrows_are_absent() -> None:
    found = sorted(f"{m} imports {t}" for m, targets in _graph().items() for t in targets
                   if (_unit(m), _unit(t)) in FORBIDDEN)
    assert found == []


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The module circles of ``graph``: its strongly connected components of more than one module."""
    # Tarjan's strongly connected components: any with more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_module_imports_itself_through_others() -> None:
    assert _circles(_graph()) == []
