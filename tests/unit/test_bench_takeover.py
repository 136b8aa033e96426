"""``unbroken bench takeover``: the covering worker's items under each policy, timed beside a normal worker's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unbroken.bench.takeover import main

pytestmark = pytest.mark.timeout(300)  # a loaded 2-core machine: the test itself takes ~20 s


def test_each_policy_covers_the_dead_workers_rows_and_is_timed_beside_a_normal_worker(tmp_path: Path):
    out = tmp_path / "t.json"
    r = main(["--preset", "debug", "--slots", "4", "--repeats", "2", "--compile", "off", "--out", str(out),
              "--data.micro_batch=4", "--data.seq_len=32"])
    assert json.loads(out.read_text())["items"] == r["items"]
    assert r["items"]["normal"] == [[0, 0, 4, "exact"]]
    # worker 3 dead: neighbor gives its whole micro-batch to one survivor, both approximate
    assert r["items"]["neighbor"] == [[0, 0, 4, "approx"], [3, 0, 4, "approx"]]
    for name in ("spread", "spread-approx"):  # the dead slot's rows shared out: the busiest survivor's part
        own, share = r["items"][name]
        assert own == [0, 0, 4, "exact"] and share[0] == 3 and share[3] == ("exact" if name == "spread" else "approx")
    assert r["benchmark"] == "takeover" and r["device"] == "cpu" and r["compile"] == [False]
    assert set(r["policies"]) == {"neighbor", "spread", "spread-approx"}
    for name, p in r["policies"].items():  # time and FLOPs side by side, from the same items
        assert set(p["time_ratio"]) == {"off"} and p["time_ratio"]["off"] > 0 and p["cpu_time_ratio"]["off"] > 0
        assert p["flop_ratio"] == r["flops"][name] / r["flops"]["normal"]
    # neighbor: two approximate micro-batches (no attention backward, low-rank FFN gradients) against one exact
    assert 1.0 < r["policies"]["neighbor"]["flop_ratio"] < 2.0
    share = r["items"]["spread"][1]
    assert r["policies"]["spread"]["flop_ratio"] == pytest.approx(1 + (share[2] - share[1]) / 4)  # exact rows
    run = r["runs"]["off"]
    assert all(len(v) == 2 and min(v) > 0 for v in run["seconds"].values())
    assert all(n == 0 for n in run["graphs_compiled_in_warmup"].values()) and not run["approx_compiled"]
