"""Every node of a job uses one shared run directory: a node with a copy of its own is refused at start."""

from __future__ import annotations

import shutil

import pytest

from unbroken.agent import rendezvous
from unbroken.agent.rendezvous import RUN_DIR_TOKEN_FILE, NodeRegistration, StartRefused
from unbroken.store.job_store import JobStore


def _store() -> JobStore:
    return JobStore.host("127.0.0.1", 0, clients=3, secret="test")


@pytest.fixture()
def store():
    s = _store()
    yield s
    del s


def _node(store: JobStore, node: int) -> NodeRegistration:
    return NodeRegistration(store, node, timeout_s=5.0, workers=[node])


def test_nodes_sharing_the_run_directory_start(store, tmp_path):
    _node(store, 0).check_shared_run_dir(tmp_path)
    token = (tmp_path / RUN_DIR_TOKEN_FILE).read_text()
    assert store.run_dir_token() == token and len(token) == 32
    assert (tmp_path / RUN_DIR_TOKEN_FILE).stat().st_mode & 0o777 == 0o600
    _node(store, 1).check_shared_run_dir(tmp_path)
    _node(store, 0).check_shared_run_dir(tmp_path)  # a replacement node 0 finds the token published: it checks
    assert (tmp_path / RUN_DIR_TOKEN_FILE).read_text() == token


def test_a_copy_of_the_run_directory_is_refused(tmp_path, monkeypatch):
    """A copy made on another machine holds an earlier start's token, or none."""
    monkeypatch.setattr(rendezvous, "RUN_DIR_VISIBLE_S", 0.3)
    shared, copy, empty = tmp_path / "shared", tmp_path / "copy", tmp_path / "empty"
    for d in (shared, empty):
        d.mkdir()
    _node(_store(), 0).check_shared_run_dir(shared)  # an earlier start of the job
    shutil.copytree(shared, copy)
    store = _store()  # this start: node 0 writes a new token
    _node(store, 0).check_shared_run_dir(shared)
    assert (shared / RUN_DIR_TOKEN_FILE).read_text() != (copy / RUN_DIR_TOKEN_FILE).read_text()
    with pytest.raises(StartRefused, match=r"node 1: .*copy is not the run directory node 0 uses "
                                           r"\(run_dir_token holds another token\): every node of a job must use "
                                           r"one shared run directory"):
        _node(store, 1).check_shared_run_dir(copy)
    with pytest.raises(StartRefused, match=r"\(run_dir_token is missing\)"):
        _node(store, 2).check_shared_run_dir(empty)
    _node(store, 1).check_shared_run_dir(shared)
