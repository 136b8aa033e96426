"""``unbroken bench takeover``: the covering worker's items under each policy, timed beside a normal worker's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unbroken.bench.takeover import main

pytestmark = pytest.mark.timeout(120)


def test_each_policy_covers_the_dead_workers_rows_and_is_timed_beside_a_normal_worker(tmp_path: Path):
    out = tmp_path / "t.json"
    r = main(["--preset", "debug", "--slots", "4", "--repeats", "2", "--out", str(out),
              "--data.micro_batch=4", "--data.seq_len=32"])
    assert json.loads(out.read_text())["items"] == r["items"]
    assert r["items"]["normal"] == [[0, 0, 4, "exact"]]
    # worker 3 dead: neighbor gives its whole micro-batch to one survivor, both approximate
    assert r["items"]["neighbor"] == [[0, 0, 4, "approx"], [3, 0, 4, "approx"]]
    for name in ("spread", "spread-approx"):  # the dead slot's rows shared out: the busiest survivor's part
        own, share = r["items"][name]
        assert own == [0, 0, 4, "exact"] and share[0] == 3 and share[3] == ("exact" if name == "spread" else "approx")
    assert set(r["covering_over_normal"]) == {"neighbor", "spread", "spread-approx"}
    assert all(len(v) == 2 and min(v) > 0 for v in r["seconds"].values())
    assert r["compile"] is False and all(n == 0 for n in r["frames_compiled_in_warmup"].values())
