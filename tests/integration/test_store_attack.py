"""A real job under an attacker who reaches its store and knows its namespace: nothing changes.

The attacker is a plain ``TCPStore`` client of the job's port. It lists the
keys (learning the namespace from the job's marker), then, all through the
run, plants a forged value of every kind wherever the key is absent: the next
views and their outcomes, dead marks of every worker, ``done`` and ``failed``,
join requests, the next groups' rendezvous addresses; and it overwrites every
worker's heartbeat counter. Planting where absent never erases an authentic
value (overwriting would: an availability attack, like flooding the port,
that the seal does not claim to stop). Worker 1 is killed mid-run, so views
change and groups rendezvous under the attack. The job ends as every scenario
must (:func:`_faults.check_invariants`), with exactly the one failure injected.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from _faults import check_invariants, failover_config, run_job, store_port

from unbroken.runtime.view import View

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STEPS = 40


def _forge(port: int, stop: threading.Event, planted: list[int]) -> None:
    raw = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=30))
    ns = next(k[:-len("job")] for k in raw.list_keys() if k.endswith("/job"))
    while not stop.is_set():
        keys = {k[len(ns):] for k in raw.list_keys() if k.startswith(ns)}
        gen = max((int(k.split("/")[1]) for k in keys if k.startswith("view/") and k.split("/")[1].isdigit()),
                  default=0)
        forged: dict[str, str | bytes] = {"done": "1", "failed": "forged: stop", "progress": str(10 * STEPS)}
        for g in (gen + 1, gen + 2):
            forged[f"view/{g}"] = View(gen=g, members=(3,), step=0, reason="forged").to_json()
            forged[f"outcome/{g}"] = f"{STEPS}:commit"
            forged.update({f"pg/{g}/0/{r}": b"\x7f" * 64 for r in range(4)})
        for w in range(4):
            forged[f"dead/{w}"] = '{"by": 9, "how": "forged"}'
            forged[f"join/{w}"] = '{"pid": 1}'
        for key, value in forged.items():
            if raw.compare_set(ns + key, "", value) == (value.encode() if isinstance(value, str) else value):
                planted[0] += 1
        for w in range(4):
            raw.set(f"{ns}hb/{w}", "0")
        stop.wait(0.05)


def test_an_attacker_who_knows_the_namespace_changes_nothing(tmp_path, corpus_overrides):
    run_dir = tmp_path / "run"
    cfg = failover_config(corpus_overrides, STEPS)
    stop, planted = threading.Event(), [0]
    attacker: list[threading.Thread] = []

    def on_record(record: dict[str, Any]) -> None:
        if not attacker and record.get("kind") == "train":
            attacker.append(threading.Thread(target=_forge, args=(store_port(run_dir), stop, planted), daemon=True))
            attacker[0].start()

    try:
        job = run_job(cfg, run_dir, nodes=2, workers_per_node=2, restart="on-failure", on_record=on_record,
                      fail_at="step=12:worker=1:kill:phase=forward")
    finally:
        stop.set()
        for t in attacker:
            t.join(10)
    assert planted[0] > 100, f"the attacker planted only {planted[0]} values"
    check_invariants(job, live=[0, 1, 2, 3])
    assert job.summary["failures"] == 1 and job.summary["restarts"] == 1, "no death but the injected one"
    assert not [e for e in job.events("fence") if e["worker"] != 1]
