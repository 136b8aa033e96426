"""The checkpoint writer: safetensors files by several threads, each hashed as it is written."""

from __future__ import annotations

import hashlib
import json
import struct
import warnings

import pytest
import torch
from safetensors import safe_open

from unbroken.checkpoint.dcp import dcp
from unbroken.checkpoint import writer as checkpoint_writer
from unbroken.checkpoint.files import seal_files
from unbroken.checkpoint.writer import (
    INDEX_FILE,
    HostStage,
    file_groups,
    safetensors_header,
    write_state,
)
from unbroken.runtime.digest import device_digest

MiB = 1 << 20


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(300, 257, generator=g),  # 308,400 bytes: odd sizes, no alignment
        "model.b": torch.randn(7, generator=g).bfloat16(),
        "optim.w.step": torch.tensor(12.0),
        "optim.w.mask": torch.tensor([True, False, True]),
        "rng.cpu": torch.get_rng_state(),
        "group.0.empty": torch.zeros(0),
        "optim.w.exp_avg": torch.randn(300, 257, generator=g)[:, ::2],  # not contiguous
    }


def test_files_read_back_bit_for_bit_by_safetensors_and_dcp_and_their_digests_are_their_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_writer, "MIN_FILE_BYTES", 1024)  # three files of a small state
    state = _state()
    written = write_state(tmp_path, state, threads=3, chunk=4096)
    assert written.threads == 3
    names = sorted(f.name for f in tmp_path.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert names == sorted([*shards, INDEX_FILE]) and shards == [f"model-0000{i}-of-0000{len(shards)}.safetensors"
                                                                  for i in range(1, len(shards) + 1)]
    assert written.files == {n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in names}
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    read = {}
    for name in shards:
        with safe_open(str(tmp_path / name), framework="pt") as f:
            read.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(read) == set(state) and all(torch.equal(read[k], state[k]) for k in state)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp().load(target, storage_reader=dcp().HuggingFaceStorageReader(str(tmp_path), thread_count=2), no_dist=True)
    assert all(torch.equal(target[k], state[k]) for k in state)


def test_the_header_is_length_prefixed_json_whose_data_starts_8_byte_aligned():
    entries = [("a", torch.zeros(3, dtype=torch.float32)), ("bb", torch.zeros(2, 2, dtype=torch.int64))]
    raw = safetensors_header(entries)
    (n,) = struct.unpack("<Q", raw[:8])
    assert len(raw) == 8 + n and len(raw) % 8 == 0
    header = json.loads(raw[8:])
    assert header == {"__metadata__": {"format": "pt"},
                      "a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
                      "bb": {"dtype": "I64", "shape": [2, 2], "data_offsets": [12, 44]}}


def test_files_split_the_state_in_order_by_the_middle_byte_of_each_tensor():
    assert file_groups([64 * MiB] * 4, 2) == [[0, 1], [2, 3]]
    assert file_groups([64 * MiB] * 8, 3) == [[0, 1, 2], [3, 4], [5, 6, 7]]
    assert file_groups([256 * MiB, 1, 256 * MiB, 1], 3) == [[0], [1], [2, 3]]
    assert file_groups([10, 10, 10, 10], 4) == [[0, 1, 2, 3]], "a small state is one file"
    assert file_groups([100 * MiB, 100 * MiB], 8) == [[0], [1]], "never more files than 64 MiB pieces"
    assert file_groups([], 3) == [[]]


def test_a_value_safetensors_cannot_hold_is_refused_by_name_before_any_byte(tmp_path):
    with pytest.raises(TypeError, match="'optim.c' has dtype torch.complex64"):
        write_state(tmp_path, {"model.w": torch.zeros(2), "optim.c": torch.zeros(2, dtype=torch.complex64)})
    assert list(tmp_path.iterdir()) == []


def test_a_staged_copy_keeps_its_buffers_and_is_not_the_live_state():
    live = {"a": torch.arange(6.0), "b": torch.ones(2, 2)}
    stage = HostStage()
    first = stage.copy(live)
    live["a"].add_(100)
    assert torch.equal(first["a"], torch.arange(6.0)), "a later step does not reach the staged copy"
    second = stage.copy(live)
    assert second["a"].data_ptr() == first["a"].data_ptr() and torch.equal(second["a"], live["a"])
    assert stage.bytes == 6 * 4 + 4 * 4
    third = stage.copy({"a": torch.zeros(3)})  # another shape: a new buffer; a name no longer saved: dropped
    assert third["a"].shape == (3,) and stage.bytes == 3 * 4


def test_sealing_reads_only_the_files_no_writer_hashed_and_names_one_that_vanished(tmp_path):
    written = write_state(tmp_path, {"a": torch.arange(10.0)})
    (tmp_path / "part.json").write_text("{}")
    forged = {name: "0" * 64 for name in written.files}  # a known digest is taken as given: never re-read
    sealed = seal_files(tmp_path, forged)
    assert sealed == {**forged, "part.json": hashlib.sha256(b"{}").hexdigest()}
    (tmp_path / INDEX_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=INDEX_FILE):
        seal_files(tmp_path, written.files)


def test_the_device_digest_tells_equal_parameters_from_any_changed_word():
    a = [torch.randn(1000), torch.randn(3, 5).bfloat16(), torch.arange(7, dtype=torch.uint8)]
    assert device_digest(a) == device_digest([t.clone() for t in a]) == device_digest(a, chunk=64)
    assert device_digest(a).startswith("device:")
    for i, at in [(0, 500), (1, 7), (2, 6)]:
        b = [t.clone() for t in a]
        b[i].view(-1)[at] += 1
        assert device_digest(b) != device_digest(a), (i, at)
    swapped = [t.clone() for t in a]
    swapped[0][[1, 2]] = swapped[0][[2, 1]]
    assert device_digest(swapped) != device_digest(a), "positions count, not only the values"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_state_goes_through_pinned_blocks_bit_for_bit_and_its_digest_is_the_hosts(tmp_path):
    state = {k: v.cuda() for k, v in _state().items() if k != "rng.cpu"} | {"rng.cpu": torch.get_rng_state()}
    written = write_state(tmp_path, state, threads=2, chunk=4096)  # many blocks per tensor: the pipeline turns
    read = {}
    for name in written.files:
        if name.endswith(".safetensors"):
            with safe_open(str(tmp_path / name), framework="pt") as f:
                read.update({k: f.get_tensor(k) for k in f.keys()})
    assert all(torch.equal(read[k], v.cpu()) for k, v in state.items())
    staged = HostStage().copy(state)
    assert all(t.is_pinned() == (state[k].device.type == "cuda") for k, t in staged.items())
    assert all(torch.equal(staged[k], v.cpu()) for k, v in state.items())
    params = [v for v in state.values() if v.device.type == "cuda"]
    assert device_digest(params) == device_digest([p.cpu() for p in params])
