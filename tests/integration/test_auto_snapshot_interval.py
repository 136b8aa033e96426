"""``snapshot.every = auto`` in a real job: the interval agreed by every worker, a whole-job SIGKILL restored
from the newest snapshot every node sealed, every step trained exactly once."""

from __future__ import annotations

import pytest
from _faults import MICRO_BATCH as MB
from _faults import check_invariants, run_job

from unbroken.config import load_config
from unbroken.runtime.ledger import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS, KILL_AT = 30, 12


def test_auto_interval_is_agreed_and_a_whole_job_kill_restores_within_its_recovery_point(tmp_path, corpus_overrides):
    overrides = [o for o in corpus_overrides if not o.startswith("snapshot.every")] + [
        "snapshot.every=auto", f"train.steps={STEPS}", "train.val_every=0", "train.val_batches=1",
        "optim.warmup_steps=2", f"data.micro_batch={MB}", "data.seq_len=32", "mecefo.policy=spread",
        "train.workers=2"]
    cfg = load_config(preset_name="debug", overrides=overrides)
    kills = ",".join(f"step={KILL_AT}:worker={w}:kill:phase=allreduce" for w in range(2))
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=1, fail_at=kills)
    check_invariants(job, live=[0, 1])

    # Every worker decides from the same reduced buffer: the same interval from the same step, per incarnation.
    chosen: dict[int, dict[int, int]] = {}
    for e in job.events("snapshot_interval"):
        chosen.setdefault(e["worker"], {})[e["step"]] = e["interval"]
        assert e["recovery_point_steps"] == 2 * e["interval"]
    assert sorted(chosen) == [0, 1] and chosen[0] == chosen[1], chosen
    before_kill = [i for s, i in chosen[0].items() if s <= KILL_AT]
    assert before_kill and all(1 <= i < 64 for i in before_kill)

    restores = job.events("job_restore")
    assert [e["restored_from"] for e in restores] == ["memory"]
    back = KILL_AT - restores[0]["step"]
    assert 0 <= back <= 2 * max(before_kill), f"restored {back} steps back, interval up to {max(before_kill)}"
    commits = [(r["step"], r["gen"]) for r in read_events(job.run_dir) if r.get("kind") == "commit"]
    assert not [s for s, g in commits if s < restores[0]["step"] and g > 0], "a step before the restore point redone"

    snaps = job.summary["snapshots"]
    assert snaps["every"] == "auto" and 1 <= snaps["interval"] < 64 and snaps["taken"] >= 1
    assert isinstance(snaps["settled"], bool)
    assert snaps["cost_s"] == snaps["slowest_write_s"]  # on the CPU a snapshot costs the training its write
    assert snaps["recovery_point_steps"] == 2 * max(snaps["interval"], snaps["spacing_steps"] or 0)
