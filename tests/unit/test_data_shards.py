"""A directory of shards (.npy, raw .bin, Megatron .bin/.idx) as one stream; bad shards refused with file and offset."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from unbroken.data import BatchSampler
from unbroken.data.prepare import prepare_data
from unbroken.data.shards import MEGATRON_MAGIC, ShardedTokens, open_shard_directory

pytestmark = pytest.mark.timeout(60)

_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}


def _megatron(bin_path: Path, sequences: list[np.ndarray]) -> None:
    """Write a Megatron indexed dataset by its published layout (sequences end to end; one document each)."""
    dtype = sequences[0].dtype
    np.concatenate(sequences).astype(dtype.newbyteorder("<")).tofile(bin_path)
    sizes = np.array([len(s) for s in sequences], "<i4")
    ptrs = np.concatenate([[0], np.cumsum(sizes[:-1]) * dtype.itemsize]).astype("<i8")
    docs = np.arange(len(sequences) + 1, dtype="<i8")
    head = (MEGATRON_MAGIC + (1).to_bytes(8, "little") + bytes([_CODES[dtype]])
            + len(sizes).to_bytes(8, "little") + len(docs).to_bytes(8, "little"))
    bin_path.with_suffix(".idx").write_bytes(head + sizes.tobytes() + ptrs.tobytes() + docs.tobytes())


def _corpus(root: Path, vocab: int = 1000) -> np.ndarray:
    """Three shards of three kinds; returns their concatenation in name order."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, vocab, 257).astype(np.uint16)
    b = rng.integers(0, vocab, 130).astype(np.uint16)
    c = [rng.integers(0, vocab, n).astype(np.int32) for n in (40, 91, 7)]
    root.mkdir()
    np.save(root / "a.npy", a)
    b.tofile(root / "b.bin")
    (root / "b.bin.json").write_text(json.dumps({"dtype": "uint16"}))
    _megatron(root / "c.bin", c)
    (root / "vocab.json").write_text(json.dumps({"vocab_size": vocab}))
    return np.concatenate([a, b, *c]).astype(np.int64)


def test_shards_read_as_one_stream_like_a_single_file(tmp_path: Path) -> None:
    want = _corpus(tmp_path / "shards")
    data = prepare_data(source=str(tmp_path / "shards"), val_fraction=0.1, cache_dir=tmp_path / "cache")
    assert data.vocab_size == 1000 and len(data.train) + len(data.val) == len(want)
    cut = len(want) - int(len(want) * 0.1)
    assert np.array_equal(data.val[np.arange(len(data.val))], want[cut:])
    # Windows of 16 cross both shard boundaries (257 and 387): rows equal those of the concatenated file.
    flat = BatchSampler(want[:cut], seed=5, n_slots=2, micro_batch=3, seq_len=16)
    sharded = BatchSampler(data.train, seed=5, n_slots=2, micro_batch=3, seq_len=16)
    for step in range(6):
        for slot in range(2):
            assert all(torch.equal(u, v) for u, v in zip(flat.batch(step, slot), sharded.batch(step, slot)))


def test_sliced_stream_keeps_offsets() -> None:
    s = ShardedTokens([np.arange(0, 5), np.arange(5, 9), np.arange(9, 20)])
    part = s[3:12]
    assert isinstance(part, ShardedTokens) and len(part) == 9
    assert part[np.arange(9)].tolist() == list(range(3, 12)) and s.max() == 19


def test_truncated_megatron_bin_names_the_sequence_and_offset(tmp_path: Path) -> None:
    _corpus(tmp_path / "s")
    data = (tmp_path / "s" / "c.bin").read_bytes()
    (tmp_path / "s" / "c.bin").write_bytes(data[:-4])  # the last sequence (7 int32 tokens at byte 524) loses one
    with pytest.raises(ValueError, match=r"c\.idx: sequence 2 at byte offset 524 .* ends at byte 552, past the end "
                                         r"of .*c\.bin \(548 bytes\)"):
        open_shard_directory(tmp_path / "s", dtype=None, vocab_size=None)


def test_truncated_raw_bin_and_bad_index(tmp_path: Path) -> None:
    _corpus(tmp_path / "s")
    with (tmp_path / "s" / "b.bin").open("ab") as f:
        f.write(b"\x01")
    with pytest.raises(ValueError, match=r"b\.bin: size 261 bytes is not a multiple of 2"):
        open_shard_directory(tmp_path / "s", dtype=None, vocab_size=None)
    (tmp_path / "s" / "b.bin").unlink()
    (tmp_path / "s" / "c.idx").write_bytes(b"NOTMEGATRON" + bytes(40))
    with pytest.raises(ValueError, match=r"c\.idx: not a Megatron index"):
        open_shard_directory(tmp_path / "s", dtype=None, vocab_size=None)


def test_declared_dtype_contradicted_by_a_shard(tmp_path: Path) -> None:
    _corpus(tmp_path / "s")
    (tmp_path / "s" / "b.bin.json").unlink()
    with pytest.raises(ValueError, match=r"a\.npy: stores uint16 tokens but token_dtype='uint32' was declared"):
        open_shard_directory(tmp_path / "s", dtype="uint32", vocab_size=None)
    (tmp_path / "s" / "a.npy").unlink()
    (tmp_path / "s" / "b.bin").unlink()
    with pytest.raises(ValueError, match=r"c\.idx: stores int32 tokens but token_dtype='uint16' was declared"):
        open_shard_directory(tmp_path / "s", dtype="uint16", vocab_size=None)


def test_token_beyond_the_vocabulary_names_file_and_offset(tmp_path: Path) -> None:
    _corpus(tmp_path / "s")
    tokens = np.load(tmp_path / "s" / "a.npy")
    tokens[100] = 1000
    np.save(tmp_path / "s" / "a.npy", tokens)
    with pytest.raises(ValueError, match=r"a\.npy: max token 1000 is >= vocab_size 1000 \(token offset 100, "
                                         r"byte 328\)"):  # after the 128-byte .npy header
        open_shard_directory(tmp_path / "s", dtype=None, vocab_size=None)


def test_truncated_npy_and_another_dtype_name_the_file_and_offset(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    root.mkdir()
    np.save(root / "a.npy", np.arange(1000, dtype=np.uint16))
    size = (root / "a.npy").stat().st_size
    os.truncate(root / "a.npy", size - 501)  # 250.5 tokens short: the file ends inside token 749
    with pytest.raises(ValueError, match=rf"a.npy: truncated: its header announces 1000 uint16 tokens \(2000 bytes "
                                         rf"from byte offset 128\), the file ends at byte {size - 501} \(token offset "
                                         r"749\); write the shard again"):
        open_shard_directory(root, dtype=None, vocab_size=2000)
    np.save(root / "a.npy", np.arange(1000, dtype=np.int64))
    with pytest.raises(ValueError, match=r"a.npy: token dtype 'int64' not supported; accepted: uint16, uint32 \(store "
                                         r"the ids as uint16 for a vocabulary of up to 65536, else uint32\)"):
        open_shard_directory(root, dtype=None, vocab_size=2000)


def test_a_directory_prepare_data_has_not_finished_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    root.mkdir()
    np.save(root / "part-00000.npy", np.arange(10, dtype=np.uint16))
    (root / "prepare.json").write_text(json.dumps({"done": False, "shards": 1, "documents": 3}))
    with pytest.raises(ValueError, match=r"has not finished it \(1 shards written, 3 documents read\); run the same "
                                         "prepare-data command again"):
        prepare_data(source=str(root), vocab_size=100, cache_dir=tmp_path / "cache")


def test_stated_vocab_size_reads_no_tokens(tmp_path: Path) -> None:
    from unbroken.data.prepare import stated_vocab_size

    _corpus(tmp_path / "shards", vocab=1000)
    np.save(tmp_path / "one.npy", np.arange(10, dtype=np.uint16))
    (tmp_path / "one.npy.json").write_text(json.dumps({"vocab_size": 1200}))
    assert stated_vocab_size(source=str(tmp_path / "shards"), vocab_size=4096, tokenizer=None) == 1000
    assert stated_vocab_size(source=str(tmp_path / "one.npy"), vocab_size=4096, tokenizer=None) == 1200
    blend = json.dumps({str(tmp_path / "shards"): 1, str(tmp_path / "one.npy"): 2})
    assert stated_vocab_size(source=blend, vocab_size=4096, tokenizer=None) == 1200
    assert stated_vocab_size(source="stdlib", vocab_size=4096, tokenizer=None) == 4096
