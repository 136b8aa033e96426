"""The main job, reduced: it survives its three faults and its verdict comes from the ledger."""

from __future__ import annotations

import json

from unbroken.demo import demo_faults, run_demo
from unbroken.runtime.ledger import check_ledger


def test_the_demo_survives_a_kill_a_hang_and_a_node_loss(tmp_path, corpus_overrides):
    out = tmp_path / "default"
    steps = 120
    verdict = run_demo(out, steps=steps, overrides=corpus_overrides)
    assert verdict["ok"], verdict
    assert verdict["faults_injected"] == demo_faults(steps) == "step=12:worker=1:kill,step=30:worker=2:stop,step=48:node=1:kill"
    # The node loss takes two workers: at least four deaths (a survivor whose own all-reduce broke while
    # the other's completed leaves and rejoins too), at least three failed steps, each stall measured. (The
    # demo's hang detector fires after 1 s of silence: on a loaded machine a member starved that long is
    # fenced too and comes back; that costs a stall, never a row.)
    assert verdict["failures_survived"] >= 4 and len(verdict["stalls_s"]) >= 3
    # The kill and the hang are covered by the warm standby (and the survivor that left, if one did).
    assert verdict["standby_handovers"] >= 2
    ledger = check_ledger(out, n_slots=4, micro_batch=json.loads((out / "config.json").read_text())["data"]["micro_batch"],
                          steps=steps)
    assert ledger.ok and verdict["lost_steps"] == len(ledger.lost_steps) == 0
    assert verdict["rows_trained_never"] == ledger.rows_never == 0 and verdict["rows_trained_twice"] == 0
    assert verdict["steps"] == ledger.committed == steps
    assert verdict["workers_agree"]
    # The lost node's rank was taken by the spare node that started with the job (no new agent first).
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    (took,) = [e for e in events if e.get("event") == "spare_took_over"]
    assert took["node"] == 1 and took["took_over"]
    assert verdict["spare_nodes"] == 1
    reference = json.loads((tmp_path / "default-failure-free" / "summary.json").read_text())
    assert verdict["failure_free_val_ppl"] == reference["val_ppl"]
    # spread (the default policy) computes everything exactly: the same model as without failures, up to
    # the order of float sums.
    assert abs(verdict["val_ppl_vs_failure_free"]) < 1e-3
    assert json.loads((out / "demo.json").read_text()) == json.loads(json.dumps(verdict))
