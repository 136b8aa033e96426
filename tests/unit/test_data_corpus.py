"""Corpus sources, the name-hash split, fingerprints, pre-tokenized files, bad input."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from unbroken.data.corpus import (
    is_validation,
    open_stdlib_corpus,
    open_text_corpus,
    open_token_file,
)
from unbroken.data.prepare import prepare_data

pytestmark = pytest.mark.timeout(120)


def _write_docs(root: Path, docs: dict[str, str]) -> Path:
    for name, text in docs.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


# --- split ------------------------------------------------------------------

def test_split_is_a_function_of_the_name_only() -> None:
    names = [f"dir{i % 7}/doc{i}.txt" for i in range(500)]
    shuffled = names[:]
    random.Random(0).shuffle(shuffled)
    val_a = {n for n in names if is_validation(n, 0.2)}
    val_b = {n for n in shuffled if is_validation(n, 0.2)}
    assert val_a == val_b
    # A subset of the names splits the same way: adding documents moves nothing.
    assert {n for n in names[:100] if is_validation(n, 0.2)} == val_a & set(names[:100])


def test_split_respects_the_fraction_roughly() -> None:
    names = [f"file-{i}.txt" for i in range(20_000)]
    for frac in (0.05, 0.3):
        share = sum(is_validation(n, frac) for n in names) / len(names)
        assert abs(share - frac) < 0.02
    assert not any(is_validation(n, 0.0) for n in names)


def test_corpus_split_is_independent_of_listing_order(tmp_path: Path) -> None:
    docs = {f"d{i}.txt": f"text {i}\n" for i in range(60)}
    a = open_text_corpus(_write_docs(tmp_path / "a", docs))
    b = open_text_corpus(_write_docs(tmp_path / "b", dict(reversed(list(docs.items())))))
    (ta, va), (tb, vb) = a.split(0.25), b.split(0.25)
    assert ta.names == tb.names and va.names == vb.names
    assert len(va) > 0 and len(ta) > 0
    assert sorted(ta.names + va.names) == a.names


def test_bad_val_fraction(tmp_path: Path) -> None:
    corpus = open_text_corpus(_write_docs(tmp_path, {"a.txt": "x"}))
    with pytest.raises(ValueError, match="val_fraction"):
        corpus.split(1.0)


# --- directory corpus -----------------------------------------------------------

def test_directory_corpus_names_and_order(tmp_path: Path) -> None:
    _write_docs(tmp_path, {"b.txt": "bee", "a/z.txt": "zed", "a/y.txt": "why", "notes.md": "skipped"})
    corpus = open_text_corpus(tmp_path)
    assert corpus.names == ["a/y.txt", "a/z.txt", "b.txt"]
    assert list(corpus.texts()) == ["why", "zed", "bee"]
    assert corpus.total_bytes == 9


def test_fingerprint_tracks_content_and_names(tmp_path: Path) -> None:
    _write_docs(tmp_path, {"a.txt": "alpha", "b.txt": "beta"})
    fp = open_text_corpus(tmp_path).fingerprint()
    assert open_text_corpus(tmp_path).fingerprint() == fp
    (tmp_path / "a.txt").write_text("alphA")  # same size, new content
    fp2 = open_text_corpus(tmp_path).fingerprint()
    assert fp2 != fp
    (tmp_path / "b.txt").rename(tmp_path / "c.txt")
    assert open_text_corpus(tmp_path).fingerprint() not in (fp, fp2)


def test_truncate_keeps_first_documents(tmp_path: Path) -> None:
    corpus = open_text_corpus(_write_docs(tmp_path, {f"{i}.txt": "x" * 100 for i in range(10)}))
    assert corpus.truncate(350).names == ["0.txt", "1.txt", "2.txt"]
    assert corpus.truncate(1).names == ["0.txt"]  # never empty
    assert corpus.truncate(350).fingerprint() != corpus.fingerprint()


# --- bad input --------------------------------------------------------------------

def test_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope.*accepted"):
        open_text_corpus(missing)
    with pytest.raises(ValueError, match="nope"):
        prepare_data(source=str(missing), cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="nope.bin"):
        prepare_data(source=str(tmp_path / "nope.bin"), cache_dir=tmp_path / "cache")


def test_directory_without_txt_names_it(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    _write_docs(tmp_path / "md", {"a.md": "not text"})
    for d in ("empty", "md"):
        with pytest.raises(ValueError, match=f"{d}.*no \\*.txt"):
            open_text_corpus(tmp_path / d)


def test_empty_text_file_names_it(tmp_path: Path) -> None:
    _write_docs(tmp_path, {"ok.txt": "fine", "sub/blank.txt": ""})
    with pytest.raises(ValueError, match="blank.txt: empty"):
        open_text_corpus(tmp_path)


def test_unknown_suffix_names_it(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("1,2,3")
    with pytest.raises(ValueError, match="data.csv.*accepted"):
        prepare_data(source=str(path), cache_dir=tmp_path / "cache")


def test_non_utf8_text_names_it(tmp_path: Path) -> None:
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    corpus = open_text_corpus(tmp_path)
    with pytest.raises(ValueError, match="latin.txt: not valid UTF-8"):
        list(corpus.texts())


# --- pre-tokenized files ------------------------------------------------------------

def test_npy_and_bin_are_accepted(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.uint16) % 500
    np.save(tmp_path / "t.npy", tokens)
    tokens.astype("<u2").tofile(tmp_path / "t.bin")
    a = open_token_file(tmp_path / "t.npy", vocab_size=500)
    b = open_token_file(tmp_path / "t.bin", dtype="uint16", vocab_size=500)
    np.testing.assert_array_equal(a.tokens, tokens)
    np.testing.assert_array_equal(b.tokens, tokens)
    assert not b.tokens.flags.writeable


def test_bin_sidecar_gives_dtype_and_vocab(tmp_path: Path) -> None:
    tokens = np.array([5, 70_000, 3], dtype=np.uint32)
    tokens.astype("<u4").tofile(tmp_path / "t.bin")
    (tmp_path / "t.bin.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 70_001}))
    data = prepare_data(source=str(tmp_path / "t.bin"), val_fraction=0.0, cache_dir=tmp_path / "c")
    assert data.vocab_size == 70_001 and data.tokenizer_path is None
    np.testing.assert_array_equal(data.train, tokens)
    assert len(data.val) == 0


def test_token_file_vocab_mismatch(tmp_path: Path) -> None:
    np.save(tmp_path / "t.npy", np.array([1, 2, 4096], dtype=np.uint16))
    with pytest.raises(ValueError, match="max token 4096.*vocab_size 4096"):
        open_token_file(tmp_path / "t.npy", vocab_size=4096)
    with pytest.raises(ValueError, match="max token 4096"):
        prepare_data(source=str(tmp_path / "t.npy"), vocab_size=4096, cache_dir=tmp_path / "c")


def test_token_file_needs_dtype_and_vocab(tmp_path: Path) -> None:
    np.arange(10, dtype="<u2").tofile(tmp_path / "t.bin")
    with pytest.raises(ValueError, match="t.bin: token dtype unknown"):
        open_token_file(tmp_path / "t.bin", vocab_size=10)
    with pytest.raises(ValueError, match="t.bin: vocabulary size unknown"):
        open_token_file(tmp_path / "t.bin", dtype="uint16")
    with pytest.raises(ValueError, match="not supported"):
        open_token_file(tmp_path / "t.bin", dtype="int64", vocab_size=10)


def test_empty_token_file_and_pickled_npy(tmp_path: Path) -> None:
    (tmp_path / "e.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="e.bin: empty"):
        open_token_file(tmp_path / "e.bin", dtype="uint16", vocab_size=10)
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="o.npy"):
        open_token_file(tmp_path / "o.npy", vocab_size=10)


def test_token_file_split_by_position(tmp_path: Path) -> None:
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.uint16))
    data = prepare_data(source=str(tmp_path / "t.npy"), vocab_size=100, val_fraction=0.1, cache_dir=tmp_path)
    np.testing.assert_array_equal(data.train, np.arange(90))
    np.testing.assert_array_equal(data.val, np.arange(90, 100))


# --- the real standard library (the one test that touches it) ----------------------

def test_stdlib_corpus_and_small_prepare(tmp_path: Path) -> None:
    corpus = open_stdlib_corpus()
    names = corpus.names
    assert names == sorted(names) and len(names) > 300
    assert "pydoc_data/topics.py" in names and "os.py" in names
    assert not any(set(n.split("/")) & {"test", "tests", "idle_test", "site-packages"} for n in names)
    data = prepare_data(source="stdlib", vocab_size=512, val_fraction=0.2, max_bytes=300_000, cache_dir=tmp_path)
    assert data.source == "stdlib" and data.vocab_size == 512
    assert len(data.train) > 10_000 and len(data.val) > 1_000
    assert int(data.train.max()) < 512 and data.train.dtype == np.uint16
