"""``unbroken`` command line: presets, config files, overrides, and subcommands.

Only argument handling and printing live here (the output of a run through
:mod:`unbroken.console`); the work is done by the packages below. Bad input
(config, flags, run directories, ports, stores) ends as one line
``unbroken CMD: error: ...`` naming the flag or field, the value and what is
accepted, exit code 2, never a traceback; config errors are reported all at once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from unbroken.cli_parser import (DEFAULT_PRESET, allow_insecure_store, build_parser, check_store_address, store_problem,
                                 store_url)
from unbroken.cli_resume import resume_config, train_layout
from unbroken.config import Config, SECTIONS, load_config
from unbroken.checkpoint.checkpointer import CheckpointError
from unbroken.store.backend import StoreAccessDenied

logger = logging.getLogger("unbroken")

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

def _preset(args: argparse.Namespace) -> str:
    return args.preset or DEFAULT_PRESET


def _config_from(args: argparse.Namespace, overrides: list[str]) -> Config:
    extra = list(overrides) + [f"{field}={getattr(args, flag)}" for flag, field in FLAG_FIELDS.items()
                               if getattr(args, flag, None) is not None]
    return load_config(preset_name=_preset(args), file=args.config, overrides=extra)


# ---------------------------------------------------------------------------
# train


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from unbroken.agent.launcher import AgentFailed, JobFailed, launch
    from unbroken.console import Console

    allow_insecure_store(args)
    if args.resume is not None:
        cfg, out, extra_faults = resume_config(args, overrides), args.resume, args.fail_at or ""
    else:
        cfg, extra_faults = _train_config(args, overrides), ""  # --fail-at is in the config
    nodes, per_node = train_layout(args, cfg)
    if args.resume is None:
        layout = f"w{cfg.train.workers}" if nodes == 1 else f"{nodes}x{per_node}"
        out = args.out or Path("runs") / f"{_preset(args)}-{layout}"
    _check_writable_dir("--resume" if args.resume is not None else "--out", out)
    if args.prepare_only:
        return _prepare_only(args, cfg, out, nodes, per_node)
    console = Console(total=cfg.train.steps, workers=cfg.train.workers, log_every=cfg.train.log_every)
    try:
        summary = launch(cfg, out, nodes=nodes, workers_per_node=per_node, overwrite=args.overwrite,
                         resume=args.resume is not None, on_record=console.record, on_event=console.event,
                         fail_at=extra_faults, standby=args.standby, restart=args.restart,
                         spare_nodes=args.spare_nodes, store=store_url(args.store),
                         health_check=(args.health_check, args.health_check_timeout_s))
    except (JobFailed, AgentFailed, TimeoutError) as exc:  # the run failed; the input was fine
        failure: Exception | None = exc
    else:
        failure = None
    finally:
        console.close()
    if failure is not None:
        print(f"unbroken train: {failure}", file=sys.stderr)
        return 1
    console.summary(summary)
    if summary.get("preempted_after_step") is not None:  # a SIGTERM/SIGUSR1: requeue and --resume
        from unbroken.agent.preemption import EXIT_PREEMPTED, preempted_message

        print(f"unbroken train: {preempted_message(out, summary['preempted_after_step'])}", file=sys.stderr)
        return EXIT_PREEMPTED
    return 0


def _prepare_only(args: argparse.Namespace, cfg: Config, out: Path, nodes: int, per_node: int) -> int:
    """``unbroken train --prepare-only``: the run directory for agents a cluster's scheduler starts."""
    from unbroken.agent.cluster_run import prepare_cluster_run

    agents_own = [flag for flag, on in (("--standby", args.standby), ("--spare-nodes", args.spare_nodes),
                                        ("--restart", args.restart != "on-failure"),
                                        ("--fail-at", args.resume is not None and args.fail_at)) if on]
    if agents_own:
        raise ValueError(f"--prepare-only with {', '.join(agents_own)}: those are the agents' options; give them to "
                         f"unbroken agent on each node instead")
    resume_from, prefix = prepare_cluster_run(cfg, out, nodes=nodes, workers_per_node=per_node,
                                              overwrite=args.overwrite, resume=args.resume is not None,
                                              store=store_url(args.store))
    if prefix is not None:
        print(f"the job's keys on {args.store}: prefix {prefix} (once the job is over: etcdctl del --prefix {prefix})")
    resumes = ""
    if args.resume is not None:
        resumes = f" (its agents resume from snapshot memory{f' or {resume_from}' if resume_from else ''}, whichever " \
                  f"is newer)"
    print(f"{out}: ready for {nodes} node(s) x {per_node} worker(s){resumes}; on each node: unbroken agent "
          f"--nnodes {nodes} --workers-per-node {per_node} --run-dir {out} --node-rank R --store HOST:PORT (node 0 "
          f"adds --host-store), or under srun --from-slurm")
    return 0


def cmd_demo(args: argparse.Namespace, overrides: list[str]) -> int:
    from unbroken.agent.launcher import AgentFailed, JobFailed
    from unbroken.console import Console, format_verdict
    from unbroken.demo import demo_config, run_demo

    cfg = demo_config(args.steps, overrides)  # bad overrides fail here, before anything runs
    _check_writable_dir("--out", args.out)
    console = Console(total=cfg.train.steps, workers=cfg.train.workers, log_every=cfg.train.log_every)
    try:
        verdict = run_demo(args.out, steps=args.steps, faults=not args.no_faults, overrides=overrides,
                           overwrite=args.overwrite, on_record=console.record, on_event=console.event,
                           spare_nodes=args.spare_nodes)
    except (JobFailed, AgentFailed, TimeoutError) as exc:
        console.close()
        print(f"unbroken demo: {exc}", file=sys.stderr)
        return 1
    console.close()
    for line in format_verdict(verdict):
        print(line)
    print(f"picture of the run: unbroken report {args.out}")
    return 0 if verdict["ok"] else 1


def _check_writable_dir(flag: str, path: Path) -> None:
    """Raise ``ValueError`` naming ``flag`` unless ``path`` is, or can be created as, a directory we can write.

    It tries: creates the missing directories and a file in ``path``, then removes what it made, so a run
    refused here leaves nothing on disk (permissions alone do not say it: root, read-only filesystems).
    """
    made: list[Path] = []
    try:
        if path.exists() and not path.is_dir():
            raise ValueError(f"{flag} {path}: is a file, not a directory; give a directory (created if missing)")
        blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise ValueError(f"{flag} {path}: {blocker} is a file, so no directory can be made under it; "
                             f"give another path")
        for p in reversed([path, *path.parents]):
            if not p.exists():
                p.mkdir()
                made.append(p)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".unbroken-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write there ({exc.strerror or exc}: {exc.filename}); "
                         f"give a directory you can write, e.g. {flag} runs/NAME") from None
    finally:
        for p in reversed(made):
            with contextlib.suppress(OSError):
                p.rmdir()


def _train_config(args: argparse.Namespace, overrides: list[str]) -> Config:
    """Config of a new run: ``--faults`` / ``--fail-at`` / ``--workers-per-node`` map onto config fields."""
    extra = list(overrides)
    if args.workers_per_node is not None and args.workers is None:
        extra.append(f"train.workers={(args.nodes or 1) * args.workers_per_node}")
    return _config_from(args, extra)


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
    from unbroken.console import Console
    from unbroken.job.simulator import simulate

    cfg = _config_from(args, overrides)
    out = args.out or Path("runs") / (
        f"sim-{_preset(args)}-w{cfg.train.workers}-{cfg.fault.trace}-{cfg.mecefo.policy}")
    _check_writable_dir("--out", out)
    # The status line shows counts and slot ids; the full records (assignments) are in metrics.jsonl.
    console = Console(total=cfg.train.steps, workers=cfg.train.workers, log_every=cfg.train.log_every)
    try:
        summary = simulate(cfg, out, overwrite=args.overwrite, on_record=console.record)
    finally:
        console.close()
    console.summary(summary)
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
    allow_insecure_store(args)
    if args.store is not None:
        check_store_address(args.store)
    logging.getLogger("unbroken").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    opts = options_from(args)
    args.store = opts.store  # with --from-slurm, the address Slurm's node list gave: the messages below name it
    try:
        return run_agent(opts)
    except AgentError as exc:
        if exc.code != 2:  # the job failed or was interrupted: not an input error
            print(f"unbroken agent: {exc}", file=sys.stderr)
            return exc.code
        # Refused to start. The agent re-raises store errors ``from None``: the original is the context.
        if isinstance(exc.__context__, (StoreAccessDenied, ConnectionError, ValueError)):
            raise ValueError(store_problem(args, exc.__context__)) from None
        raise ValueError(str(exc)) from None


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
    from unbroken.report.run_report import main as report_main

    if overrides:
        raise ValueError(f"unbroken report takes no config overrides ({', '.join(overrides)})")
    result = report_main([str(d) for d in args.run_dirs] + (["--json"] if args.json else []))
    return 1 if result["ledger_ok"] is False else 0


def cmd_export(args: argparse.Namespace, overrides: list[str]) -> int:
    from unbroken.export import export_hf

    if overrides:
        raise ValueError(f"unbroken export takes no config overrides ({', '.join(overrides)})")
    path = export_hf(args.run_dir, args.hf, dtype=args.dtype, step=args.step)
    print(f"exported {path} to {args.hf}")
    return 0


def cmd_prepare_data(args: argparse.Namespace, overrides: list[str]) -> int:
    from unbroken.data.pretrained import PretrainedTokenizer
    from unbroken.data.shard_writer import DEFAULT_SHARD_TOKENS, write_shards
    from unbroken.data.text_inputs import open_text_input

    tokenizer = args.tokenizer
    for o in overrides:
        key, _, value = o.partition("=")
        if key != "data.tokenizer":
            raise ValueError(f"unbroken prepare-data takes --tokenizer (or --data.tokenizer), not --{o}")
        tokenizer = tokenizer or value
    if not tokenizer:
        raise ValueError("--tokenizer: name the job's tokenizer (a tokenizer.json or a local Hugging Face model "
                         "directory, as data.tokenizer)")
    tok = PretrainedTokenizer(tokenizer)
    docs = open_text_input(args.input, text_field=args.text_field, split=args.split, hub=args.hub)
    bar = _ProgressBar(sys.stderr)
    shard_tokens = DEFAULT_SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens
    done = write_shards(docs, tok, args.out, shard_tokens=shard_tokens, on_progress=bar.show)
    bar.close()
    print(f"prepared {args.out}: {done.shards} shards, {done.tokens:,} tokens from {done.documents:,} documents "
          f"(vocabulary {tok.vocab_size:,}); train on it with --data.source={args.out}")
    return 0


class _ProgressBar:
    """One line redrawn in place on a terminal; elsewhere a line per shard written."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.tty, self.shards, self.drawn, self.last = stream, stream.isatty(), 0, False, ""

    def show(self, p: Any) -> None:
        frac = f"{p.documents / p.total:4.0%} " if p.total else ""
        bar = ("[" + "#" * int(30 * p.documents / p.total) + "." * (30 - int(30 * p.documents / p.total)) + "] ") \
            if p.total else ""
        line = f"{bar}{frac}{p.documents:,} documents, {p.tokens:,} tokens, {p.shards} shards"
        if self.tty:
            self.stream.write("\r" + line)
            self.drawn = True
        elif (p.shards != self.shards or p.done) and line != self.last:
            self.stream.write(line + "\n")
        self.shards, self.last = p.shards, line
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")


def cmd_simulate_cluster(args: argparse.Namespace, overrides: list[str]) -> int:
    from unbroken.cluster.command import main as simulate_cluster_main

    if overrides:
        raise ValueError(f"unbroken simulate-cluster takes no config overrides ({', '.join(overrides)})")
    return int(simulate_cluster_main(list(args.rest)).get("rc", 0))


# ---------------------------------------------------------------------------


COMMANDS: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
    "train": cmd_train, "bench": cmd_bench, "simulate": cmd_simulate,
    "agent": cmd_agent,
    "chaos": cmd_chaos,
    "report": cmd_report,
    "export": cmd_export,
    "prepare-data": cmd_prepare_data,
    "demo": cmd_demo,
    "simulate-cluster": cmd_simulate_cluster,
}


def main(argv: list[str] | None = None) -> int:
    own_process = argv is None  # this process's command line (not a caller's): a preempted job may leave at once
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    overrides, rest = _split_overrides(argv)
    if rest[:1] == ["simulate-cluster"]:  # argparse's REMAINDER does not take leading options: its own parser does
        args = argparse.Namespace(command=rest[0], verbose=False, rest=rest[1:])
    else:
        args = ap.parse_args(rest)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        code = COMMANDS[args.command](args, overrides)
    except (ValueError, CheckpointError, StoreAccessDenied, ConnectionError) as exc:
        print(f"unbroken {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"unbroken {args.command}: interrupted", file=sys.stderr)
        return 130
    from unbroken.agent.preemption import EXIT_PREEMPTED, leave_at_once

    if own_process and code == EXIT_PREEMPTED:
        leave_at_once(code)  # all is on disk and said; the scheduler's grace is short (unbroken.agent.preemption)
    return code


if __name__ == "__main__":
    sys.exit(main())
