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


def _config_from(args: argparse.Namespace, overrides: list[str]) -> Config:
    extra = list(overrides)
    if getattr(args, "workers", None) is not None:
        extra.append(f"train.workers={args.workers}")
    if getattr(args, "steps", None) is not None:
        extra.append(f"train.steps={args.steps}")
    return load_config(preset_name=args.preset, file=args.config, overrides=extra)


# ---------------------------------------------------------------------------
# train


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from unbroken.runtime.launcher import launch_local

    if args.resume is not None:
        saved = json.loads((args.resume / "config.json").read_text()) if (args.resume / "config.json").is_file() else None
        if saved is None:
            raise ValueError(f"--resume {args.resume}: no config.json there; is this a run directory?")
        cfg = Config.from_dict(saved)
        if overrides or args.workers or args.steps or args.config:
            raise ValueError("--resume continues a run with its saved config; drop other config options")
        out = args.resume
    else:
        cfg = _config_from(args, overrides)
        out = args.out or Path("runs") / f"{args.preset}-w{cfg.train.workers}"
    progress = Progress(total=cfg.train.steps)
    try:
        summary = launch_local(cfg, out, overwrite=args.overwrite, resume=args.resume is not None, on_record=progress.update)
    finally:
        progress.close()
    _print_summary(summary)
    return 0


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
    BENCHMARKS[args.name](list(args.rest) + [f"--{o}" for o in overrides])
    return 0


# ---------------------------------------------------------------------------


COMMANDS: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {"train": cmd_train, "bench": cmd_bench}


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

    be = sub.add_parser("bench", help="run a benchmark (prints a table, writes JSON)",
                        description="Benchmarks; each prints ratios measured side by side and writes JSON.")
    be.add_argument("name", help="benchmark name, e.g. throughput")
    be.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the benchmark (see unbroken bench NAME --help)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    overrides, rest = _split_overrides(argv)
    args = ap.parse_args(rest)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args, overrides)
    except ValueError as exc:
        print(f"unbroken {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"unbroken {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
