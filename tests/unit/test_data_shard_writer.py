"""unbroken prepare-data's writer: documents -> EOS-separated token shards of a fixed size, resumable, refused when
the directory holds something else."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from unbroken.data.pretrained import PretrainedTokenizer
from unbroken.data.prepare import prepare_data
from unbroken.data.shard_writer import PROGRESS_FILE, Progress, write_shards
from unbroken.data.shards import open_shard_directory
from unbroken.data.text_inputs import TextFiles

pytestmark = pytest.mark.timeout(60)

WORDS = ["<|endoftext|>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
"""A word-level vocabulary: id i is WORDS[i], so every expected token list is written out by hand."""


def word_tokenizer(path: Path) -> Path:
    """A tokenizer.json mapping each word of :data:`WORDS` to its index (whitespace-split)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


def ids(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


class Docs:
    """In-memory documents with a fixed order (the writer's input protocol)."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.description, self.total = texts, "docs", len(texts)

    def fingerprint(self) -> str:
        return json.dumps(self.texts)

    def documents(self, start: int) -> Iterator[str]:
        yield from self.texts[start:]


TEXTS = ["the cat sat on the mat", "a dog ran", "", "the dog sat", "a cat ran on a mat"]


def stream_of(texts: list[str]) -> list[int]:
    return [t for text in texts if text for t in ids(text) + [0]]


def test_documents_end_with_eos_and_shards_hold_exactly_shard_tokens(tmp_path: Path) -> None:
    tok = PretrainedTokenizer(word_tokenizer(tmp_path / "tokenizer.json"))
    seen: list[Progress] = []
    final = write_shards(Docs(TEXTS), tok, tmp_path / "out", shard_tokens=5, on_progress=seen.append)
    want = stream_of(TEXTS)
    assert want == [1, 2, 3, 4, 1, 5, 0, 6, 7, 8, 0, 1, 7, 3, 0, 6, 2, 8, 4, 6, 5, 0]
    shards = sorted((tmp_path / "out").glob("part-*.npy"))
    assert [p.name for p in shards] == [f"part-{i:05d}.npy" for i in range(5)]
    arrays = [np.load(p) for p in shards]
    assert [len(a) for a in arrays] == [5, 5, 5, 5, 2] and all(a.dtype == np.uint16 for a in arrays)
    assert np.concatenate(arrays).tolist() == want
    assert final == Progress(documents=5, total=5, tokens=22, shards=5, done=True) and seen[-1] == final
    assert json.loads((tmp_path / "out" / "vocab.json").read_text()) == {
        "vocab_size": len(WORDS), "eot_id": 0, "tokenizer_sha256": tok.sha256}
    tokens, vocab, _ = open_shard_directory(tmp_path / "out", dtype=None, vocab_size=None)
    assert vocab == len(WORDS) and tokens[np.arange(len(tokens))].tolist() == want


def test_a_run_continues_from_its_progress_and_ends_with_the_same_bytes(tmp_path: Path) -> None:
    tok = PretrainedTokenizer(word_tokenizer(tmp_path / "tokenizer.json"))
    write_shards(Docs(TEXTS), tok, tmp_path / "whole", shard_tokens=4)
    # A run that stopped after shard 2 (mid-document: shard 2 ends inside "the dog sat"), with a shard 3 it
    # wrote but did not record and a temporary file it left.
    part = tmp_path / "part"
    write_shards(Docs(TEXTS), tok, part, shard_tokens=4)
    progress = json.loads((part / PROGRESS_FILE).read_text())
    progress.update(shards=3, document=3, offset=1, documents=3, tokens=12, done=False)
    (part / PROGRESS_FILE).write_text(json.dumps(progress))
    (part / "vocab.json").unlink()
    (part / "part-00004.npy").unlink()
    (part / "part-00005.npy").unlink()
    np.save(part / "part-00003.npy", np.zeros(4, np.uint16))  # to be rewritten
    (part / ".part-00004.npy.x.tmp").write_bytes(b"half")
    final = write_shards(Docs(TEXTS), tok, part, shard_tokens=4)
    assert final.shards == 6 and final.tokens == 22 and final.documents == 5
    assert sorted(p.name for p in part.iterdir()) == sorted(p.name for p in (tmp_path / "whole").iterdir())
    for p in (tmp_path / "whole").iterdir():
        assert (part / p.name).read_bytes() == p.read_bytes(), p.name


def test_a_finished_directory_is_left_as_it_is_and_other_settings_are_refused(tmp_path: Path) -> None:
    tok = PretrainedTokenizer(word_tokenizer(tmp_path / "tokenizer.json"))
    out = tmp_path / "out"
    write_shards(Docs(TEXTS), tok, out, shard_tokens=4)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert write_shards(Docs(TEXTS), tok, out, shard_tokens=4).done
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(ValueError, match=r"prepared with other settings \(input_fingerprint, shard_tokens differ\)"):
        write_shards(Docs(TEXTS[:2]), tok, out, shard_tokens=5)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.md").write_text("mine")
    with pytest.raises(ValueError, match="not empty and not a directory unbroken prepare-data writes"):
        write_shards(Docs(TEXTS), tok, tmp_path / "busy")
    with pytest.raises(ValueError, match="no document holds any text"):
        write_shards(Docs(["", ""]), tok, tmp_path / "empty")
    with pytest.raises(ValueError, match="a file, not a directory"):
        write_shards(Docs(TEXTS), tok, tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="--shard-tokens 0: must be >= 1"):
        write_shards(Docs(TEXTS), tok, tmp_path / "zero", shard_tokens=0)


def test_text_files_and_json_lines_in_name_order(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / "b" / "z.txt").write_text("the mat")
    (root / "a.jsonl").write_text('{"text": "a dog"}\n\n{"text": "the cat", "id": 2}\n')
    (root / "c.txt").write_text("a cat ran")
    (root / "skip.md").write_text("not read")
    files = TextFiles(str(root))
    assert [p.name for p in files.files] == ["a.jsonl", "z.txt", "c.txt"] and files.total is None
    assert list(files.documents(0)) == ["a dog", "the cat", "the mat", "a cat ran"]
    assert list(files.documents(2)) == ["the mat", "a cat ran"]
    assert [p.name for p in TextFiles(str(root / "*.txt")).files] == ["c.txt"]
    tok = PretrainedTokenizer(word_tokenizer(tmp_path / "tokenizer.json"))
    write_shards(files, tok, tmp_path / "out", shard_tokens=100)
    assert np.load(tmp_path / "out" / "part-00000.npy").tolist() == stream_of(["a dog", "the cat", "the mat",
                                                                                "a cat ran"])


def test_bad_text_input_names_the_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"text": "a dog"}\n{"body": "the cat"}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: no text field 'text' \(found: body\); name the field"):
        list(TextFiles(str(tmp_path / "x.jsonl")).documents(0))
    (tmp_path / "y.jsonl").write_text('{"text": "a dog"\n')
    with pytest.raises(ValueError, match=r"y.jsonl:1: not a JSON line"):
        list(TextFiles(str(tmp_path / "y.jsonl")).documents(0))
    with pytest.raises(ValueError, match=r"nothing-\*.txt: matches no .txt or .jsonl file; give a .txt/.jsonl file"):
        TextFiles(str(tmp_path / "nothing-*.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: holds no .txt or .jsonl file"):
        TextFiles(str(tmp_path / "empty"))
    (tmp_path / "notes.md").write_text("the cat")
    with pytest.raises(ValueError, match="notes.md: is neither a .txt nor a .jsonl file"):
        TextFiles(str(tmp_path / "notes.md"))


def test_prepared_directory_is_a_data_source(tmp_path: Path) -> None:
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json")
    write_shards(Docs(TEXTS * 3), PretrainedTokenizer(tokenizer), tmp_path / "out", shard_tokens=7)
    data = prepare_data(source=str(tmp_path / "out"), val_fraction=0.25, tokenizer=str(tokenizer),
                        cache_dir=tmp_path / "cache")
    want = stream_of(TEXTS * 3)
    assert data.vocab_size == len(WORDS) and len(data.train) == len(want) - len(want) // 4
    assert data.train[np.arange(len(data.train))].tolist() == want[:len(data.train)]


def test_prepare_data_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from unbroken import cli

    tokenizer = word_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "docs.jsonl").write_text("".join(f'{{"text": "{t}"}}\n' for t in TEXTS if t))
    out = tmp_path / "out"
    assert cli.main(["prepare-data", str(tmp_path / "docs.jsonl"), "--out", str(out),
                     f"--data.tokenizer={tokenizer}", "--shard-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out == (f"prepared {out}: 3 shards, 22 tokens from 4 documents (vocabulary 9); train on it "
                            f"with --data.source={out}\n")
    assert captured.err == "4 documents, 22 tokens, 2 shards\n4 documents, 22 tokens, 3 shards\n"
    assert np.concatenate([np.load(out / f"part-0000{i}.npy") for i in range(3)]).tolist() == stream_of(TEXTS)
    assert cli.main(["prepare-data", str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "o2")]) == 2
    assert capsys.readouterr().err == ("unbroken prepare-data: error: --tokenizer: name the job's tokenizer (a "
                                       "tokenizer.json or a local Hugging Face model directory, as data.tokenizer)\n")
    assert cli.main(["prepare-data", str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "o2"),
                     "--tokenizer", str(tokenizer), "--data.seq_len=64"]) == 2
    assert "takes --tokenizer (or --data.tokenizer), not --data.seq_len=64" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()
