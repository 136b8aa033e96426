"""data.tokenizer: a user's tokenizer.json tokenizes text instead of a trained BPE and sets the vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from unbroken.data.prepare import prepare_data

pytestmark = pytest.mark.timeout(60)

_VOCAB = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3, "again": 4}


def _tokenizer(path: Path, vocab: dict[str, int] = _VOCAB) -> Path:
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([t for t in ("</s>",) if t in vocab])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_text_is_tokenized_with_the_named_tokenizer(tmp_path: Path) -> None:
    model_dir = _tokenizer(tmp_path / "model")  # a model directory, as from Hugging Face
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("hello world")
    (tmp_path / "text" / "b.txt").write_text("world again hello")
    data = prepare_data(source=str(tmp_path / "text"), tokenizer=str(model_dir), val_fraction=0.0,
                        vocab_size=4096, cache_dir=tmp_path / "cache")
    assert data.vocab_size == 5  # the tokenizer's, not data.vocab_size
    assert data.tokenizer_path == str(model_dir / "tokenizer.json")
    # Documents in name order, joined by the tokenizer's own </s> (id 1).
    assert np.asarray(data.train).tolist() == [2, 3, 1, 3, 4, 2]
    again = prepare_data(source=str(tmp_path / "text"), tokenizer=str(model_dir / "tokenizer.json"),
                         val_fraction=0.0, cache_dir=tmp_path / "cache")
    assert again.fingerprint == data.fingerprint


def test_a_token_file_is_checked_against_the_tokenizer_vocabulary(tmp_path: Path) -> None:
    model_dir = _tokenizer(tmp_path / "model")
    np.save(tmp_path / "t.npy", np.array([1, 2, 3, 4, 5, 2], dtype=np.uint16))
    with pytest.raises(ValueError, match=r"t\.npy: max token 5 is >= vocab_size 5 \(token offset 4"):
        prepare_data(source=str(tmp_path / "t.npy"), tokenizer=str(model_dir), vocab_size=4096)


def test_bad_tokenizers_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no such tokenizer\.json; name a tokenizers JSON file or a local"):
        prepare_data(source="stdlib", tokenizer=str(tmp_path / "missing"))
    no_eot = _tokenizer(tmp_path / "no_eot", {"[UNK]": 0, "hello": 1})
    with pytest.raises(ValueError, match="defines none of the end-of-text tokens"):
        prepare_data(source="stdlib", tokenizer=str(no_eot))
