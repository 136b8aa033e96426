"""Bad input to the CLI: one line ``unbroken CMD: error: ...`` naming the flag or field, the value given and
what is accepted, exit code 2, no traceback, nothing written.

Config, data, run directories (``--out``, ``--resume``), ports (``--train.port``) and stores
(``unbroken agent --store``: malformed, unreachable, wrong or missing secret).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest

from unbroken.cli import main
from unbroken.config import load_config
from unbroken.store.job_store import JobStore
from unbroken.store.backend import SECRET_ENV

pytestmark = pytest.mark.timeout(120)


def _train(tmp_path, corpus_overrides, *args: str) -> list[str]:
    return ["train", "--out", str(tmp_path / "run"), *[f"--{o}" for o in corpus_overrides], *args]


def _fails(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"unbroken {argv[0]}: error: " in err and "Traceback" not in err, err
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
               "in use", "--train.port=N or 0 for a free one")
    assert not (tmp_path / "run").exists()


def test_port_out_of_range(tmp_path, capsys, corpus_overrides):
    _fails(capsys, _train(tmp_path, corpus_overrides, "--train.port=70000"), "train.port=70000",
           "must be in 0..65535", "0 picks a free port")
    assert not (tmp_path / "run").exists()


def test_resume_of_a_directory_holding_no_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    _fails(capsys, ["train", "--resume", str(run)], f"--resume {run}: holds no unbroken run", "no config.json",
           "give the directory of a run made by unbroken train")
    (run / "config.json").write_text("[1, 2]")  # JSON, but no run's config
    _fails(capsys, ["train", "--resume", str(run)], f"--resume {run}: holds no unbroken run")
    _fails(capsys, ["train", "--resume", str(tmp_path / "nowhere")], f"--resume {tmp_path / 'nowhere'}: no such "
           "directory", "give the directory of a run")


def test_resume_of_a_run_without_checkpoint_or_snapshot_memory(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(load_config(preset_name="debug").to_dict()))
    _fails(capsys, ["train", "--resume", str(run)], f"--resume {run}: nothing to continue from",
           f"no committed checkpoint under {run / 'checkpoints'}", "train.checkpoint_every=0",
           "no complete snapshot of its job in shared memory", f"--out {run} --overwrite")
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]


def test_resume_with_options_of_a_new_run(tmp_path, capsys):
    """(--workers is accepted now: a resume may change the worker count and keeps the global batch.)"""
    run = tmp_path / "run"
    _fails(capsys, ["train", "--resume", str(run), "--preset", "tiny", "--out", str(tmp_path / "x"),
                    "--optim.lr=1e-3"],
           f"--resume {run} continues the run with its saved config", "--preset tiny", f"--out {tmp_path / 'x'}",
           "--optim.lr=1e-3", "drop them", "--fail-at, --workers, --nodes")
    assert not (tmp_path / "x").exists()


def test_out_is_a_file(tmp_path, capsys, corpus_overrides):
    (tmp_path / "run").write_text("not a directory")
    _fails(capsys, _train(tmp_path, corpus_overrides), f"--out {tmp_path / 'run'}: is a file, not a directory",
           "give a directory")
    _fails(capsys, ["train", "--out", str(tmp_path / "run" / "sub")],
           f"--out {tmp_path / 'run' / 'sub'}: {tmp_path / 'run'} is a file", "give another path")
    assert (tmp_path / "run").read_text() == "not a directory"


def test_out_not_writable(tmp_path, capsys, corpus_overrides):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    out = locked / "run"
    if os.access(locked, os.W_OK):  # root ignores permissions: take a place nobody can write instead
        out = Path("/sys/unbroken-test-run")
        if not Path("/sys").is_dir() or out.exists():
            pytest.skip("no unwritable directory to try")
    _fails(capsys, ["train", "--out", str(out), *[f"--{o}" for o in corpus_overrides]], f"--out {out}: cannot "
           "write there", "give a directory you can write")
    assert not out.exists()


# -- unbroken agent --store ----------------------------------------------------------


def _agent(tmp_path, store: str, *extra: str) -> list[str]:
    return ["agent", "--node-rank", "0", "--nnodes", "1", "--workers-per-node", "1", "--store", store,
            "--run-dir", str(tmp_path), "--timeout-s", "1", *extra]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_agent_store_malformed(tmp_path, capsys):
    _fails(capsys, _agent(tmp_path, "localhost"), "--store 'localhost'", "expected HOST:PORT",
           "e.g. --store 10.0.0.1:29500")
    _fails(capsys, _agent(tmp_path, "localhost:99999"), "--store 'localhost:99999'", "PORT in 1..65535")


def test_agent_rank_or_spare(tmp_path, capsys):
    rest = ["--nnodes", "2", "--workers-per-node", "1", "--store", "127.0.0.1:1", "--run-dir", str(tmp_path)]
    _fails(capsys, ["agent", *rest], "--node-rank is required (or --spare)")
    _fails(capsys, ["agent", "--spare", "--node-rank", "1", *rest], "--spare takes no --node-rank")
    _fails(capsys, ["train", "--spare-nodes", "-1", "--out", str(tmp_path / "run")], "--spare-nodes -1: expected >= 0")


def test_agent_store_unreachable(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "some job")
    addr = f"127.0.0.1:{_free_port()}"
    _fails(capsys, _agent(tmp_path, addr), f"--store {addr}: store {addr} did not answer within 1 s",
           "is the launcher running and the address right?")


def test_etcd_store_malformed_or_unreachable(tmp_path, capsys, monkeypatch):
    _fails(capsys, _agent(tmp_path, "etcd://h1:2379,h2"), "--store: store address 'etcd://h1:2379,h2'",
           "expected etcd[s]://HOST:PORT[,HOST:PORT...][/PREFIX]")
    _fails(capsys, ["train", "--store", "10.0.0.1:2379", "--out", str(tmp_path / "run")],
           "--store '10.0.0.1:2379': expected etcd://HOST:PORT", "leave it out for the store embedded")
    monkeypatch.setenv(SECRET_ENV, "some job")
    addr = f"etcd://127.0.0.1:{_free_port()}"
    _fails(capsys, _agent(tmp_path, addr), f"--store {addr}: store {addr}: no etcd member answered within 1 s",
           "is etcd running there, with quorum, and the address right?")
    _fails(capsys, _agent(tmp_path, addr.replace("etcd://", "etcds://")),  # TLS without its files
           "TLS needs the CA, this client's certificate and its key as PEM files: UNBROKEN_ETCD_CA is not set")
    for argv in (_agent(tmp_path, "etcd://10.1.2.3:2379"),  # in the clear to another host
                 ["train", "--store", "etcd://127.0.0.1:2379,10.1.2.3:2379", "--out", str(tmp_path / "run")]):
        _fails(capsys, argv, "plain etcd:// to 10.1.2.3:2379", "use etcds://", "or pass --store-insecure")


def test_agent_store_wrong_secret(tmp_path, capsys, monkeypatch):
    store = JobStore.host("127.0.0.1", 0, clients=2, secret="the job's secret")
    monkeypatch.setenv(SECRET_ENV, "another secret")
    addr = f"127.0.0.1:{store.port}"
    _fails(capsys, _agent(tmp_path, addr), f"--store {addr}: store {addr} holds no job under this secret",
           f"use the run's secret file or {SECRET_ENV}", f"the secret tried is the one in ${SECRET_ENV}")


def test_agent_without_secret(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    _fails(capsys, _agent(tmp_path, f"127.0.0.1:{_free_port()}"), f"--run-dir {tmp_path}: no job secret",
           f"set {SECRET_ENV} or copy the run's secret file into {tmp_path}")


def test_hsdp_layouts_it_cannot_run_are_refused_naming_the_fix(tmp_path, capsys, corpus_overrides):
    """A replica spanning nodes, a shard degree that does not divide the workers, a warm standby under HSDP,
    a recipe without HSDP: one line each, nothing written."""
    _fails(capsys, _train(tmp_path, corpus_overrides, "--workers", "4", "--nodes", "2", "--train.shard_degree=4"),
           "train.shard_degree=4 does not divide the 2 workers per node", "replicas spanning nodes are not supported")
    _fails(capsys, _train(tmp_path, corpus_overrides, "--workers", "4", "--train.shard_degree=3"),
           "train.shard_degree=3 does not divide train.workers=4")
    _fails(capsys, _train(tmp_path, corpus_overrides, "--workers", "4", "--train.shard_degree=2", "--standby"),
           "a warm standby with train.shard_degree=2", "drop --standby")
    _fails(capsys, _train(tmp_path, corpus_overrides, "--workers", "4", "--model.parallelize=mod:fn"),
           "model.parallelize='mod:fn' needs train.shard_degree > 1")
    assert not (tmp_path / "run").exists()
