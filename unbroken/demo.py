"""The main job: train on the embedded corpus through real failures, and show what survived.

``unbroken demo`` (the README's first command, ``bash scripts/train.sh``) trains
the ``debug`` model with 4 workers on 2 nodes (agents on loopback), a warm
standby per node, and faults injected from outside at fixed fractions of the
run, each followed by a return to full strength:

- a worker SIGKILLed (its agent hands its slot to the node's standby);
- a worker SIGSTOPped (a hang: peers find its heartbeat silent, its agent
  fences it, the standby takes over);
- a whole node lost (its agent, workers and standby SIGKILLed together): a
  spare node (an agent with its template, started with the job, imported and
  prepared, as clusters keep hot spares) takes its rank as soon as its agent
  and workers are known dead, and its workers, forked from its template,
  rejoin; the launcher, playing the scheduler, brings a new spare a second
  later. With ``--spare-nodes 0`` it brings up a replacement node instead.

It then checks, from the ledgers and the workers' reports, not from log text:
steps done, failures survived, the stall of each, lost steps (0), every
``(step, slot, row)`` trained exactly once, all workers holding the same
parameters; and it compares the final validation perplexity with a
failure-free run of the same config (run once and cached beside the run,
keyed by the config hash). ``--no-faults`` runs the same job without faults.

Invariant: the verdict is computed from what the run wrote (ledger, worker
reports, metrics), so a run that lost or repeated a sample cannot pass.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

from unbroken.agent.launcher import launch
from unbroken.report.run_report import summarize_run
from unbroken.config import Config, config_hash, load_config

__all__ = ["DEMO_FAULTS", "demo_config", "demo_faults", "run_demo"]

logger = logging.getLogger(__name__)

NODES, WORKERS_PER_NODE = 2, 2
NODE_REPLACEMENT_S = 1.0
"""How long the launcher (the scheduler) takes to bring up a new machine: a new spare after one is used, or,
without spares, the lost node's replacement."""
SPARE_NODES = 1
DEMO_STEPS = 400
DEMO_FAULTS = (
    (0.10, "worker=1:kill", "a worker killed"),
    (0.25, "worker=2:stop", "a worker hung (SIGSTOP)"),
    (0.40, "node=1:kill", "a whole node lost"),
)
"""(fraction of the run, target and kind, what it is) of each injected fault: early enough that a lost
node's replacement (a new agent takes the rank over once the old one is silent, then cold-starts its
workers: about ten seconds here) is back well before the end."""


def demo_config(steps: int, overrides: list[str]) -> Config:
    """The debug model on the embedded corpus, 4 workers, a snappy hang detector.

    Raises:
        ValueError: a bad override (every problem at once).
    """
    base = [f"train.steps={steps}", f"train.workers={NODES * WORKERS_PER_NODE}", "fault.heartbeat_timeout_s=1.0",
            f"train.val_every={max(1, steps // 4)}", "train.checkpoint_every=0"]
    return load_config(preset_name="debug", overrides=base + list(overrides))


def demo_faults(steps: int) -> str:
    """The ``--fail-at`` text of the demo's faults for a run of ``steps`` steps.

    Raises:
        ValueError: too few steps to place the faults apart.
    """
    if steps < 20:
        raise ValueError(f"--steps {steps}: the demo needs at least 20 steps to place its three faults apart")
    return ",".join(f"step={int(f * steps)}:{what}" for f, what, _ in DEMO_FAULTS)


def run_demo(out: Path, *, steps: int = DEMO_STEPS, faults: bool = True, overrides: list[str] | None = None,
             overwrite: bool = False, on_record: Callable[[dict[str, Any]], None] | None = None,
             on_event: Callable[[dict[str, Any]], None] | None = None, spare_nodes: int = SPARE_NODES) -> dict[str, Any]:
    """Run the demo job (and, once, its failure-free reference); returns the verdict.

    Raises:
        ValueError: bad input (nothing written).
        JobFailed, AgentFailed: the job could not finish (see the launcher).
    """
    cfg = demo_config(steps, overrides or [])
    fail_at = demo_faults(steps) if faults else ""
    summary = launch(cfg, out, nodes=NODES, workers_per_node=WORKERS_PER_NODE, overwrite=overwrite,
                     fail_at=fail_at, standby=True, on_record=on_record, on_event=on_event,
                     replace_lost_nodes_s=NODE_REPLACEMENT_S, spare_nodes=spare_nodes if faults else 0)
    reference = _reference_ppl(cfg, out, faults) if faults else summary["val_ppl"]
    verdict = {**_verdict(cfg, out, summary, reference, fail_at), "spare_nodes": spare_nodes if faults else 0}
    (out / "demo.json").write_text(json.dumps(verdict, indent=1))
    return verdict


def _reference_ppl(cfg: Config, out: Path, faults: bool) -> float:
    """Validation perplexity of the same job without failures (cached beside ``out`` by config hash)."""
    ref = out.with_name(out.name + "-failure-free")
    cached = ref / "summary.json"
    if cached.is_file():
        saved = json.loads(cached.read_text())
        if saved.get("config_hash") == config_hash(cfg) and saved.get("val_ppl") is not None:
            return float(saved["val_ppl"])
    logger.info("running the failure-free reference of the demo in %s", ref)
    summary = launch(cfg, ref, nodes=NODES, workers_per_node=WORKERS_PER_NODE, overwrite=True)
    return float(summary["val_ppl"])


def _verdict(cfg: Config, out: Path, summary: dict[str, Any], reference_ppl: float, fail_at: str) -> dict[str, Any]:
    """The headline of the run, from its ledger, worker reports and metrics."""
    report = summarize_run(out)
    ppl = summary["val_ppl"]
    checks = {
        "all steps done": report["committed_steps"] == cfg.train.steps,
        "no step lost": report["lost_steps"] == 0,
        "every (step, slot, row) trained exactly once": report["ledger_ok"],
        "workers agree on the final parameters": bool(summary["workers_agree"]),
    }
    return {
        "run_dir": str(out), "steps": report["committed_steps"], "of_steps": cfg.train.steps,
        "faults_injected": fail_at, "failures_survived": summary["failures"],
        "stalls_s": [round(f["stall_s"], 3) for f in report["failure_details"] if f["stall_s"] is not None],
        "rejoins_s": [round(r["down_to_back_s"], 3) for r in report["rejoins"] if r["down_to_back_s"] is not None],
        "standby_handovers": summary["standby_handovers"], "lost_steps": report["lost_steps"],
        "rows_trained_never": report["rows_trained_never"], "rows_trained_twice": report["rows_trained_twice"],
        "degraded_steps": report["degraded_steps"], "workers_agree": bool(summary["workers_agree"]),
        "val_ppl": ppl, "failure_free_val_ppl": reference_ppl,
        "val_ppl_vs_failure_free": ppl / reference_ppl - 1 if ppl and reference_ppl else None,
        "checks": checks, "ok": all(checks.values()),
    }
