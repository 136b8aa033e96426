"""``unbroken`` command line: presets, config files, overrides, and subcommands.

Only argument handling and printing live here; the work is done by the
packages below. Config errors are reported all at once, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

from unbroken.config import PRESETS, SECTIONS, Config, load_config
from unbroken.mecefo.takeover import POLICIES
from unbroken.runtime.checkpoint import CheckpointError

logger = logging.getLogger("unbroken")

EPILOG_OVERRIDES = (
    "Any config field can be set with --SECTION.FIELD=VALUE, sections: "
    + ", ".join(SECTIONS)
    + ". Example: --optim.lr=1e-3 --data.seq_len=128."
)


def _split_overrides(extra: list[str]) -> tuple[list[str], list[str]]:
    """Separate ``--section.field=value`` (or ``--section.field value``) from the rest."""
    overrides, rest = [], []
    i = 0
    while i < len(extra):
        arg = extra[i]
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if "." in key and key.split(".", 1)[0] in SECTIONS:
            if "=" in arg:
                overrides.append(arg[2:])
            elif i + 1 < len(extra):
                overrides.append(f"{key}={extra[i + 1]}")
                i += 1
            else:
                overrides.append(key)  # reported as malformed by load_config
        else:
            rest.append(arg)
        i += 1
    return overrides, rest


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="debug", help=f"named config preset: {', '.join(PRESETS)} (default: debug)")
    p.add_argument("--config", type=Path, default=None, help="TOML file mapping onto the config sections")
    p.add_argument("--workers", type=int, default=None, help="data-parallel workers/slots (train.workers)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (train.steps)")


FLAG_FIELDS = {
    "workers": "train.workers",
    "steps": "train.steps",
    "faults": "fault.trace",
    "trace": "fault.trace",
    "fail_at": "fault.fail_at",
    "policy": "mecefo.policy",
    "cluster_workers": "fault.cluster_workers",
}
"""Shorthand flags and the config field each one sets (a subcommand has some of them)."""

CLUSTER_WORKERS_HELP = ("the trace's failure rate is that of a cluster of N workers, of which the job's are a part "
                        "(fault.cluster_workers; default: the job's own)")


def _config_from(args: argparse.Namespace, overrides: list[str]) -> Config:
    extra = list(overrides) + [f"{field}={getattr(args, flag)}" for flag, field in FLAG_FIELDS.items()
                               if getattr(args, flag, None) is not None]
    return load_config(preset_name=args.preset, file=args.config, overrides=extra)


# ---------------------------------------------------------------------------
# train


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from unbroken.agent.launcher import AgentFailed, JobFailed, launch

    extra_faults = ""
    if args.resume is not None:
        saved = json.loads((args.resume / "config.json").read_text()) if (args.resume / "config.json").is_file() else None
        if saved is None:
            raise ValueError(f"--resume {args.resume}: no config.json there; is this a run directory?")
        cfg = Config.from_dict(saved)
        if overrides or args.workers or args.steps or args.config or args.faults:
            raise ValueError("--resume continues a run with its saved config; drop other config options")
        extra_faults = args.fail_at or ""  # faults for this continuation only, not saved
        out = args.resume
    else:
        cfg = _train_config(args, overrides)
    nodes, per_node = _train_layout(args, cfg)
    if args.resume is None:
        layout = f"w{cfg.train.workers}" if nodes == 1 else f"{nodes}x{per_node}"
        out = args.out or Path("runs") / f"{args.preset}-{layout}"
    progress = Progress(total=cfg.train.steps)
    try:
        summary = launch(cfg, out, nodes=nodes, workers_per_node=per_node, overwrite=args.overwrite,
                         resume=args.resume is not None, on_record=progress.update, fail_at=extra_faults,
                         standby=args.standby, restart=args.restart)
    except (JobFailed, AgentFailed) as exc:
        failure: Exception | None = exc
    else:
        failure = None
    finally:
        progress.close()
    if failure is not None:
        print(f"unbroken train: {failure}", file=sys.stderr)
        return 1
    _print_summary(summary)
    return 0


def _train_config(args: argparse.Namespace, overrides: list[str]) -> Config:
    """Config of a new run: ``--faults`` / ``--fail-at`` / ``--workers-per-node`` map onto config fields."""
    extra = list(overrides)
    if args.workers_per_node is not None and args.workers is None:
        extra.append(f"train.workers={(args.nodes or 1) * args.workers_per_node}")
    return _config_from(args, extra)


def _train_layout(args: argparse.Namespace, cfg: Config) -> tuple[int, int]:
    """``(nodes, workers per node)`` with ``nodes * per_node == train.workers``."""
    nodes = args.nodes or 1
    if nodes < 1:
        raise ValueError(f"--nodes {nodes}: need at least 1")
    if args.workers_per_node is not None:
        if args.workers_per_node < 1 or nodes * args.workers_per_node != cfg.train.workers:
            raise ValueError(f"--nodes {nodes} x --workers-per-node {args.workers_per_node} must equal "
                             f"train.workers={cfg.train.workers} and be >= 1; drop --workers or make them agree")
        return nodes, args.workers_per_node
    if cfg.train.workers % nodes:
        raise ValueError(f"train.workers={cfg.train.workers} is not a multiple of --nodes {nodes}; "
                         f"give --workers-per-node")
    return nodes, cfg.train.workers // nodes


class Progress:
    """Live progress: a rich bar on a terminal, a plain line every ~5% otherwise."""

    def __init__(self, total: int) -> None:
        from rich.console import Console

        self.total = total
        self.console = Console(stderr=True)
        self.every = max(1, total // 20)
        self.bar = None
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(), console=self.console,
            )
            self.task = self.bar.add_task("train", total=total, info="starting workers")
            self.bar.start()

    def update(self, rec: dict[str, Any]) -> None:
        if rec.get("kind") == "val":
            self.console.print(f"step {rec['step']}: val loss {rec['val_loss']:.4f}  ppl {rec['val_ppl']:.2f}")
            return
        if rec.get("kind") != "train":
            return
        info = f"loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  {rec['tokens_per_s']:,.0f} tok/s"
        for key in ("live_workers", "generation", "degraded"):
            if key in rec:
                info += f"  {key} {rec[key]}"
        if self.bar is not None:
            self.bar.update(self.task, completed=rec["step"], info=info)
        elif rec["step"] % self.every == 0 or rec["step"] == self.total:
            self.console.print(f"step {rec['step']}/{self.total}  {info}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="run summary", show_header=False)
    for key, value in summary.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)


# ---------------------------------------------------------------------------
# bench


def cmd_bench(args: argparse.Namespace, overrides: list[str]) -> int:
    from unbroken.bench import BENCHMARKS

    if args.name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {args.name!r}; valid: {', '.join(BENCHMARKS)}")
    BENCHMARKS[args.name](list(args.rest) + [f"--{o}" for o in overrides])  # every benchmark takes --section.field=value
    return 0


# ---------------------------------------------------------------------------
# simulate


def cmd_simulate(args: argparse.Namespace, overrides: list[str]) -> int:
    """Play ``train.workers`` workers in this process under a failure trace (``unbroken.job.simulator``)."""
    from unbroken.job.simulator import simulate

    cfg = _config_from(args, overrides)
    out = args.out or Path("runs") / (
        f"sim-{args.preset}-w{cfg.train.workers}-{cfg.fault.trace}-{cfg.mecefo.policy}")
    progress = Progress(total=cfg.train.steps)

    def show(rec: dict[str, Any]) -> None:
        # The progress line shows counts and slot ids; the full records are in metrics.jsonl.
        if rec.get("kind") == "train":
            rec = {k: v for k, v in rec.items() if k != "assignment"}
            rec["live_workers"] = f"{len(rec['live_workers'])}/{cfg.train.workers}"
            rec["degraded"] = [d["slot"] for d in rec["degraded"]]
        progress.update(rec)

    try:
        summary = simulate(cfg, out, overwrite=args.overwrite, on_record=show)
    finally:
        progress.close()
    _print_summary(summary)
    return 0


# ---------------------------------------------------------------------------
# agent


def cmd_agent(args: argparse.Namespace, overrides: list[str]) -> int:
    """One node's agent (see ``unbroken.agent.agent``); the config comes from RUN_DIR/config.json."""
    from unbroken.agent.agent import AgentError
    from unbroken.agent.command import run_agent
    from unbroken.agent.options import options_from

    if overrides:
        raise ValueError(f"unbroken agent takes no config overrides ({', '.join(overrides)}); "
                         f"it runs the config in RUN_DIR/config.json")
    logging.getLogger("unbroken").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return run_agent(options_from(args))
    except AgentError as exc:
        print(f"unbroken agent: {exc}", file=sys.stderr)
        return exc.code


# ---------------------------------------------------------------------------
# chaos


def cmd_chaos(args: argparse.Namespace, overrides: list[str]) -> int:
    from unbroken.faults.chaos import run_chaos

    if overrides:
        raise ValueError(f"unbroken chaos takes no config overrides ({', '.join(overrides)})")

    def show(e: dict[str, Any]) -> None:
        print(f"step {e.get('progress', '-')}: {e.get('spec', 'continue')} -> {e.get('signal', 'SIGCONT')} "
              f"to pids {e['pids'] or 'none (target gone)'}", flush=True)

    run_chaos(args.run_dir, args.fail_at, timeout_s=args.timeout_s, on_event=show)
    return 0


def cmd_report(args: argparse.Namespace, overrides: list[str]) -> int:
    from unbroken.bench.report import main as report_main

    if overrides:
        raise ValueError(f"unbroken report takes no config overrides ({', '.join(overrides)})")
    summary = report_main([str(args.run_dir)] + (["--json"] if args.json else []))
    return 0 if summary["ledger_ok"] else 1


# ---------------------------------------------------------------------------


COMMANDS: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
    "train": cmd_train, "bench": cmd_bench, "simulate": cmd_simulate,
    "agent": cmd_agent,
    "chaos": cmd_chaos,
    "report": cmd_report,
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="unbroken",
        description="Data-parallel LLM pre-training on PyTorch that keeps running through failures.",
        epilog=EPILOG_OVERRIDES,
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    tr = sub.add_parser(
        "train", help="train with local workers (spawned here; no torchrun needed)",
        description="Train a LLaMA-style model data-parallel with local worker processes.", epilog=EPILOG_OVERRIDES,
    )
    _add_config_args(tr)
    tr.add_argument("--out", type=Path, default=None, help="run directory (default runs/PRESET-wN)")
    tr.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    tr.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                    help="continue RUN_DIR from its newest committed checkpoint")
    _add_cluster_args(tr)

    si = sub.add_parser(
        "simulate", help="simulate data-parallel workers under a failure trace in one process",
        description="One process plays every worker of a data-parallel job under a failure trace, "
        "with the MeCeFO takeover policies and the runtime's gradient code.", epilog=EPILOG_OVERRIDES,
    )
    _add_config_args(si)
    si.add_argument("--slots", dest="workers", type=int, default=None,
                    help="data-parallel slots = simulated workers (train.workers; same as --workers)")
    si.add_argument("--trace", default=None, help="failure trace: none, low, mid, high, extreme (fault.trace)")
    si.add_argument("--policy", default=None,
                    help=f"takeover policy: {', '.join(POLICIES)} (mecefo.policy)")
    si.add_argument("--cluster-workers", type=int, default=None, metavar="N", help=CLUSTER_WORKERS_HELP)
    si.add_argument("--out", type=Path, default=None, help="run directory (default runs/sim-PRESET-wN-TRACE-POLICY)")
    si.add_argument("--overwrite", action="store_true", help="replace a run already in --out")

    _add_agent_parser(sub)
    _add_chaos_parser(sub)
    rp = sub.add_parser("report", help="summarise a run: failures, stall per failure, lost steps, ledger check",
                        description="Failures, stall per failure, rejoins and the exactly-once ledger check of a run "
                        "(exit code 1 if any (step, slot, row) was lost or trained twice).")
    rp.add_argument("run_dir", type=Path, help="run directory")
    rp.add_argument("--json", action="store_true", help="print JSON")

    be = sub.add_parser("bench", help="run a benchmark (prints a table, writes JSON)",
                        description="Benchmarks; each prints ratios measured side by side and writes JSON.")
    be.add_argument("name", help="benchmark name, e.g. throughput")
    be.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the benchmark (see unbroken bench NAME --help)")
    return ap


def _add_cluster_args(tr: argparse.ArgumentParser) -> None:
    tr.add_argument("--nodes", type=int, default=None, help="agents (simulated nodes) on this machine (default 1)")
    tr.add_argument("--workers-per-node", type=int, default=None,
                    help="workers per node (default train.workers / nodes)")
    tr.add_argument("--fail-at", default=None, metavar="SPEC",
                    help="faults, e.g. step=40:worker=2:kill:back=60,step=90:node=1:kill (fault.fail_at)")
    tr.add_argument("--faults", default=None, metavar="TRACE",
                    help="failure trace: none, low, mid, high, extreme (fault.trace)")
    tr.add_argument("--cluster-workers", type=int, default=None, metavar="N", help=CLUSTER_WORKERS_HELP)
    tr.add_argument("--standby", action="store_true", help="keep a warm standby worker on every node")
    tr.add_argument("--restart", choices=("on-failure", "never"), default="on-failure",
                    help="restart dead workers as joiners (default on-failure)")


def _add_agent_parser(sub: Any) -> None:
    from unbroken.agent.options import add_agent_args

    ag = sub.add_parser("agent", help="run one node's agent (a cluster: one per machine)",
                        description="Supervise this node's workers of a job whose store runs elsewhere.")
    add_agent_args(ag)


def _add_chaos_parser(sub: Any) -> None:
    ch = sub.add_parser("chaos", help="inject faults into a running job from outside (real signals)",
                        description="Send real signals to a running job's processes at given steps.")
    ch.add_argument("--run-dir", type=Path, required=True, help="the running job's run directory")
    ch.add_argument("--fail-at", required=True, metavar="SPEC", help="e.g. step=40:worker=2:kill,step=90:node=1:kill")
    ch.add_argument("--timeout-s", type=float, default=3600.0, help="give up after this long (default 3600)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    overrides, rest = _split_overrides(argv)
    args = ap.parse_args(rest)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args, overrides)
    except (ValueError, CheckpointError) as exc:
        print(f"unbroken {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"unbroken {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
