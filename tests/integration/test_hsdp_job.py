"""HSDP in a real job (``train.shard_degree=2``): FSDP2 inside each replica, unbroken across replicas.

One job of 2 nodes x 2 workers, so each node is one replica of two ranks (real processes, gloo, SIGKILL),
sharded by a recipe of the user's (``model.parallelize``):

- worker 3 dies with the cross-replica reduction of step 5 in flight: its agent fences its sibling
  (worker 2: a replica with a dead rank cannot finish FSDP2's collectives), the other replica trains
  the lost rows in the same step (rank ``i`` takes slot ``2 + i``), and replica 1 comes back whole, each
  rank receiving its shard from the rank of the same index;
- worker 0, the leader, dies in the forward pass of step 15: the leadership moves to replica 1 until
  replica 0 is back;
- worker 0, the leader again, dies after the last step with the final checkpoint begun: replica 1 writes
  it in its stead, each of its two ranks writing its part;
- replica 1 lost while replica 0's restarted ranks are being admitted (before the admitting view's first step
  commits): only ranks still waiting for the state are left, and the agents restore the job from snapshot
  memory by themselves;
- at the end: every ``(step, slot, row)`` trained exactly once, the workers of each shard index hold the
  same shards, and (under ``spread``, exact) the final checkpoint (its parts joined) equals plain
  single-process training on the same batches to float tolerance; under ``neighbor`` the covering replica
  trains approximated (MeCeFO inside FSDP2).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from _faults import MICRO_BATCH, _ours_alive, check_invariants, failover_config, run_job
from _reference import checkpoint_params, reference_train
from unbroken.agent.launcher import JobFailed, launch
from unbroken.config import config_from_dict
from unbroken.runtime.ledger import check_ledger, read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 24
# Every fault here is a SIGKILL, found by the agents and by broken collectives: no hang to detect, so the heartbeat
# timeout is set well above the default, which a loaded 2-core machine can exceed (a false death is a different
# scenario).
QUIET = "fault.heartbeat_timeout_s=6.0"


# The recipe marks each process it sharded. It also paces the scenario on events rather than on the speed of
# the machine: a forward pass waits while fewer than 4 marked processes are alive (a replica is down and its
# restart has not built its model yet), so the restarted replica asks to join with steps left to admit it
# however loaded the machine is (the surviving replica would otherwise race through the remaining steps).
RECIPE = """
import os
import time
from torch.distributed.fsdp import fully_shard

MARKS = {marks!r}

def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

def _wait_for_a_whole_job(module, args):
    deadline = time.monotonic() + 60
    while sum(_alive(int(p)) for p in os.listdir(MARKS)) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)

def recipe(model, mesh):
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    model.register_forward_pre_hook(_wait_for_a_whole_job)
    open(os.path.join(MARKS, str(os.getpid())), "w").close()
"""


@pytest.mark.parametrize("policy", ["spread", "neighbor"])
def test_a_dead_rank_takes_its_replica_down_the_step_is_finished_and_the_replica_rejoins(tmp_path, corpus_overrides,
                                                                                        policy):
    marks = tmp_path / "recipe_called"
    marks.mkdir()
    (tmp_path / "recipe.py").write_text(RECIPE.format(marks=str(marks)))
    cfg = failover_config(corpus_overrides, STEPS, f"mecefo.policy={policy}", "train.shard_degree=2",
                          f"model.parallelize={tmp_path / 'recipe.py'}:recipe", QUIET)
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2, restart="on-failure",
                  fail_at=f"step=5:worker=3:kill:phase=allreduce,step=15:worker=0:kill:phase=forward,"
                          f"step={STEPS}:worker=0:kill:phase=finish")
    leaked = [pid for pid in sorted(job.pids) if _ours_alive(pid, job.run_dir)]
    assert job.pids and not leaked, f"processes of the job still running after launch returned: {leaked}"
    ledger = check_ledger(job.run_dir, n_slots=4, micro_batch=MICRO_BATCH, steps=STEPS)
    assert ledger.ok and ledger.committed == STEPS, ledger.to_json()
    # Worker 1, the dead leader's sibling, reports too if the final checkpoint was committed before its agent
    # reaped worker 0 (it then finished like the others, holding the same state)
    reports = sorted(int(p.stem[1:]) for p in (job.run_dir / "workers").glob("w*.json"))
    assert reports in ([2, 3], [1, 2, 3]) and job.summary["workers_agree"], (reports, job.summary["param_digest"])
    # The user's recipe sharded the model of the 4 first workers and of both replicas' restarts (replica 0's
    # restart after the end may be stopped before it builds anything).
    starts = {e["pid"] for e in job.records if e.get("event") == "worker_start"}
    recipes = {int(p.name) for p in marks.iterdir()}
    assert recipes <= starts and len(recipes) >= 8, (recipes, starts)
    (takeover,) = job.events("final_checkpoint_takeover")
    assert takeover["worker"] == 2 and takeover["leader"] == 0
    assert job.summary["steps"] == STEPS and job.summary["checkpoint"].endswith(f"step_{STEPS:07d}")

    # Each death took its sibling down: fenced by its agent, not by a timeout. At step 5 worker 2, or worker 3
    # when worker 2 died first of its broken all-gather and its agent reaped it before the dying worker 3 (it
    # then fenced worker 3 for it); at step 15 worker 1, or worker 0 likewise; worker 1 again after the last
    # step unless it had already left when its agent reaped worker 0.
    fences = [(e["time"], e["worker"]) for e in job.records
              if e.get("event") == "fence" and e["reason"].get("how") == "replica"]
    (at15,) = [e["time"] for e in job.events("fault_self") if e["step"] == 15]
    assert [w for t, w in fences if t < at15] in ([2], [3]), fences
    assert [w for t, w in fences if t >= at15][:1] in ([1], [0]), fences

    # The step of each failure was finished by the other replica, rank i taking slot 2r + i. Worker 3 dies just
    # after posting its part of the cross-replica reduction: a two-rank reduction of this size may complete in
    # that window, and then step 5 commits whole (worker 3's sum in it, each worker its own slot) and the next
    # step is the one replica 0 finishes alone.
    first = 5
    if {i[0] for i in job.committed_items(5)} == {0, 1, 2, 3}:
        assert sorted((w, slot, mode) for w, slot, _, _, mode in job.committed_items(5)) == \
            [(w, w, "exact") for w in range(4)]
        first = 6
    for step, lost in ((first, 1), (15, 0)):
        items = job.committed_items(step)
        assert {i[1] for i in items} == {0, 1, 2, 3}
        for worker, slot, _, _, mode in items:
            assert worker // 2 != lost and worker % 2 == slot % 2, (step, items)
            # spread is exact; under neighbor (MeCeFO) the lost replica's slots are trained approximated, inside
            # FSDP2 (tests/integration/test_hsdp_approx.py checks those gradients against the whole model's)
            if slot // 2 == lost or policy == "spread":
                assert mode == ("exact" if policy == "spread" else "approx"), (step, items)

    # Both replicas rejoined whole, and the leadership moved to replica 1 while replica 0 was down.
    rejoins = {tuple(sorted(e["joiners"])) for e in job.records
               if e.get("event") == "view_adopted" and e.get("joiners")}
    assert rejoins == {(2, 3), (0, 1)}, rejoins
    leaders = {min(e["members"]) for e in job.events("view_adopted")}
    assert 2 in leaders, leaders

    if policy == "spread":  # exact: plain training's result
        got, want = checkpoint_params(job.summary["checkpoint"]), reference_train(job.cfg)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-4, msg=name)  # as test_failover


def test_a_whole_job_killed_restores_its_shards_from_memory_and_resumes_unsharded(tmp_path, corpus_overrides):
    """One node of 4 workers, 2 replicas of 2 ranks, a snapshot every step and a checkpoint every 4 steps:

    - worker 3 dies in step 2: replica 1 comes back and each of its ranks loads its shard index's state of
      the boundary it joins at from the node's snapshot memory (the live replica's rank of that index sealed
      it there), with no transfer;
    - every worker dies in step 6 with the cross-replica reduction in flight (the snapshot of step 6, taken
      after step 5, sealed by then on a quiet machine): the agents restore the job from snapshot memory at the
      newest step every rank sealed, step 6 (0 steps lost) or one before: the workers of each shard index
      snapshotted their shards together, and each rank loads its shards back from them;
    - the node is lost at step 13: no agent is left, the job stops and names ``--resume``;
    - ``--resume`` with ``train.shard_degree=1`` continues from the checkpoint of step 12, or of step 8 (it
      is committed before the loss: the save of step 12 first waited for it), with every worker
      holding the whole model (the checkpoint's parts, one per shard index, joined into whole tensors; the
      memory holds shards of another layout, which the resume passes over).

    Every step is trained exactly once in the end, and the result is plain training's on the same batches."""
    run = tmp_path / "run"
    marks = tmp_path / "recipe_called"  # the pacing recipe: replica 1 is back before step 6
    marks.mkdir()
    (tmp_path / "recipe.py").write_text(RECIPE.format(marks=str(marks)))
    cfg = failover_config(corpus_overrides, STEPS, "mecefo.policy=spread", "train.shard_degree=2",
                          "train.checkpoint_every=4", "snapshot.every=1",
                          f"model.parallelize={tmp_path / 'recipe.py'}:recipe", QUIET)
    kills = ",".join(f"step=6:worker={w}:kill:phase=allreduce" for w in range(4))
    with pytest.raises(JobFailed) as failed:
        run_job(cfg, run, nodes=1, workers_per_node=4, restart="on-failure",
                fail_at=f"step=2:worker=3:kill:phase=forward,{kills},step=13:node=0:kill")
    assert f"continue with: unbroken train --resume {run}" in str(failed.value)
    restores = [e for e in read_events(run) if e.get("event") == "job_restore"]
    (restore,) = restores
    rejoined = [e for e in read_events(run) if e.get("event") == "rejoin_from_memory"]
    early = [e for e in rejoined if e["time"] < restore["time"]]
    assert sorted(e["worker"] for e in early) == [2, 3] and len({e["step"] for e in early}) == 1, rejoined
    assert 2 <= early[0]["step"] <= 6, rejoined
    # Step 6's snapshot (taken after step 5) is written beside step 6: on a busy machine the agent can fence a
    # rank of the replica that died first before that rank sealed it, and every shard index needs all of its
    # ranks' fragments. The restore takes the newest step every rank sealed before it: 6, or one before. A
    # worker reports a seal when its training thread next waits for it, so a rank killed in between sealed a
    # step it never reported: the reported seals bound the restored step from below.
    sealed = [{e["step"] for e in read_events(run) if e.get("event") == "snapshot_sealed" and e["worker"] == w
               and e["time"] < restore["time"]} for w in range(4)]
    reported = max(set.intersection(*sealed))
    assert restore["restored_from"] == "memory" and reported <= restore["step"] <= 6, (restores, sealed)
    step = restore["step"]
    plans = {(e["worker"], e["shard_index"]) for e in read_events(run) if e.get("event") == "snapshot_plan"}
    assert plans == {(0, 0), (1, 1), (2, 0), (3, 1)}, plans
    loaded = [e for e in read_events(run) if e.get("event") == "restored"]
    assert all((e["restored_from"], e["step"]) == ("memory", step) for e in loaded), loaded
    # The step-6 kills land milliseconds apart: a replica whose agent restarted it before the last death can
    # make up the restored view alone; the other replica then rejoins it from memory at once.
    restored = sorted(e["worker"] for e in loaded)
    late = sorted(e["worker"] for e in rejoined if e["time"] > restore["time"])
    assert restored in ([0, 1, 2, 3], [0, 1], [2, 3]) and sorted(restored + late) == [0, 1, 2, 3], rejoined

    flat = config_from_dict(cfg.to_dict())
    flat.train.shard_degree = 1  # as `unbroken train --resume RUN --train.shard_degree=1` changes it
    flat.model.parallelize = ""
    summary = launch(flat, run, nodes=1, workers_per_node=4, resume=True)
    assert summary["steps"] == STEPS and summary["workers_agree"]
    assert summary["resumed_from"].endswith(("step_0000008", "step_0000012")), summary["resumed_from"]
    ledger = check_ledger(run, n_slots=4, micro_batch=MICRO_BATCH, steps=STEPS)
    assert ledger.ok and ledger.committed == STEPS, ledger.to_json()
    got, want = checkpoint_params(summary["checkpoint"]), reference_train(flat)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-4, msg=name)



# As RECIPE, and paced on events, not on the machine's speed:
# - a process started after the first four (a restarted rank: 4 marks already there when its recipe runs) says
#   when its main thread waits to be admitted (its join request is in), and at its first forward pass, the first
#   step it trains after its admission, writes a file and waits there until the test releases it: that step
#   cannot commit meanwhile;
# - one of the first four, once restarted ranks are built, does not go on with a step until two of them wait to
#   be admitted, so they are admitted with steps left however loaded the machine is.
HOLDING_RECIPE = RECIPE + """
import sys
import threading

FIRST, RELEASED, WAITING = {first!r}, {released!r}, {waiting!r}
_restarted = []

def _say_when_waiting_for_admission(main):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main)
        while frame is not None and frame.f_code.co_name != "_wait_view":
            frame = frame.f_back
        if frame is not None:
            open(os.path.join(WAITING, str(os.getpid())), "w").close()
            return
        time.sleep(0.01)

def _hold(module, args):
    if not _restarted:
        deadline = time.monotonic() + 120
        while (len(os.listdir(MARKS)) > 4 and len(os.listdir(WAITING)) < 2
               and time.monotonic() < deadline):
            time.sleep(0.01)
        return
    if _restarted[0]:
        _restarted[0] = False
        open(os.path.join(FIRST, str(os.getpid())), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(RELEASED) and time.monotonic() < deadline:
            time.sleep(0.01)

def holding_recipe(model, mesh):
    if len(os.listdir(MARKS)) >= 4:
        _restarted.append(True)
        threading.Thread(target=_say_when_waiting_for_admission, args=(threading.main_thread().ident,),
                         daemon=True).start()
    recipe(model, mesh)
    model.register_forward_pre_hook(_hold)
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.timeout(300)
def test_a_replica_lost_while_the_other_is_admitted_restores_the_job_from_memory_by_itself(tmp_path,
                                                                                         corpus_overrides):
    """2 nodes x 2 workers, 2 replicas of 2 ranks, a snapshot every step. Worker 0 dies in step 3 (replica 0
    goes down, and comes back as two joiners); once replica 1 admitted them and both are in the first step after
    their admission (held there, so the step cannot commit), replica 1's two ranks are killed. The admitting
    view's step never committed, so only workers still waiting for the state are left: nobody is left to hand
    it over. They leave marked dead, and the agents restore the job from snapshot memory by themselves, as when
    every worker dies, instead of stopping for a human; the run finishes, every step trained exactly once, the
    workers agreeing."""
    marks, first, released = tmp_path / "recipe_called", tmp_path / "first_forward", tmp_path / "released"
    waiting = tmp_path / "waiting_for_admission"
    for folder in (marks, first, waiting):
        folder.mkdir()
    (tmp_path / "recipe.py").write_text(HOLDING_RECIPE.format(marks=str(marks), first=str(first),
                                                              released=str(released), waiting=str(waiting)))
    cfg = failover_config(corpus_overrides, STEPS, "mecefo.policy=spread", "train.shard_degree=2",
                          "snapshot.every=1", "train.checkpoint_every_s=0",
                          f"model.parallelize={tmp_path / 'recipe.py'}:holding_recipe", QUIET)
    run = tmp_path / "run"
    killed: list[int] = []
    stop = threading.Event()

    def kill_replica_1_when_replica_0_is_admitted() -> None:
        while len(list(first.iterdir())) < 2 and not stop.wait(0.01):
            pass
        if stop.is_set():
            return
        for w in (2, 3):
            pid = int((run / "pids" / f"w{w}").read_text())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        while any(_running(pid) for pid in killed) and not stop.wait(0.01):
            pass
        released.touch()

    killer = threading.Thread(target=kill_replica_1_when_replica_0_is_admitted, daemon=True)
    killer.start()
    try:
        job = run_job(cfg, run, nodes=2, workers_per_node=2, restart="on-failure",
                      fail_at="step=3:worker=0:kill:phase=forward")
    finally:
        stop.set()
        released.touch()
        killer.join(timeout=10)
    assert len(killed) == 2, "replica 0 was never admitted back"
    check_invariants(job, live=[0, 1, 2, 3])
    admitted = min(e["step"] for e in job.events("view_adopted", worker=0) if e["joiners"] == [0, 1])
    # Replica 0's ranks, left with nobody to hand them the state, left marked dead (by themselves, or fenced
    # by their agent on that mark or with their sibling), and the job was restored from memory.
    left = [e for e in job.records if e.get("event") == "worker_exit" and e.get("worker") in (0, 1)
            and e.get("incarnation") == 2]
    assert sorted(e["worker"] for e in left) == [0, 1], left
    marked = [e for e in job.events("fence") if e["worker"] in (0, 1) and e["reason"].get("how") == "no live worker"]
    assert any(e["code"] == 4 for e in left) or marked, (left, marked)
    restores = job.events("job_restore")
    assert [e["restored_from"] for e in restores] == ["memory"] and restores[0]["step"] <= admitted, restores
    # A replica whose ranks were restarted before the other replica's left can make up the restored view alone;
    # the other is then admitted to it as a joiner (as in the whole-job kill above).
    restored = sorted(e["worker"] for e in job.events("restored"))
    late = {j for e in job.events("view_adopted") if e["time"] > restores[0]["time"] for j in e["joiners"]}
    assert restored in ([0, 1, 2, 3], [0, 1], [2, 3]) and set(restored) | late == {0, 1, 2, 3}, (restored, late)
