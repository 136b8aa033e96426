"""Bring your own model, data and optimizer; unbroken trains them through a worker's death.

One machine (the script starts 2 nodes x 2 workers itself, kills worker 1 at
step 15, and checks that every (step, slot, row) was trained exactly once):

    python examples/bring_your_own.py --run-dir runs/byo

Hugging Face's LlamaForCausalLM instead of the small model below, from a local
directory (``pip install 'unbroken[hf]'``; nothing is downloaded):

    python examples/bring_your_own.py --save-hf /tmp/llama-small      # writes a small model with save_pretrained
    python examples/bring_your_own.py --run-dir runs/byo-hf --hf-path /tmp/llama-small

A cluster, one agent per machine (the same script at the same path on each,
UNBROKEN_JOB_SECRET set alike; node 0 hosts the store at --store):

    python examples/bring_your_own.py --run-dir runs/byo --node-rank R --nnodes 2 --store HOST:29500

The functions below are what you write. They are called in every worker
process (this file is loaded there as a module, so the ``__main__`` block at the
bottom does not run again) and must build the same thing in every worker.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

import unbroken

SEQ_LEN = 64
VOCAB = 256  # bytes


class TinyLM(nn.Module):
    """A small causal byte model that is not LLaMA-shaped: it trains under ``mecefo.policy='spread'`` (exact)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64, kernel: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.kernel = kernel
        self.mix = nn.Conv1d(dim, dim, kernel)  # causal: left-padded by kernel - 1
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # (B, T, D)
        mixed = self.mix(nn.functional.pad(h.transpose(1, 2), (self.kernel - 1, 0))).transpose(1, 2)
        h = h + torch.relu(mixed)
        h = h + self.mlp(h)
        return self.out(h)  # logits (B, T, V)


def build_model(ctx: unbroken.BuildContext) -> nn.Module:
    """The model, seeded with the job's seed: every worker builds the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        return TinyLM()


class ByteRows:
    """A map-style dataset: row ``i`` is ``SEQ_LEN + 1`` bytes of text (inputs and next-byte targets)."""

    vocab_size = VOCAB

    def __init__(self, text: bytes) -> None:
        self.tokens = np.frombuffer(text, dtype=np.uint8)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // SEQ_LEN

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1]


def build_data(ctx: unbroken.BuildContext) -> ByteRows:
    """unbroken's own sources as bytes: the same text on every machine with the same checkout."""
    files = sorted(Path(unbroken.__file__).parent.rglob("*.py"))
    return ByteRows(b"\n".join(f.read_bytes() for f in files))


def build_optimizer(model: nn.Module, ctx: unbroken.BuildContext) -> torch.optim.Optimizer:
    """Any torch optimizer; the config's schedule (``optim.lr``, warm-up, cosine) sets its learning rate."""
    return torch.optim.AdamW(model.parameters(), lr=ctx.cfg.optim.lr, weight_decay=0.0, foreach=False)


def save_small_hf_llama(path: Path) -> None:
    """Write a small LlamaForCausalLM (byte vocabulary) with ``save_pretrained``: a local stand-in for yours."""
    from unbroken.models import model_args
    from unbroken.models.hf_llama import build_hf_llama

    build_hf_llama(model_args("debug", vocab_size=VOCAB), seed=0).save_pretrained(path, safe_serialization=True)


def config(args: argparse.Namespace) -> unbroken.Config:
    cfg = unbroken.Config()
    cfg.train.steps, cfg.train.seed, cfg.train.device = args.steps, 0, "cpu"
    cfg.train.precision = args.precision
    cfg.train.checkpoint_every = 0
    cfg.data.micro_batch, cfg.data.seq_len = 4, SEQ_LEN
    cfg.optim.lr, cfg.optim.warmup_steps = 3e-3, 5
    cfg.optim.schedule = "cosine"  # named: the job sets build_optimizer's rate every step (else it keeps its own)
    if args.hf_path:
        cfg.model.family, cfg.model.hf_path, cfg.model.preset = "hf-llama", str(args.hf_path), "debug"
    return cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, default=Path("runs/byo"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--fail-at", default="step=15:worker=1:kill", help="faults to inject ('' for none)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--hf-path", type=Path, default=None, help="train this local LlamaForCausalLM directory")
    ap.add_argument("--save-hf", type=Path, default=None, help="write a small LlamaForCausalLM here and exit")
    ap.add_argument("--node-rank", type=int, default=None, help="cluster mode: this machine's node rank")
    ap.add_argument("--nnodes", type=int, default=2)
    ap.add_argument("--store", default="127.0.0.1:29500", help="cluster mode: node 0's HOST:PORT")
    args = ap.parse_args()
    if args.save_hf:
        save_small_hf_llama(args.save_hf)
        print(f"wrote {args.save_hf}")
        return 0
    cfg = config(args)
    # The HF model comes from model.family='hf-llama'; otherwise our factory builds TinyLM.
    model = None if args.hf_path else build_model
    if args.node_rank is not None:
        return unbroken.run_node(cfg, run_dir=args.run_dir, node_rank=args.node_rank, nnodes=args.nnodes,
                                 workers_per_node=args.workers_per_node, store=args.store, model=model,
                                 data=build_data, optimizer=build_optimizer)
    summary = unbroken.train(cfg, run_dir=args.run_dir, model=model, data=build_data, optimizer=build_optimizer,
                             nodes=args.nodes, workers_per_node=args.workers_per_node, fail_at=args.fail_at,
                             overwrite=True)
    from unbroken.runtime.ledger import check_ledger

    ledger = check_ledger(args.run_dir, n_slots=summary["workers"], micro_batch=cfg.data.micro_batch,
                          steps=cfg.train.steps)
    verdict = {"steps": summary["steps"], "final_loss": round(summary["final_loss"], 4),
               "workers_agree": summary["workers_agree"], "ledger_ok": ledger.ok,
               "rows_never": ledger.rows_never, "rows_twice": ledger.rows_twice}
    print(json.dumps(verdict))
    return 0 if ledger.ok and summary["workers_agree"] and summary["steps"] == cfg.train.steps else 1


if __name__ == "__main__":
    sys.exit(main())
