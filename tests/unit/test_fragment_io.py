"""Snapshot memory at memory speed (:mod:`unbroken.snapshot.fragment_io`, :mod:`unbroken.snapshot.overwrite_pages`):
several threads, pieces that cut across tensors and fragments, checksums checked piece by piece, and pages shared
with a template never copied before they are overwritten. Real shared memory, a real fork."""

from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from unbroken.store.view import View
from unbroken.snapshot import fragment_io
from unbroken.snapshot.overwrite_pages import ready_to_overwrite
from unbroken.snapshot.fragment_io import FragmentRead, load_fragments
from unbroken.snapshot.restore import alone, decide, inventory, restore_from_memory
from unbroken.snapshot.segment import HEADER_BYTES, SealedBuffer, SnapshotCorrupt, job_segments
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of
from _snapshot_state import trained_state

pytestmark = pytest.mark.timeout(120)

NODE_OF = {0: 0, 1: 1}
"""Two nodes of one worker each, parity 1: k = 1, so node 0 holds the stripe's data fragment and node 1 its parity
fragment, which past its header is the data itself: both load straight from their own memory."""
ODD_PIECE = 40_009
"""Bytes per piece in these tests: a prime, so pieces start inside tensors, fragments and pages."""


def _snapshot(job_id: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    for w in NODE_OF:
        snap = Snapshotter(job_id=job_id, node=NODE_OF[w], worker=w, node_of=NODE_OF, every=1, redundancy="parity",
                           parity=1, config_hash="cfg", state=lambda: tensors_of(model, optimizer),
                           on_event=lambda name, **f: None)
        snap.take(1, View(gen=1, members=tuple(NODE_OF), step=1))
        snap.close()
    invs = [inventory(job_id, n, config_hash="cfg", threads=2) for n in sorted(set(NODE_OF.values()))]
    assert not any(inv["problems"] for inv in invs)
    return decide(invs, checkpoint=None, members_of=lambda nodes: list(NODE_OF))


def _restore(job_id: str, spec: dict, seed: int, node: int = 0) -> tuple[tuple[torch.nn.Module, torch.optim.Optimizer],
                                                                        dict]:
    model, optimizer = trained_state(seed)  # another state: every byte must be overwritten
    stats = restore_from_memory(spec, job=job_id, node=node, node_of=NODE_OF, members=(node,), me=node,
                                broadcast=alone, model=model, optimizer=optimizer, device=torch.device("cpu"))
    return (model, optimizer), stats


def _flip(path, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("node, rebuilt", [(0, 0), (1, 1)])  # node 1 holds the parity: read as it is, not decoded
def test_a_threaded_load_in_odd_pieces_is_exact(job_id, monkeypatch, node: int, rebuilt: int):
    monkeypatch.setattr(fragment_io, "PIECE_BYTES", ODD_PIECE)
    import unbroken.snapshot.restore as restore

    monkeypatch.setattr(restore, "io_threads", lambda sharing=1: 3)
    model, optimizer = trained_state(seed=1)
    spec = _snapshot(job_id, model, optimizer)
    calls: list[int] = []
    real = restore.load_fragments
    monkeypatch.setattr(restore, "load_fragments", lambda reads, *a, **k: calls.append(len(reads)) or real(reads, *a, **k))
    (got_model, got_opt), stats = _restore(job_id, spec, seed=7, node=node)
    want, got = tensors_of(model, optimizer), tensors_of(got_model, got_opt)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    state_bytes = sum(t.numel() * t.element_size() for t in want.values())
    assert calls == [1] and stats["local"] == 1 and stats["rebuilt"] == rebuilt and stats["received"] == 0
    assert stats["bytes"] == state_bytes and stats["threads"] == 3 and stats["gb_s"] > 0


def test_pieces_cut_across_tensors_a_header_and_padding_land_exactly(tmp_path: Path, monkeypatch):
    """Two fragments in one file, each ``[header][state bytes][zero padding]``, loaded into three tensors."""
    monkeypatch.setattr(fragment_io, "PIECE_BYTES", 1_013)
    want = [torch.randn(700), torch.arange(333, dtype=torch.int64), torch.randn(50, dtype=torch.float64)]
    flat = b"".join(t.numpy().tobytes() for t in want)
    half = len(flat) // 2 + 5
    frags = [b"H" * 80 + flat[:half] + bytes(9), b"H" * 80 + flat[half:] + bytes(9)]
    payload = frags[0] + frags[1]
    path = tmp_path / "segment"
    path.write_bytes(bytes(HEADER_BYTES) + payload)
    reads = [FragmentRead(path=path, offset=0, length=len(frags[0]), crc=zlib.crc32(frags[0]), start=0,
                          useful=half, skip=80),
             FragmentRead(path=path, offset=len(frags[0]), length=len(frags[1]), crc=zlib.crc32(frags[1]),
                          start=half, useful=len(flat) - half, skip=80)]
    got = [torch.zeros_like(t) for t in want]
    targets, at = [], 0
    for t in got:
        targets.append((at, t.numel() * t.element_size(), t.view(-1).view(torch.uint8)))
        at += targets[-1][1]
    assert load_fragments(reads, targets, threads=3) == len(flat)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    bad = [reads[0], FragmentRead(**{**reads[1].__dict__, "crc": reads[1].crc ^ 1})]
    with pytest.raises(SnapshotCorrupt, match=rf"segment: bytes \[{len(frags[0])}, {len(payload)}\) do not match"):
        load_fragments(bad, targets, threads=2)


def test_bytes_that_changed_after_the_decision_fail_the_load_and_name_the_segment(job_id, monkeypatch):
    monkeypatch.setattr(fragment_io, "PIECE_BYTES", ODD_PIECE)
    model, optimizer = trained_state(seed=1)
    spec = _snapshot(job_id, model, optimizer)
    victim = next(p for p in job_segments(job_id, node=0))
    seal = SealedBuffer.open(victim, job_id).seal
    _, _, offset, length, _ = seal["fragments"][-1]
    _flip(victim, HEADER_BYTES + offset + length // 2)  # inside a piece, mid-fragment
    with pytest.raises(SnapshotCorrupt, match=rf"{victim.name}: bytes \[{offset}, {offset + length}\) do not match"):
        _restore(job_id, spec, seed=7)
    assert any("do not match their checksum" in p for p in inventory(job_id, 0, config_hash="cfg")["problems"])


def test_a_segment_removed_after_the_decision_fails_the_load_by_name(job_id):
    model, optimizer = trained_state(seed=1)
    spec = _snapshot(job_id, model, optimizer)
    for path in job_segments(job_id, node=0):
        path.unlink()
    with pytest.raises(SnapshotCorrupt, match="no longer holds|removed"):
        _restore(job_id, spec, seed=7)


def test_threaded_verification_finds_one_flipped_byte_in_any_piece(job_id, monkeypatch):
    monkeypatch.setattr(fragment_io, "PIECE_BYTES", ODD_PIECE)
    model, optimizer = trained_state(seed=1)
    _snapshot(job_id, model, optimizer)
    path = job_segments(job_id, node=1)[0]
    buf = SealedBuffer.open(path, job_id)
    fragment_io.verify_sealed(buf, threads=4)  # intact
    offset, length, _ = max(buf.ranges()[1:], key=lambda r: r[1])
    _flip(path, HEADER_BYTES + offset + 3 * ODD_PIECE + 17)  # in the fourth piece of the largest fragment
    with pytest.raises(SnapshotCorrupt, match=rf"bytes \[{offset}, {offset + length}\) do not match"):
        fragment_io.verify_sealed(buf, threads=4)
    with pytest.raises(SnapshotCorrupt, match="do not match"):
        fragment_io.verify_sealed(buf, threads=1)


def _pagemap_exclusive(address: int) -> bool:
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(address // mmap.PAGESIZE * 8)
        return bool(int.from_bytes(fh.read(8), "little") >> 56 & 1)


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="reads /proc/self/pagemap")
def test_pages_shared_with_a_parent_are_dropped_not_copied_and_the_edges_kept():
    page = mmap.PAGESIZE
    data = np.full(8 * page, 7, dtype=np.uint8)
    base = data.ctypes.data
    lo = -(-base // page) * page - base + 100  # 100 bytes into the first whole page of the array
    n = 3 * page  # covers two whole pages, parts of two more
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker forked from a template: the array is the parent's pages, copy-on-write
        code = 1
        try:
            ready_to_overwrite(base + lo, n)
            whole = slice(lo - 100 + page, lo - 100 + 3 * page)  # the whole pages inside [lo, lo + n)
            checks = [
                bool((data[:lo] == 7).all() and (data[lo + n:] == 7).all()),  # edges and neighbours kept
                bool((data[whole] == 0).all()),  # shared whole pages dropped: zeros until written, nothing copied
                _pagemap_exclusive(base + whole.start),  # mapped for this process alone, ready to write
            ]
            data[lo:lo + n] = 9
            checks.append(bool((data[lo:lo + n] == 9).all()))
            os.write(w, bytes(int(c) for c in checks))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    got = os.read(r, 16)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and list(got) == [1, 1, 1, 1], list(got)
    assert (data == 7).all()  # the parent's own pages are untouched


def test_memory_of_this_process_is_kept_as_it_is():
    page = mmap.PAGESIZE
    data = np.arange(6 * page, dtype=np.int64).view(np.uint8)  # touched: this process's own pages
    before = data.copy()
    ready_to_overwrite(data.ctypes.data, data.nbytes)  # its pages are its own: mapped, nothing dropped
    assert np.array_equal(data, before)


def test_a_trusted_inventory_decides_from_authenticated_seals_and_the_load_finds_the_bad_byte(job_id, monkeypatch):
    from unbroken.snapshot.segment import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "the job's secret")  # every agent and worker of a job has it
    model, optimizer = trained_state(seed=1)
    spec = _snapshot(job_id, model, optimizer)
    victim = job_segments(job_id, node=0)[0]
    _, _, offset, length, _ = SealedBuffer.open(victim, job_id).seal["fragments"][0]
    _flip(victim, HEADER_BYTES + offset + 5)
    trusted = inventory(job_id, 0, config_hash="cfg", verify=False)
    assert [s["segment"] for s in trusted["seals"]] == [victim.name] and trusted["bytes"] == 0
    assert decide([trusted, inventory(job_id, 1, config_hash="cfg", verify=False)], checkpoint=None,
                  members_of=lambda nodes: list(NODE_OF)) == spec
    with pytest.raises(SnapshotCorrupt, match=rf"{victim.name}: bytes \[{offset}, {offset + length}\) do not match"):
        _restore(job_id, spec, seed=7)  # the load checks what the decision trusted
    checked = inventory(job_id, 0, config_hash="cfg", verify=True)  # the next attempt checks every byte
    assert checked["seals"] == [] and any(victim.name in p and "do not match" in p for p in checked["problems"])
    monkeypatch.delenv(SECRET_ENV)  # a reader without the secret cannot trust a seal: it checks every byte
    assert inventory(job_id, 0, config_hash="cfg", verify=False)["seals"] == []
