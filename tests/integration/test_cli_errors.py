"""Bad input to ``unbroken train``: a clear error naming the problem, exit code 2, nothing written."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

from unbroken.cli import main

pytestmark = pytest.mark.timeout(120)


def _train(tmp_path, corpus_overrides, *args: str) -> list[str]:
    return ["train", "--out", str(tmp_path / "run"), *[f"--{o}" for o in corpus_overrides], *args]


def _fails(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, f"{needle!r} not in: {err}"
    return err


def test_unknown_preset_lists_valid_ones(tmp_path, capsys, corpus_overrides):
    _fails(capsys, _train(tmp_path, corpus_overrides, "--preset", "huge"), "unknown preset 'huge'", "debug, tiny")
    assert not (tmp_path / "run").exists()


def test_unknown_fields_and_bad_values_reported_at_once(tmp_path, capsys, corpus_overrides):
    err = _fails(capsys, _train(tmp_path, corpus_overrides, "--optim.lrr=1", "--train.steps=abc",
                                "--mecefo.policy=nearest"),
                 "3 configuration error(s)", "unknown field optim.lrr", "valid fields: lr,",
                 "train.steps='abc': expected an integer", "expected one of neighbor, spread, spread-approx")
    assert "lrr" in err
    assert not (tmp_path / "run").exists()


def test_missing_and_empty_data(tmp_path, capsys, corpus_overrides):
    _fails(capsys, ["train", "--out", str(tmp_path / "run"), f"--data.source={tmp_path / 'nowhere'}"],
           str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(capsys, ["train", "--out", str(tmp_path / "run"), f"--data.source={empty}"], str(empty))
    assert not (tmp_path / "run").exists()


def test_token_file_vocabulary_mismatch(tmp_path, capsys):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(5000, dtype=np.uint16) % 600)
    _fails(capsys, ["train", "--out", str(tmp_path / "run"), f"--data.source={tokens}", "--data.vocab_size=512"],
           "599", "512")
    assert not (tmp_path / "run").exists()


def test_sequence_longer_than_model(tmp_path, capsys, corpus_overrides):
    _fails(capsys, _train(tmp_path, corpus_overrides, "--data.seq_len=4096"), "data.seq_len=4096",
           "max_seq_len=256")
    assert not (tmp_path / "run").exists()


def test_worker_count_below_one(tmp_path, capsys, corpus_overrides):
    _fails(capsys, _train(tmp_path, corpus_overrides, "--workers", "0"), "train.workers=0")
    assert not (tmp_path / "run").exists()


def test_cluster_smaller_than_the_job(tmp_path, capsys, corpus_overrides):
    _fails(capsys, _train(tmp_path, corpus_overrides, "--workers", "4", "--faults", "high", "--cluster-workers", "2"),
           "fault.cluster_workers=2: must be >= train.workers=4")
    assert not (tmp_path / "run").exists()
    _fails(capsys, ["simulate", "--out", str(tmp_path / "sim"), *[f"--{o}" for o in corpus_overrides],
                    "--slots", "4", "--trace", "high", "--cluster-workers", "3"], "fault.cluster_workers=3")
    assert not (tmp_path / "sim").exists()


def test_output_directory_holding_another_run(tmp_path, capsys, corpus_overrides):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"train": {"steps": 3}}))
    (run / "keep.txt").write_text("precious")
    _fails(capsys, _train(tmp_path, corpus_overrides), "already holds", "--overwrite", "--resume")
    assert (run / "keep.txt").read_text() == "precious"


def test_port_in_use(tmp_path, capsys, corpus_overrides):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _fails(capsys, _train(tmp_path, corpus_overrides, f"--train.port={port}"), f"127.0.0.1:{port}",
               "in use")
    assert not (tmp_path / "run").exists()


def test_resume_without_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    _fails(capsys, ["train", "--resume", str(run)], "no config.json")
