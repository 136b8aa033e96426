"""One rank of a replica of two (``python hsdp_approx_rank.py RANK DIR``): MeCeFO's approximate mode inside
FSDP2 against the same micro-batches on the whole model. Writes ``DIR/rank<RANK>.json``: per parameter, the
largest difference between this rank's gradient shard and its part of the whole model's gradient."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from unbroken.mecefo.adapter import adapter_for
from unbroken.mecefo.gradients import GradLayout, SlotWork, compute_gradient_sums
from unbroken.models import build_model
from unbroken.state.parts import local_part
from unbroken.sharding.hsdp import shard_model

VOCAB, SEQ, MB = 256, 16, 4


def batch(step: int, slot: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + slot)
    tokens = torch.randint(0, VOCAB, (MB, SEQ + 1), generator=g)[rows[0]:rows[1]]
    return tokens[:, :-1], tokens[:, 1:]


def main(rank: int, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    whole = build_model("debug", vocab_size=VOCAB, seq_len=SEQ, seed=0)
    sharded = shard_model(build_model("debug", vocab_size=VOCAB, seq_len=SEQ, seed=0), mesh)
    result = {}
    for step, mode in ((3, "approx"), (4, "exact")):
        # This rank's slot in the replica, half of its rows in ``mode`` and half exact (a neighbor that covers).
        mine = [SlotWork(slot=rank, rows=(0, 2), mode=mode), SlotWork(slot=rank, rows=(2, 4), mode="exact")]
        both = [SlotWork(slot=s, rows=w.rows, mode=w.mode) for s in (0, 1) for w in mine]
        got, want = [], []
        for model, items, sink in ((sharded, mine, got), (whole, both, want)):
            adapter = adapter_for(model, rank=2, tau=1, approximates=True, policy="neighbor")
            layout = GradLayout(model, adapter)
            buf = compute_gradient_sums(model, adapter, layout, items, step=step, micro_batch=MB, batch_fn=batch)
            if model is sharded:  # as Job.gradient_sums: the weights and loss of the whole replica
                dist.all_reduce(buf[layout.n_grad:])
            sink.append((layout, buf))
        (ls, bs), (lw, bw) = got[0], want[0]
        diffs = {name: float((ls.grad_view(bs, i) - local_part(lw.grad_view(bw, i), p)).abs().max())
                 for i, (name, p) in enumerate(zip(ls.names, ls.params))}
        # How far the approximation is from exact training on the same rows (it must be: else this proves nothing).
        exact = [SlotWork(slot=w.slot, rows=w.rows, mode="exact") for w in both]
        adapter = adapter_for(whole, rank=2, tau=1, approximates=True, policy="neighbor")
        be = compute_gradient_sums(whole, adapter, lw, exact, step=step, micro_batch=MB, batch_fn=batch)
        result[mode] = {"grads": diffs, "tail": float((bs[ls.n_grad:] - bw[lw.n_grad:]).abs().max()),
                        "off_exact": float((bw[:lw.n_grad] - be[:lw.n_grad]).abs().max())}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
