"""Smoke tests of the MeCeFO cost benchmark and of the gradient error study beside it: each runs, writes its
JSON, and the headline holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import mecefo_grad_error
from unbroken.bench import mecefo_cost

pytestmark = pytest.mark.timeout(120)


def test_main_writes_json_with_expected_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cost.json"
    result = mecefo_cost.main([
        "--presets", "debug", "--n", "4", "--seq-len", "16", "--micro-batch", "2",
        "--ranks", "2,8", "--taus", "1,3", "--rank", "8", "--out", str(out),
    ])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert {"config", "method", "cost", "timings_s"} <= result.keys()

    cost = result["cost"]["debug"]
    assert cost["shape"] == {"micro_batch": 2, "seq_len": 16, "layers": 2, "layers_measured": [2],
                             "extrapolated": False, "device": "cpu", "dtype": "float32"}
    policies = cost["policies"]["n=4"]
    assert set(policies) == set(mecefo_cost.POLICIES)
    assert 1.0 < policies["neighbor"]["flops_ratio"] < 2.0
    assert policies["spread"]["flops_ratio"] == pytest.approx(1 + 1 / 3)
    assert cost["approx_microbatch"]["saved_bytes_ratio"] < 1.0
    assert cost["rows_linearity"] == pytest.approx(1.0)
    assert len(cost["sweep"]) == 4
    assert "neighbor" in capsys.readouterr().out


def test_grad_error_study_writes_json_with_expected_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "grad_error.json"
    result = mecefo_grad_error.main([
        "--n", "4", "--micro-batch", "2", "--seq-len", "16",
        "--error-presets", "debug", "--train-steps", "4", "--checkpoints", "2", "--error-seq-len", "16",
        "--ranks", "2,8", "--taus", "1,3", "--wall-presets", "debug", "--wall-reps", "1",
        "--data", "random", "--rank", "8", "--out", str(out),
    ])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert {"config", "method", "grad_error", "wall"} <= result.keys()

    errors = result["grad_error"]["debug"]
    micro = errors["default"]["microbatch"]
    assert micro["attention"]["mean"] == pytest.approx(1.0)  # no attention gradient by construction
    assert 0.0 < micro["ffn"]["mean"] < 1.5
    assert set(errors["default"]["aggregated"]["n=4"]) == {"neighbor", "spread-approx"}
    assert [(row["rank"], row["tau"]) for row in errors["sweep"]] == [(2, 1), (2, 3), (8, 1), (8, 3)]

    wall = result["wall"]["debug"]["ratios"]
    assert {"neighbor", "spread n=4", "spread-approx n=4"} == set(wall)
    assert all(v["ratio"] > 0 for v in wall.values())
    assert "neighbor" in capsys.readouterr().out
