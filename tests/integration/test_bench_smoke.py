"""Smoke tests: the throughput and failover benchmarks run end to end and write their JSON."""

from __future__ import annotations

import json

import pytest

from unbroken.bench import failover, throughput
from unbroken.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_throughput_benchmark(tmp_path, corpus_overrides):
    out = tmp_path / "tp.json"
    result = throughput.main(["--workers", "2", "--precision", "fp32,bf16", "--steps", "4", "--out", str(out),
                              *[f"--{o}" for o in corpus_overrides]])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert [(r["workers"], r["precision"]) for r in result["rows"]] == [(2, "fp32"), (2, "bf16")]
    assert all(r["tokens_per_s"] > 0 and r["scaling_vs_first"] == 1.0 for r in result["rows"])
    fp32, bf16 = result["rows"]
    assert bf16["bf16_vs_fp32"] == pytest.approx(bf16["tokens_per_s"] / fp32["tokens_per_s"])


def test_failover_benchmark_overhead_part(tmp_path, corpus_overrides):
    out = tmp_path / "fo.json"
    result = failover.main(["--steps", "8", "--repeats", "1", "--parts", "overhead", "--nodes", "1",
                            "--workers-per-node", "2", "--out", str(out), *[f"--{o}" for o in corpus_overrides]])
    assert json.loads(out.read_text())["overhead"]["ratio"] == pytest.approx(result["overhead"]["ratio"])
    assert len(result["overhead"]["plain_step_s"]) == len(result["overhead"]["takeover_step_s"]) == 1
    assert result["overhead"]["ratio"] > 0
    # 16 alternating steps; the first 4 are warm-up: 6 plain and 6 protocol steps are compared.
    assert result["overhead"]["alternating"]["steps_each"] == 6


def test_bench_rejects_unknown_arguments(capsys):
    with pytest.raises(SystemExit):
        throughput.main(["--bogus", "1"])
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
