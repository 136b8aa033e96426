"""A Hugging Face dataset saved with save_to_disk as data.source: a token-list column read in place, a text
column tokenized with data.tokenizer and packed; bad columns and token ids refused naming the row and offset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from unbroken.data import BatchSampler
from unbroken.data.prepare import prepare_data
from unbroken.data.pretrained import PretrainedTokenizer
from unbroken.data.shard_writer import write_shards
from unbroken.data.text_inputs import open_text_input

from tests.unit.test_data_shard_writer import WORDS, stream_of, word_tokenizer

datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.timeout(120)

ROWS = [[1, 2, 3, 4, 1, 5, 0], [6, 7, 8, 0], [1, 7, 3, 0], [6, 2, 8, 4, 6, 5, 0]] * 5
TEXTS = ["the cat sat on the mat", "a dog ran", "the dog sat", "a cat ran on a mat"] * 5


def _save(tmp_path: Path, name: str = "ds", **columns: list) -> Path:
    path = tmp_path / name
    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    return path


def test_token_column_is_one_stream_read_in_index_order(tmp_path: Path) -> None:
    path = _save(tmp_path, input_ids=ROWS, text=TEXTS)
    want = np.concatenate(ROWS)
    data = prepare_data(source=str(path), vocab_size=len(WORDS), val_fraction=0.1, cache_dir=tmp_path / "cache")
    cut = len(want) - int(len(want) * 0.1)
    assert data.vocab_size == len(WORDS) and data.source == f"{path.resolve()}#input_ids"
    assert data.train[np.arange(len(data.train))].tolist() == want[:cut].tolist()
    assert data.val[np.arange(len(data.val))].tolist() == want[cut:].tolist()
    flat = BatchSampler(want[:cut].astype(np.int64), seed=3, n_slots=2, micro_batch=2, seq_len=5)
    sampler = BatchSampler(data.train, seed=3, n_slots=2, micro_batch=2, seq_len=5)
    for step in range(8):  # windows cross row and record-batch boundaries, and epochs
        for slot in range(2):
            assert all(torch.equal(u, v) for u, v in zip(flat.batch(step, slot), sampler.batch(step, slot)))
    again = prepare_data(source=f"{path}#input_ids", vocab_size=len(WORDS), val_fraction=0.1,
                         cache_dir=tmp_path / "cache")
    assert again.fingerprint == data.fingerprint


def test_text_column_is_tokenized_with_the_jobs_tokenizer_and_packed(tmp_path: Path) -> None:
    path = _save(tmp_path, body=TEXTS, n=list(range(len(TEXTS))))
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json")
    data = prepare_data(source=f"{path}#body", val_fraction=0.0, tokenizer=str(tokenizer),
                        cache_dir=tmp_path / "cache")
    assert data.vocab_size == len(WORDS) and data.tokenizer_path == str(tokenizer)
    assert data.train[np.arange(len(data.train))].tolist() == stream_of(TEXTS)
    assert [p.name for p in (tmp_path / "cache").glob("hf-*")]  # tokenized once, into the cache
    again = prepare_data(source=f"{path}#body", val_fraction=0.0, tokenizer=str(tokenizer),
                         cache_dir=tmp_path / "cache")
    assert again.fingerprint == data.fingerprint
    with pytest.raises(ValueError, match=r"column 'body' holds text; name the tokenizer to encode it with "
                                         r"\(data.tokenizer="):
        prepare_data(source=f"{path}#body", cache_dir=tmp_path / "cache")


def test_prepare_data_reads_a_datasets_text_column(tmp_path: Path) -> None:
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS}),
                               "validation": datasets.Dataset.from_dict({"text": TEXTS[:1]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    tok = PretrainedTokenizer(word_tokenizer(tmp_path / "tokenizer.json"))
    docs = open_text_input(str(tmp_path / "dd"), split="validation")
    assert docs.total == 1 and list(docs.documents(0)) == TEXTS[:1]
    write_shards(open_text_input(str(tmp_path / "dd")), tok, tmp_path / "out", shard_tokens=8)
    out = sorted((tmp_path / "out").glob("part-*.npy"))
    assert np.concatenate([np.load(p) for p in out]).tolist() == stream_of(TEXTS)
    with pytest.raises(ValueError, match=r"a DatasetDict without a 'test' split \(splits: train, validation\)"):
        open_text_input(str(tmp_path / "dd"), split="test")


def test_bad_dataset_columns_are_refused_with_the_fix(tmp_path: Path) -> None:
    rows = [list(r) for r in ROWS]
    rows[6][2] = 4096  # row 6, the column's token offset 25 + 5 + 4 + ... : computed below
    path = _save(tmp_path, input_ids=rows)
    offset = sum(len(r) for r in rows[:6]) + 2
    with pytest.raises(ValueError, match=rf"column 'input_ids' holds token 4096 at row 6 \(token offset {offset} of "
                                         r"the column\), outside \[0, vocab_size=9\); give the tokenizer"):
        prepare_data(source=str(path), vocab_size=len(WORDS), cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"no column 'ids' \(columns: input_ids\); name the token-list or text "
                                         r"column as data.source="):
        prepare_data(source=f"{path}#ids", vocab_size=len(WORDS), cache_dir=tmp_path / "cache")
    floats = _save(tmp_path, "floats", input_ids=[[0.5, 1.0]] * 4)
    with pytest.raises(ValueError, match=r"column 'input_ids' holds list<item: double>, not lists of integer"):
        prepare_data(source=str(floats), vocab_size=len(WORDS), cache_dir=tmp_path / "cache")
