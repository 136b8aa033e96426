"""``unbroken agent --from-slurm``: a task's place from Slurm's environment, and the refusals of a step (or a
batch script) that contradicts the command line; ``unbroken train --prepare-only``'s refusals.

The environments are those ``srun`` gives its tasks; the full path (real slurmctld, slurmd, sbatch and
srun) is tests/integration/test_slurm.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from unbroken.agent.options import AgentOptions, add_agent_args, options_from
from unbroken.agent.slurm import expand_nodelist, store_port
from unbroken.cli import main as cli_main

pytestmark = pytest.mark.timeout(60)

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"
ETCD = "etcd://10.0.0.9:2379"


def _task(task: int, ntasks: int = 3, *, node: int | None = None, restarts: int = 0) -> dict[str, str]:
    """The environment srun gives task ``task`` of a step of ``ntasks`` tasks, one per node."""
    return {"SLURM_JOB_ID": "4242", "SLURM_PROCID": str(task), "SLURM_NTASKS": str(ntasks),
            "SLURM_NODEID": str(task if node is None else node), "SLURM_STEP_NODELIST": f"gpu[01-{ntasks:02d}]",
            "SLURM_STEP_NUM_NODES": str(ntasks), "SLURM_RESTART_COUNT": str(restarts)}


def _options(env: dict[str, str], run_dir: Path, *flags: str, nnodes: int = 2, spare: int = 1) -> AgentOptions:
    ap = argparse.ArgumentParser()
    add_agent_args(ap)
    argv = ["--from-slurm", "--nnodes", str(nnodes), "--spare-nodes", str(spare), "--workers-per-node", "4",
            "--run-dir", str(run_dir), *flags]
    return options_from(ap.parse_args(argv), env)


def test_tasks_are_the_nodes_then_the_spares_and_task_0_hosts_the_store(tmp_path: Path) -> None:
    first, second, spare = (_options(_task(t), tmp_path, "--store", "10.0.0.1:29500") for t in range(3))
    assert (first.node_rank, first.spare, first.host_store, first.store) == (0, False, True, "10.0.0.1:29500")
    assert (second.node_rank, second.spare, second.host_store) == (1, False, False)
    assert (spare.node_rank, spare.spare, spare.host_store) == (-1, True, False)
    for opts in (first, second, spare):
        assert opts.faults() == () and opts.resume is None and opts.start_step == 0 and not opts.resume_memory
        assert (opts.nnodes, opts.workers_per_node, opts.n_workers) == (2, 4, 8)
    on_etcd = _options(_task(0), tmp_path, "--store", ETCD)
    assert (on_etcd.node_rank, on_etcd.host_store, on_etcd.store) == (0, False, ETCD), \
        "the batch step opened the job's keys on etcd: task 0 connects like the others"


def test_a_task_count_other_than_nodes_plus_spares_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as e:
        _options(_task(1, ntasks=4), tmp_path)
    assert str(e.value) == (
        "--from-slurm: SLURM_NTASKS=4 tasks, but --nnodes 2 + --spare-nodes 1 = 3 agents: run one task per node "
        "of an allocation of 3 nodes (sbatch --nodes=3, srun --ntasks-per-node=1), or change --nnodes/--spare-nodes")


def test_a_task_index_out_of_range_is_refused_with_every_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as e:
        _options(_task(3, ntasks=3), tmp_path, spare=0)
    assert str(e.value) == (
        "--from-slurm: SLURM_NTASKS=3 tasks, but --nnodes 2 + --spare-nodes 0 = 2 agents: run one task per node "
        "of an allocation of 2 nodes (sbatch --nodes=2, srun --ntasks-per-node=1), or change --nnodes/--spare-nodes; "
        "SLURM_PROCID=3 is outside 0..1 (--nnodes 2 + --spare-nodes 0)")
    with pytest.raises(ValueError) as e:
        _options(_task(0), tmp_path, spare=-1, nnodes=4)
    assert str(e.value) == "--from-slurm: --spare-nodes -1: expected >= 0"


def test_task_0_off_the_first_node_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as e:
        _options(_task(0, node=2), tmp_path)
    assert str(e.value) == (
        "--from-slurm: SLURM_PROCID=0 runs on SLURM_NODEID=2, not on the first node of gpu[01-03] (where node 0 "
        "hosts the store): keep srun's block distribution (drop --distribution and --relative)")


def test_outside_a_slurm_step_the_agent_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as e:
        _options({"SLURM_JOB_ID": "7"}, tmp_path)
    assert str(e.value) == (
        "--from-slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_NODEID, SLURM_STEP_NODELIST not set: this is not a task "
        "of a Slurm step; start the agents with srun (one task per node), or give --node-rank (or --spare) and "
        "--store instead of --from-slurm")
    with pytest.raises(ValueError, match=r"^--from-slurm: SLURM_NTASKS='3x': expected a whole number"):
        _options({**_task(0), "SLURM_NTASKS": "3x"}, tmp_path)


def test_flags_that_contradict_or_need_from_slurm(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as e:
        _options(_task(0), tmp_path, "--node-rank", "0", "--host-store")
    assert str(e.value) == ("--from-slurm with --node-rank, --host-store: Slurm's task index says which node this is "
                            "and whether it hosts the store; drop --node-rank, --host-store")
    with pytest.raises(ValueError) as e:
        _options(_task(0), tmp_path, "--store", ETCD, "--store-port", "29500")
    assert str(e.value) == (f"--store {ETCD} with --store-port 29500: give one (--store-port puts the store on the "
                            f"first host of gpu[01-03])")
    ap = argparse.ArgumentParser()
    add_agent_args(ap)
    plain = ["--nnodes", "2", "--workers-per-node", "1", "--run-dir", str(tmp_path)]
    with pytest.raises(ValueError) as e:
        options_from(ap.parse_args([*plain, "--node-rank", "1", "--store", "h:1", "--spare-nodes", "1"]), {})
    assert str(e.value) == ("--spare-nodes without --from-slurm: a spare started by hand takes --spare, and --store "
                            "names the store's HOST:PORT")
    with pytest.raises(ValueError) as e:
        options_from(ap.parse_args([*plain, "--node-rank", "1"]), {})
    assert str(e.value) == ("--store is required: HOST:PORT of the job's store, or etcd://HOST:PORT[,...] "
                            "(or --from-slurm under srun)")


def test_a_requeued_job_resumes_from_the_newest_checkpoint_and_memory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--run-dir .*: a requeued job resumes its run, but .*config.json cannot"):
        _options(_task(1, restarts=1), tmp_path, "--store", ETCD)
    (tmp_path / "config.json").write_text(json.dumps({"fault": {"recovery": "takeover"}}))
    opts = _options(_task(1, restarts=2), tmp_path, "--store", ETCD)
    assert (opts.resume, opts.start_step, opts.resume_memory) == (None, 0, True), "no checkpoint yet: memory only"
    (tmp_path / "config.json").write_text(json.dumps({"fault": {"recovery": "restart"}}))
    opts = _options(_task(2, restarts=1), tmp_path, "--store", ETCD)
    assert opts.spare and not opts.resume_memory, "checkpoint-restart resumes from checkpoints only"
    given = tmp_path / "checkpoints" / "step_0000040"
    opts = _options(_task(0, restarts=1), tmp_path, "--store", ETCD, "--resume", str(given), "--start-step", "40")
    assert (opts.resume, opts.start_step, opts.resume_memory) == (given, 40, False), "the command line's own wins"


def test_the_default_store_port_follows_the_job_id() -> None:
    assert store_port("4242") == 24242 and store_port("123457") == 23457 and store_port("10000") == 20000


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol not installed: apt-get install slurm-client")
def test_a_node_list_expands_in_its_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "slurm.conf"  # scontrol reads a configuration; expanding a list asks no daemon
    conf.write_text("ClusterName=c\nSlurmctldHost=localhost\nNodeName=gpu[01-08]\nPartitionName=p Nodes=ALL\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    assert expand_nodelist("gpu[07-08,01],login3") == ["gpu07", "gpu08", "gpu01", "login3"]


def test_the_batch_script_outside_slurm_says_so(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(SCRIPT), "--preset", "debug"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=20)
    assert done.returncode == 2
    assert done.stderr == ("train.sbatch: not inside a Slurm job (SLURM_JOB_ID is not set): submit it with "
                           f"RUN_DIR=DIR sbatch --nodes=N+S {SCRIPT} [unbroken train options]\n")
    assert not any(tmp_path.iterdir()), "nothing was written"


def test_prepare_only_refuses_the_agents_options_and_faults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert cli_main(["train", "--prepare-only", "--out", str(out), "--standby", "--spare-nodes", "1"]) == 2
    assert capsys.readouterr().err == ("unbroken train: error: --prepare-only with --standby, --spare-nodes: those are "
                                       "the agents' options; give them to unbroken agent on each node instead\n")
    assert cli_main(["train", "--prepare-only", "--out", str(out), "--faults", "high"]) == 2
    assert capsys.readouterr().err == (
        "unbroken train: error: fault.fail_at='', fault.trace='high': only unbroken train's own launcher injects "
        f"faults; on a cluster give the agents --fail-at, or run unbroken chaos --run-dir {out} beside the job\n")
    assert not out.exists(), "nothing was written"
