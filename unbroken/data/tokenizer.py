"""Byte-level BPE tokenizer, trained locally with the ``tokenizers`` library.

Invariants:

- Byte-level: every unicode string encodes, and ``decode(encode(text)) ==
  text`` for any text (no normalizer, no prefix space, special tokens kept on
  decode).
- Id layout: ``<|endoftext|>`` is id 0 (:data:`EOT_ID`), the 256 byte symbols
  come next, merges after, so the minimum vocabulary is 257.
- Trained on the *training* split only, so validation text is unseen.
- Cached as JSON at ``<cache_dir>/tokenizer-<fingerprint[:16]>-v<vocab>.json``
  where the fingerprint is that of the training split; the file is written
  atomically, and its sha256 (:attr:`BPETokenizer.sha256`) keys the token
  caches built with it.
- On a tiny corpus BPE may run out of merges: the tokenizer then has fewer
  ids than requested, all of them still ``< vocab_size``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from unbroken.data._atomic import atomic_write_bytes
from unbroken.data.corpus import TextCorpus

logger = logging.getLogger(__name__)

EOT_TOKEN = "<|endoftext|>"
EOT_ID = 0
SPECIAL_TOKENS = (EOT_TOKEN,)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


class BPETokenizer:
    """A trained byte-level BPE tokenizer with the project's id conventions.

    Args:
        json_text: the tokenizer in the ``tokenizers`` JSON format.
        path: the file it was read from or saved to, if any.
    """

    def __init__(self, json_text: str, *, path: Path | None = None) -> None:
        self._tok = Tokenizer.from_str(json_text)
        self.path = path
        self.sha256 = hashlib.sha256(json_text.encode("utf-8")).hexdigest()
        eot = self._tok.token_to_id(EOT_TOKEN)
        if eot != EOT_ID:
            raise ValueError(f"{path or 'tokenizer'}: {EOT_TOKEN!r} has id {eot}, expected {EOT_ID}; "
                             "not a tokenizer trained by unbroken (delete it to retrain)")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> BPETokenizer:
        """Load a tokenizer JSON file."""
        path = Path(path)
        return cls(path.read_text(encoding="utf-8"), path=path)

    @property
    def eot_id(self) -> int:
        return EOT_ID

    @property
    def vocab_size(self) -> int:
        """Number of ids actually in use (may be below the requested size)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode several texts in parallel (Rust threads)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def check_vocab_size(vocab_size: int) -> None:
    """Raise ValueError unless the vocabulary holds all bytes and special tokens."""
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} "
                         f"special token), got {vocab_size!r}")


def train_bpe(texts: Iterable[str], *, vocab_size: int, length: int | None = None) -> str:
    """Train a byte-level BPE tokenizer and return it as JSON text.

    Args:
        texts: the training documents.
        vocab_size: the requested vocabulary size, specials and bytes included.
        length: number of texts, if known (progress only).

    Raises:
        ValueError: ``vocab_size`` below :data:`MIN_VOCAB_SIZE`.
    """
    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    # No normalizer and no prefix space: both would break the exact round trip.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok.to_str()


def tokenizer_cache_path(cache_dir: str | os.PathLike[str], fingerprint: str, vocab_size: int) -> Path:
    """Where the tokenizer trained on a corpus with ``fingerprint`` is cached."""
    return Path(cache_dir) / f"tokenizer-{fingerprint[:16]}-v{vocab_size}.json"


def load_or_train_tokenizer(
    train_corpus: TextCorpus, *, vocab_size: int, cache_dir: str | os.PathLike[str]
) -> BPETokenizer:
    """Reuse the cached tokenizer of ``train_corpus``, or train and cache it.

    The caller serializes concurrent builders (see ``prepare_data``); the
    atomic write alone already keeps readers from seeing a partial file.

    Raises:
        ValueError: bad ``vocab_size`` or an empty training corpus.
    """
    check_vocab_size(vocab_size)
    path = tokenizer_cache_path(cache_dir, train_corpus.fingerprint(), vocab_size)
    if path.exists():
        logger.info("reusing tokenizer %s", path)
        return BPETokenizer.from_file(path)
    if len(train_corpus) == 0:
        raise ValueError(f"{train_corpus.source}: no training documents to train the tokenizer on; "
                         "lower val_fraction or add documents")
    logger.info("training BPE tokenizer (vocab %d) on %d documents, %d bytes",
                vocab_size, len(train_corpus), train_corpus.total_bytes)
    json_text = train_bpe(train_corpus.texts(), vocab_size=vocab_size, length=len(train_corpus))
    atomic_write_bytes(path, json_text.encode("utf-8"))
    tokenizer = BPETokenizer(json_text, path=path)
    logger.info("built tokenizer %s (%d ids)", path, tokenizer.vocab_size)
    return tokenizer
