"""Tokenizer training and caching, token caches, prepare_data caching and locking."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from unbroken.data import CACHE_DIR_ENV, EOT_ID, BPETokenizer, prepare_data
from unbroken.data.corpus import TextCorpus, open_text_corpus
from unbroken.data.prepare import cache_lock
from unbroken.data.token_cache import build_token_cache, load_or_build_token_cache
from unbroken.data.tokenizer import load_or_train_tokenizer, train_bpe

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = Path(__file__).resolve().parents[2]
_WORDS = ["def", "return", "self", "data", "token", "the", "of", "and", "für", "naïve", "日本語", "🙂", "x=1;", "\t"]


def _synthetic_docs(n: int = 40, seed: int = 0) -> dict[str, str]:
    rng = np.random.default_rng(seed)
    docs = {}
    for i in range(n):
        words = rng.choice(_WORDS, size=300)
        lines = [" ".join(words[j:j + 12]) for j in range(0, 300, 12)]
        docs[f"part{i % 3}/doc{i:03d}.txt"] = "\n".join(lines) + "\n"
    return docs


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    for name, text in _synthetic_docs().items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tokenizer() -> BPETokenizer:
    return BPETokenizer(train_bpe(_synthetic_docs().values(), vocab_size=300))


@pytest.mark.parametrize("text", [
    "plain ascii, with  double  spaces and\ttabs\n\n",
    "unicode: naïve café 日本語 🙂👍🏽 עברית combining e\u0301 \u200b zero-width, \x00 nul, \r\n crlf",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    " leading space, trailing space ",
    "<|endoftext|> in text, and unseen: \U0001F9EC \u2603 Ω ∑",
    "",
])
def test_round_trip(tokenizer: BPETokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_ids_and_vocab(tokenizer: BPETokenizer) -> None:
    assert tokenizer.eot_id == EOT_ID == 0
    assert tokenizer.encode("<|endoftext|>") == [EOT_ID]
    assert tokenizer.vocab_size == 300
    assert tokenizer.encode_batch(["def self", "🙂"]) == [tokenizer.encode("def self"), tokenizer.encode("🙂")]
    with pytest.raises(ValueError, match="vocab_size must be an int >= 257"):
        train_bpe(["abc"], vocab_size=256)
    assert BPETokenizer(train_bpe(["abc"], vocab_size=257)).vocab_size == 257  # bytes + EOT, no merges


def test_tokenizer_cache_is_reused(corpus_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    train, _ = open_text_corpus(corpus_dir).split(0.1)
    caplog.set_level(logging.INFO, logger="unbroken.data")
    first = load_or_train_tokenizer(train, vocab_size=320, cache_dir=tmp_path / "c")
    assert first.path is not None and first.path.name.startswith(f"tokenizer-{train.fingerprint()[:16]}-v320")
    mtime = first.path.stat().st_mtime_ns
    caplog.clear()
    second = load_or_train_tokenizer(train, vocab_size=320, cache_dir=tmp_path / "c")
    assert second.path == first.path and second.sha256 == first.sha256
    assert first.path.stat().st_mtime_ns == mtime
    assert not any("training" in r.getMessage() for r in caplog.records)
    assert any("reusing tokenizer" in r.getMessage() for r in caplog.records)


def test_tokenizer_sees_training_split_only(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    for i in range(30):
        (root / f"d{i}.txt").write_text("common words here\n")
    _, val = open_text_corpus(root).split(0.3)
    assert len(val) > 0
    for doc in val.documents:  # a word that appears nowhere in training
        doc.path.write_text("zyzzyva " * 200)
    train, _ = open_text_corpus(root).split(0.3)
    tok = load_or_train_tokenizer(train, vocab_size=400, cache_dir=tmp_path / "cache")
    assert len(tok.encode("zyzzyva")) > 1  # never merged, so never trained on


def test_token_cache_matches_direct_encoding(corpus_dir: Path, tmp_path: Path, tokenizer: BPETokenizer) -> None:
    corpus = open_text_corpus(corpus_dir)
    tokens = build_token_cache(corpus, tokenizer, tmp_path / "t.bin", split="train", vocab_size=300)
    expected: list[int] = []
    for i, text in enumerate(corpus.texts()):
        expected += ([EOT_ID] if i else []) + tokenizer.encode(text)
    assert isinstance(tokens, np.memmap) and not tokens.flags.writeable
    assert tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, np.array(expected))
    meta = json.loads((tmp_path / "t.bin.json").read_text())
    assert meta == {"dtype": "uint16", "count": len(expected), "vocab_size": 300, "split": "train",
                    "tokenizer_sha256": tokenizer.sha256, "corpus_fingerprint": corpus.fingerprint(),
                    "documents": len(corpus)}
    wide = build_token_cache(corpus, tokenizer, tmp_path / "w.bin", split="train", vocab_size=300,
                             token_dtype="uint32")
    assert wide.dtype == np.uint32 and (tmp_path / "w.bin").stat().st_size == 4 * len(expected)
    np.testing.assert_array_equal(wide, tokens)
    with pytest.raises(ValueError, match="cannot hold vocab_size 70000"):
        build_token_cache(corpus, tokenizer, tmp_path / "x.bin", split="train", vocab_size=70_000,
                          token_dtype="uint16")


def test_token_cache_rebuilds_when_incomplete(corpus_dir: Path, tmp_path: Path, tokenizer: BPETokenizer) -> None:
    corpus = open_text_corpus(corpus_dir)
    kw = dict(cache_dir=tmp_path, split="train", vocab_size=300)
    good = np.array(load_or_build_token_cache(corpus, tokenizer, **kw))
    (bin_path,) = tmp_path.glob("tokens-*.bin")
    with open(bin_path, "r+b") as f:  # a torn write: sidecar says more than the file holds
        f.truncate(10)
    np.testing.assert_array_equal(load_or_build_token_cache(corpus, tokenizer, **kw), good)
    empty = load_or_build_token_cache(TextCorpus([], source="none"), tokenizer, **kw | {"split": "val"})
    assert len(empty) == 0


def test_prepare_data_reuses_then_rebuilds_on_change(corpus_dir: Path, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="unbroken.data")
    kw = dict(source=str(corpus_dir), vocab_size=300, val_fraction=0.2, cache_dir=tmp_path / "cache")
    a = prepare_data(**kw)
    assert any("training BPE" in r.getMessage() for r in caplog.records)
    assert len(a.train) > 1000 and len(a.val) > 100 and a.vocab_size == 300
    assert int(max(a.train.max(), a.val.max())) < 300
    caplog.clear()
    b = prepare_data(**kw)
    assert not any("built" in r.getMessage() or "training" in r.getMessage() for r in caplog.records)
    assert b.fingerprint == a.fingerprint and b.tokenizer_path == a.tokenizer_path
    np.testing.assert_array_equal(a.train, b.train)
    first = sorted(corpus_dir.rglob("*.txt"))[0]
    first.write_text(first.read_text() + "more text\n")
    c = prepare_data(**kw)
    assert c.fingerprint != a.fingerprint
    d = prepare_data(**kw | {"max_bytes": 10_000})
    assert d.fingerprint not in (a.fingerprint, c.fingerprint) and len(d.train) < len(c.train)


def test_prepare_data_cache_dir_from_env(corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "envcache"))
    data = prepare_data(source=str(corpus_dir), vocab_size=280, val_fraction=0.1)
    assert data.tokenizer_path is not None
    assert Path(data.tokenizer_path).parent == tmp_path / "envcache"


def test_prepare_data_bad_arguments(corpus_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        prepare_data(source=str(corpus_dir), vocab_size=100, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="val_fraction"):
        prepare_data(source=str(corpus_dir), val_fraction=-0.1, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="token_dtype 'int8'"):
        prepare_data(source=str(corpus_dir), token_dtype="int8", cache_dir=tmp_path)


def test_cache_lock_times_out(tmp_path: Path) -> None:
    with cache_lock(tmp_path):
        with pytest.raises(TimeoutError, match=r"\.lock within"):
            with cache_lock(tmp_path, timeout_s=0.3):
                pass
    with cache_lock(tmp_path, timeout_s=0.3):  # released on exit
        pass


_WORKER = """
import json, logging, sys
from unbroken.data import prepare_data
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
logging.getLogger("unbroken.data").addHandler(Keep())
logging.getLogger("unbroken.data").setLevel(logging.INFO)
d = prepare_data(source=sys.argv[1], vocab_size=300, val_fraction=0.2, cache_dir=sys.argv[2])
print(json.dumps({"fp": d.fingerprint, "trained": sum("training BPE" in m for m in records)}))
"""


def test_concurrent_prepare_builds_once(corpus_dir: Path, tmp_path: Path) -> None:
    env = os.environ | {"PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(corpus_dir), str(tmp_path / "cache")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=100)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert len({r["fp"] for r in results}) == 1
    assert sum(r["trained"] for r in results) == 1
    assert not list((tmp_path / "cache").glob(".*.tmp"))
