"""HSDP checkpoints on a real 2-rank gloo world with FSDP2: each rank writes its shards as a part, the leader
the rest; a model sharded the same way loads each rank's own part alone, a replicated model the parts
concatenated."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist

CHILD = r"""
import json, os, sys, torch, torch.distributed as dist
from datetime import timedelta
from pathlib import Path
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from unbroken.checkpoint.checkpointer import AsyncCheckpointer, load_checkpoint, training_state
from unbroken.checkpoint.sharded import ShardCheckpointer
from unbroken.sharding.layout import ShardedModel
from unbroken.state.training_state import layout_of

rank, port, run = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=dist.PrefixStore("w", store), rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))

def build(seed, shard=True):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))  # 5 and 3 rows: uneven chunks
    if shard:
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)

model, opt = build(0)
for step in range(2):
    torch.manual_seed(10 + step)
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    opt.zero_grad()
state = training_state(model, opt)
whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}  # collectives
layout = ShardedModel(None, index=rank, shard_degree=2)
rest, own = layout.split(state)
parts = ShardCheckpointer(run)
parts.save_part(2, 0, *own)
parts.close()
if rank == 0:
    ckpt = AsyncCheckpointer(run, config_hash="h")
    ckpt.save(2, rest, {"loss": 0.0}, shards=(0, *layout.checkpoint_parts()), layout=layout_of(state))
    ckpt.wait()
dist.barrier()
path = run / "checkpoints" / "step_0000002"
fresh, fresh_opt = build(1)
load_checkpoint(path, fresh, fresh_opt, config_hash="h")
got = training_state(fresh, fresh_opt)
same = all(torch.equal(got[k].to_local() if hasattr(got[k], "to_local") else got[k],
                       state[k].to_local() if hasattr(state[k], "to_local") else state[k]) for k in state)
plain_ok = None
if rank == 0:
    flat, flat_opt = build(2, shard=False)
    load_checkpoint(path, flat, flat_opt, config_hash="h")
    flat_state = training_state(flat, flat_opt)
    plain_ok = all(torch.equal(flat_state[k], whole[k]) for k in whole if k != "rng.cpu")
    from unbroken.export import read_model_weights  # what unbroken export --hf reads: whole parameters

    exported = read_model_weights(path)
    plain_ok = plain_ok and sorted(exported) == sorted(k.removeprefix("model.") for k in whole
                                                      if k.startswith("model.")) and all(
        torch.equal(t, whole["model." + k]) for k, t in exported.items())
files = sorted(p.name for p in (path / "shards").iterdir())
commit = json.loads((path / "commit.json").read_text())
print(json.dumps({"same": same, "plain": plain_ok, "parts": files, "hsdp_parts": commit.get("hsdp_parts"),
                  "leader_keys": sorted(k.split(".")[0] for k in json.loads(
                      (path / "model.safetensors.index.json").read_text())["weight_map"])}), flush=True)
dist.barrier()
os._exit(0)
"""


def test_each_rank_writes_its_shards_and_loads_them_back_or_the_whole_tensors(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), str(store.port), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert got[0]["parts"] == ["i0", "i1"] and got[0]["hsdp_parts"] == 2
    assert set(got[0]["leader_keys"]) == {"group", "optim", "rng"}, "the leader writes no sharded tensor itself"
    assert got[0]["same"] and got[1]["same"], "each rank loads its own shards back, bit for bit"
    assert got[0]["plain"], "a replicated model (and unbroken export) gets the parts concatenated: the whole tensors"


def test_the_parts_a_takeover_writes_are_staged_apart_from_the_dead_writers(tmp_path):
    """The final checkpoint's writer died after its replica staged its parts; the replica taking over stages its
    own under its own writer and commits them alone (a part being rewritten under the other stage can never be
    read half gone), and the dead writer's stage is removed."""
    import hashlib

    import torch

    from unbroken.checkpoint.sharded import ShardCheckpointer, collect_shards, staging_dir

    dead, taker = ShardCheckpointer(tmp_path), ShardCheckpointer(tmp_path)
    for name, value in (("i0", 1.0), ("i1", 2.0)):
        dead.save_part(24, "4w0", name, {"w": torch.full((3,), value)}, about={"dims": {"w": 0}})
        dead.wait()
        taker.save_part(24, "4w2", name, {"w": torch.full((3,), 10 * value)}, about={"dims": {"w": 0}})
        taker.wait()
    dest = tmp_path / "checkpoints" / "step_0000024"
    dest.mkdir(parents=True)
    known = collect_shards(tmp_path, 24, "4w2", ["i0", "i1"], dest)
    assert sorted(known) == [f"shards/{p}/{f}" for p in ("i0", "i1")
                             for f in ("model-00001-of-00001.safetensors", "model.safetensors.index.json")]
    assert all(hashlib.sha256((dest / f).read_bytes()).hexdigest() == d for f, d in known.items())
    from safetensors.torch import load_file

    assert load_file(dest / "shards" / "i1" / "model-00001-of-00001.safetensors")["w"].tolist() == [20.0] * 3
    assert not staging_dir(tmp_path, 24, "4w0").exists() and not staging_dir(tmp_path, 24, "4w2").exists()
    dead.close()
    taker.close()


def test_a_commit_removes_the_stages_before_its_own_in_number_order(tmp_path):
    """Stages order by (step, generation, writer) as numbers: committing generation 12 removes generation 3's
    stage of the same step and every earlier step's, and keeps what comes after it (a later generation's)."""
    import torch

    from unbroken.checkpoint.sharded import ShardCheckpointer, collect_shards, staging_dir

    writer = ShardCheckpointer(tmp_path)
    for step, gen in ((9, 30), (10, 3), (10, 12), (10, 13), (11, 1)):
        writer.save_part(step, gen, "0-3", {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)})
        writer.wait()
    (tmp_path / "checkpoints" / ".shards" / "notes").mkdir()
    dest = tmp_path / "checkpoints" / "step_0000010"
    dest.mkdir(parents=True)
    collect_shards(tmp_path, 10, 12, ["0-3"], dest)
    left = sorted(p.name for p in (tmp_path / "checkpoints" / ".shards").iterdir())
    assert left == ["notes", staging_dir(tmp_path, 10, 13).name, staging_dir(tmp_path, 11, 1).name]
    writer.close()


def test_a_takeover_by_a_lower_writer_removes_the_dead_writers_stage(tmp_path):
    """Whatever the ids, the committed final checkpoint leaves no other writer's stage of its step and generation
    behind (worker 1's replica commits after worker 3's died having staged its parts); a later generation's stage
    of the step stays."""
    import torch

    from unbroken.checkpoint.sharded import ShardCheckpointer, collect_shards, staging_dir

    writer = ShardCheckpointer(tmp_path)
    for gen in ("4w3", "4w1", "5w0"):
        writer.save_part(24, gen, "i0", {"w": torch.zeros(3)}, about={"dims": {"w": 0}})
        writer.wait()
    dest = tmp_path / "checkpoints" / "step_0000024"
    dest.mkdir(parents=True)
    collect_shards(tmp_path, 24, "4w1", ["i0"], dest)
    left = sorted(p.name for p in (tmp_path / "checkpoints" / ".shards").iterdir())
    assert left == [staging_dir(tmp_path, 24, "5w0").name], "the dead writer's stage was left behind"
    writer.close()
