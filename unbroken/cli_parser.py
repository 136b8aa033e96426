"""The ``unbroken`` command's argument parser: subcommands, flags and their help (:mod:`unbroken.cli` runs them)."""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path
from typing import Any

from unbroken.bench import BENCHMARKS
from unbroken.config import PRESETS, SECTIONS
from unbroken.mecefo.takeover import POLICIES
from unbroken.store.backend import StoreAccessDenied

__all__ = ["CLUSTER_WORKERS_HELP", "DEFAULT_PRESET", "EPILOG_OVERRIDES", "allow_insecure_store", "build_parser",
           "check_store_address", "store_problem", "store_url"]

DEFAULT_PRESET = "debug"

EPILOG_OVERRIDES = (
    "Any config field can be set with --SECTION.FIELD=VALUE, sections: "
    + ", ".join(SECTIONS)
    + ". Example: --optim.lr=1e-3 --data.seq_len=128."
)

SHARDING_HELP = """

Sharded optimizer state (--train.shard_optimizer=true, ZeRO-1): each live worker
keeps AdamW's moments for 1/m of the parameters (m live workers) instead of all
of them: optimizer memory per worker falls from 8 bytes per parameter to 8/m,
plus a copy of one peer's slice in its node's host (snapshot) memory, which is
what rebuilds a failed worker's slice with no rollback. Costs one all-gather of
the parameters per step and one copy of the slice to the next node, overlapped
with the next step. Use it when the moments do not fit beside the model (a
replicated worker holds 16 bytes per parameter before activations); a no-op
with one worker. Whole-job restores of a sharded run come from snapshot memory
(the parameters from the snapshot, the moments from the copies of the same
step) or the persistent checkpoint (every worker writes its slice); --resume
may switch it on or off."""


CLUSTER_WORKERS_HELP = ("the trace's failure rate is that of a cluster of N workers, of which the job's are a part "
                        "(fault.cluster_workers; default: the job's own)")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, help=f"named config preset: {', '.join(PRESETS)} (default: "
                   f"{DEFAULT_PRESET})")
    p.add_argument("--config", type=Path, default=None, help="TOML file mapping onto the config sections")
    p.add_argument("--workers", type=int, default=None, help="data-parallel workers/slots (train.workers)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (train.steps)")


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
        description="Train a LLaMA-style model data-parallel with local worker processes.",
        epilog=textwrap.fill(EPILOG_OVERRIDES, 80) + SHARDING_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(tr)
    tr.add_argument("--out", type=Path, default=None, help="run directory (default runs/PRESET-wN)")
    tr.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    tr.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                    help="continue RUN_DIR from its job's snapshot memory or its newest committed checkpoint, "
                         "whichever is newer")
    tr.add_argument("--prepare-only", action="store_true",
                    help="write the run directory (config, token cache, secret; with --resume: cut back to the "
                         "resume point) and exit: for agents a cluster's scheduler starts (unbroken agent)")
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
    de = sub.add_parser(
        "demo", help="the main job: train through a worker kill, a hang and a node loss, then check nothing was lost",
        description="Train the debug model with 4 workers on 2 nodes and a warm standby per node, inject a worker "
        "SIGKILL, a SIGSTOP hang and a whole-node loss from outside (each followed by a return to full strength; a "
        "spare node takes the lost node's rank), "
        "then check from the ledgers that every (step, slot, row) was trained exactly once and compare the "
        "validation perplexity with a failure-free run of the same job.", epilog=EPILOG_OVERRIDES,
    )
    de.add_argument("--out", type=Path, default=Path("runs/default"), help="run directory (default runs/default)")
    de.add_argument("--steps", type=int, default=400, help="steps to train (default 400)")
    de.add_argument("--no-faults", action="store_true", help="the same job without any fault")
    de.add_argument("--spare-nodes", type=int, default=1, metavar="N",
                    help="spare nodes that take a lost node's rank at once (default 1; 0: the launcher brings up "
                         "a replacement node a second after the loss)")
    de.add_argument("--overwrite", action="store_true", help="replace a run already in --out")

    rp = sub.add_parser("report", help="summarise a run: failures, stall per failure, lost steps, ledger check",
                        description="Failures, stall per failure, rejoins and the exactly-once ledger check of a run "
                        "(exit code 1 if any (step, slot, row) was lost or trained twice), drawn to RUN/report.png "
                        "with the data in RUN/report.json; with two runs, both overlaid in "
                        "RUN_A/report-vs-<name of RUN_B>.png.")
    rp.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="run directory; a second to compare")
    rp.add_argument("--json", action="store_true", help="print JSON")

    ex = sub.add_parser("export", help="write a committed checkpoint as a Hugging Face Llama directory",
                        description="Write a committed checkpoint of a run (the newest intact one by default) as a "
                        "directory transformers.AutoModelForCausalLM.from_pretrained loads: config.json, "
                        "model.safetensors (model weights only), generation_config.json, the run's tokenizer.json.")
    ex.add_argument("run_dir", type=Path, metavar="RUN", help="run directory")
    ex.add_argument("--hf", type=Path, required=True, metavar="OUT", help="directory to write (must not exist)")
    ex.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="weights' dtype (default fp32)")
    ex.add_argument("--step", type=int, default=None, metavar="N", help="the checkpoint of step N (default: newest)")

    _add_prepare_data_parser(sub)
    be = sub.add_parser("bench", help="run a benchmark (prints a table, writes JSON)",
                        description="Benchmarks; each prints ratios measured side by side and writes JSON.")
    be.add_argument("name", help=f"benchmark name: {', '.join(BENCHMARKS)} (one-off studies: python -m benchmarks.NAME "
                                 "in a clone, docs/usage.md)")
    be.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the benchmark (see unbroken bench NAME --help)")
    sc = sub.add_parser("simulate-cluster", add_help=False,
                        help="project goodput at cluster scale from measured costs (Monte Carlo; see --help)")
    sc.add_argument("rest", nargs=argparse.REMAINDER, help="arguments (see unbroken simulate-cluster --help)")
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
    tr.add_argument("--spare-nodes", type=int, default=0, metavar="N",
                    help="N spare nodes (agents on this machine, imported and prepared): a lost node's rank is "
                         "taken over by one at once (default 0)")
    tr.add_argument("--health-check", default=None, metavar="CMD",
                    help="a shell command each agent runs before it starts workers (and a spare before it takes a "
                         "lost node's rank): a non-zero exit or a hang keeps that node out")
    tr.add_argument("--health-check-timeout-s", type=float, default=120.0, metavar="S",
                    help="kill a health check still running after S seconds; it counts as failed (default 120)")
    tr.add_argument("--restart", choices=("on-failure", "never"), default="on-failure",
                    help="restart dead workers as joiners (default on-failure)")
    tr.add_argument("--store-insecure", action="store_true",
                    help="allow plain etcd:// to members on other hosts (an isolated network only)")
    tr.add_argument("--store", default=None, metavar="etcd[s]://HOST:PORT[,...]",
                    help="the job's store on an etcd cluster; etcds:// over TLS with the client certificate named by "
                         "UNBROKEN_ETCD_CA, UNBROKEN_ETCD_CERT and UNBROKEN_ETCD_KEY (default: embedded in this "
                         "process)")


def _add_prepare_data_parser(sub: Any) -> None:
    pd = sub.add_parser("prepare-data", help="tokenize text files or a Hugging Face dataset into token shards",
                        description="Tokenize documents with the job's tokenizer into a directory of token shards "
                        "data.source reads (part-NNNNN.npy, each document followed by the end-of-text token, and "
                        "vocab.json). Run again after an interruption, it continues where it stopped; the result "
                        "is the same as an uninterrupted run's.")
    pd.add_argument("input", metavar="INPUT", help="a .txt/.jsonl file, a directory of them, a glob ('data/*.jsonl'), "
                    "or a Hugging Face dataset directory written by save_to_disk")
    pd.add_argument("--out", type=Path, required=True, help="the shard directory to write (or to continue)")
    pd.add_argument("--tokenizer", default=None, metavar="PATH",
                    help="a tokenizer.json or a local Hugging Face model directory (default: --data.tokenizer)")
    pd.add_argument("--text-field", default="text", metavar="NAME",
                    help="the text of a .jsonl line or a dataset row (default text)")
    pd.add_argument("--split", default="train", help="the split of a DatasetDict or of --hub (default train)")
    pd.add_argument("--hub", action="store_true",
                    help="INPUT is a name for datasets.load_dataset (the Hub, or a local data directory)")
    pd.add_argument("--shard-tokens", type=int, default=None, metavar="N",
                    help="tokens per shard (default 67108864)")


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


# ---------------------------------------------------------------------------
# the --store flag


def store_url(addr: str | None) -> str | None:
    """``unbroken train --store``: an etcd cluster's address, checked (the embedded store needs none)."""
    if addr is None:
        return None
    if not addr.startswith(("etcd://", "etcds://")):
        raise ValueError(f"--store {addr!r}: expected etcd://HOST:PORT[,HOST:PORT...][/PREFIX], or etcds://... for "
                         f"TLS with a client certificate (leave it out for the store embedded in this process, on "
                         f"train.host:train.port)")
    check_store_address(addr)
    return addr


def check_store_address(addr: str) -> None:
    if addr.startswith(("etcd://", "etcds://")):
        from unbroken.store.etcd_client import check_transport, parse_etcd

        try:
            check_transport(addr, parse_etcd(addr)[0], insecure=False)
        except ValueError as exc:
            raise ValueError(f"--store: {exc}") from None
        return
    host, sep, port = addr.rpartition(":")
    if not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"--store {addr!r}: expected HOST:PORT with PORT in 1..65535, e.g. --store 10.0.0.1:29500 "
                         f"(the job's train.host and train.port)")


def allow_insecure_store(args: argparse.Namespace) -> None:
    """``--store-insecure``: plain etcd:// to other hosts, for this process and every one it starts."""
    if getattr(args, "store_insecure", False):
        from unbroken.store.etcd_client import INSECURE_ENV

        os.environ[INSECURE_ENV] = "1"


def store_problem(args: argparse.Namespace, exc: Exception) -> str:
    """The agent's store error, naming the option to fix: ``--run-dir`` (no secret) or ``--store``."""
    from unbroken.store.backend import SECRET_ENV, SECRET_FILE

    from_env = bool(os.environ.get(SECRET_ENV))
    if isinstance(exc, StoreAccessDenied) and not from_env and not (args.run_dir / SECRET_FILE).is_file():
        return f"--run-dir {args.run_dir}: {exc}"
    if isinstance(exc, StoreAccessDenied):
        where = f"${SECRET_ENV}" if from_env else str(args.run_dir / SECRET_FILE)
        return f"--store {args.store}: {exc} (the secret tried is the one in {where})"
    return f"--store {args.store}: {exc}"
