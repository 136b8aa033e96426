"""A user's pretrained tokenizer (``data.tokenizer``): a ``tokenizer.json`` file or a local Hugging Face model directory.

It stands in for the BPE unbroken trains on a text corpus: the corpus is
tokenized with it, and the job's vocabulary is its size
(``get_vocab_size(with_added_tokens=True)``).

Invariants:

- Local only: a path that is not a ``tokenizer.json`` file or a directory
  holding one is refused (no download).
- Documents are separated by the tokenizer's own end-of-text token, the first
  of :data:`EOT_CANDIDATES` it defines; one defining none is refused.
- :attr:`PretrainedTokenizer.sha256` is the hash of the file's bytes: it keys
  the token caches, so another tokenizer never reuses them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer

__all__ = ["EOT_CANDIDATES", "PretrainedTokenizer", "resolve_tokenizer_path"]

EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


def resolve_tokenizer_path(spec: str | os.PathLike[str]) -> Path:
    """The ``tokenizer.json`` that ``spec`` names (the file, or the one in a model directory).

    Raises:
        ValueError: neither exists (names the path and what is accepted).
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"data.tokenizer={str(spec)!r}: no such tokenizer.json; name a tokenizers JSON file "
                         "or a local Hugging Face model directory containing tokenizer.json")
    return path


class PretrainedTokenizer:
    """A ``tokenizers`` JSON tokenizer, with the interface the token caches use.

    Raises:
        ValueError: an unreadable file, or no end-of-text token (names the candidates).
    """

    def __init__(self, spec: str | os.PathLike[str]) -> None:
        self.path = resolve_tokenizer_path(spec)
        raw = self.path.read_bytes()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        try:
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises its own Exception subclass on bad JSON
            raise ValueError(f"{self.path}: not a tokenizers JSON file ({e})") from e
        ids = [self._tok.token_to_id(t) for t in EOT_CANDIDATES]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"{self.path}: defines none of the end-of-text tokens {', '.join(EOT_CANDIDATES)}; "
                             "add one as a special token to separate documents")
        self._eot = int(found[0])

    @property
    def eot_id(self) -> int:
        return self._eot

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode several texts in parallel (Rust threads)."""
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))
