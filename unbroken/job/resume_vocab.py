"""A resumed run's vocabulary: the data's must be the one its checkpoint was trained with.

``--resume`` keeps the run's config, so ``data.tokenizer`` names the same file;
but the file (or a shard directory's ``vocab.json``) may have changed since.
A model trained on one vocabulary cannot continue on another (the embedding's
rows are the token ids), so such a resume is refused before anything starts,
naming both sizes and the fix.

Invariant: nothing but ``commit.json`` and the tokenizer (or a sidecar) is
read: no weights, no data.
"""

from __future__ import annotations

from pathlib import Path

from unbroken.checkpoint.files import read_commit
from unbroken.config import Config
from unbroken.data.prepare import stated_vocab_size

__all__ = ["check_resume_vocabulary", "checkpoint_vocabulary"]

_EMBEDDINGS = ("tok_embeddings.weight", "embed_tokens.weight")
"""The input embedding of the built-in llama and of Hugging Face's Llama: one row per token id."""


def checkpoint_vocabulary(checkpoint: Path) -> tuple[str, int] | None:
    """``(entry, rows)`` of the input embedding a committed checkpoint records; None for a model without one."""
    for name, _dtype, shape, *_ in read_commit(checkpoint).get("state", []):
        if name.startswith("model.") and name.endswith(_EMBEDDINGS) and shape:
            return name, int(shape[0])
    return None


def check_resume_vocabulary(run_dir: Path, checkpoint: Path | None, cfg: Config) -> None:
    """Refuse a ``--resume`` of ``run_dir`` whose data now has another vocabulary than ``checkpoint`` holds.

    A run without a committed checkpoint, or of a user's data or model (``data.factory``, ``model.factory``),
    is not checked here.

    Raises:
        ValueError: the sizes differ (names both, where each comes from, and the fix).
    """
    if checkpoint is None or cfg.data.factory or cfg.model.family == "custom":
        return
    trained = checkpoint_vocabulary(checkpoint)
    if trained is None:
        return
    d = cfg.data
    now = stated_vocab_size(source=d.source, vocab_size=d.vocab_size, tokenizer=d.tokenizer or None)
    if now == trained[1]:
        return
    where = f"data.tokenizer={d.tokenizer!r} now holds {now} ids" if d.tokenizer else \
        f"data.source={d.source!r} now states a vocabulary of {now}"
    fix = "put back the tokenizer file the run was trained with" if d.tokenizer else \
        "put back the vocabulary the run was trained with"
    raise ValueError(f"--resume {run_dir}: the run was trained on a vocabulary of {trained[1]} tokens "
                     f"({checkpoint.name}: {trained[0]} has {trained[1]} rows), but {where}; {fix}, or train "
                     "on the new one as a new run (--out)")
