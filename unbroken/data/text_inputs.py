"""The documents ``unbroken prepare-data`` reads: text files, JSON lines, or a Hugging Face dataset's text column.

Invariants:

- A fixed order, the same on every machine: files sorted by their path (below
  a directory, by the path relative to it), lines in file order; a dataset's
  rows in index order.
- Document ``i`` can be reached without tokenizing the ones before it (a
  resumed preparation skips them): a ``.txt`` file is one document, a
  ``.jsonl`` file one per non-blank line (lines are counted, not parsed).
- The fingerprint covers each file's name, size and modification time (a
  dataset's own fingerprint), not its bytes.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path

from unbroken.data.hf_dataset import DatasetTextColumn, is_saved_dataset, load_hub_dataset, load_saved_dataset
from unbroken.data.shard_writer import input_fingerprint

__all__ = ["TEXT_SUFFIXES", "TextFiles", "open_text_input"]

TEXT_SUFFIXES = (".txt", ".jsonl")


class TextFiles:
    """``.txt`` files (one document each) and ``.jsonl`` files (one document per line, its ``text_field``).

    Args:
        spec: a file, a directory (every ``.txt``/``.jsonl`` below it) or a glob pattern.
        text_field: the JSON field holding a line's text.

    Raises:
        ValueError: nothing matches (names the spec and what is accepted).
    """

    def __init__(self, spec: str, *, text_field: str = "text") -> None:
        path = Path(spec).expanduser()
        if path.is_dir():
            files = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES),
                           key=lambda p: p.relative_to(path).as_posix())
        elif path.is_file():
            files = [path]
        else:
            files = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True)
                           if Path(p).is_file() and Path(p).suffix in TEXT_SUFFIXES)
        bad = [p for p in files if p.suffix not in TEXT_SUFFIXES]
        if not files or bad:
            what = "is neither a .txt nor a .jsonl file" if bad else \
                "holds no .txt or .jsonl file" if path.is_dir() else "matches no .txt or .jsonl file"
            raise ValueError(f"{spec}: {what}; give a .txt/.jsonl file, a directory holding them, a glob such as "
                             "'data/*.jsonl', or a Hugging Face dataset (save_to_disk's directory, or --hub NAME)")
        self.files, self.text_field, self.description = files, text_field, spec
        self.total: int | None = len(files) if all(p.suffix == ".txt" for p in files) else None

    def fingerprint(self) -> str:
        return input_fingerprint(self.text_field, *[(str(p), p.stat().st_size, p.stat().st_mtime_ns)
                                                    for p in self.files])

    def documents(self, start: int) -> Iterator[str]:
        index = 0
        for path in self.files:
            if path.suffix == ".txt":
                if index >= start:
                    yield _decode(path.read_bytes(), path, None)
                index += 1
                continue
            with path.open("rb") as f:
                for line_no, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    if index >= start:
                        yield self._field(line, path, line_no)
                    index += 1

    def _field(self, line: bytes, path: Path, line_no: int) -> str:
        try:
            row = json.loads(_decode(line, path, line_no))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not a JSON line ({e}); each line of a .jsonl file is one JSON "
                             "object") from None
        text = row.get(self.text_field) if isinstance(row, dict) else None
        if not isinstance(text, str):
            keys = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{path}:{line_no}: no text field {self.text_field!r} (found: {keys}); name the "
                             "field holding the text with --text-field")
        return text


def _decode(data: bytes, path: Path, line_no: int | None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"{path}:{line_no}" if line_no else str(path)
        raise ValueError(f"{where}: not valid UTF-8 ({e}); convert the file to UTF-8") from None


def open_text_input(spec: str, *, text_field: str = "text", split: str = "train",
                    hub: bool = False) -> TextFiles | DatasetTextColumn:
    """The documents ``spec`` names: a dataset saved with ``save_to_disk``, a dataset ``datasets.load_dataset``
    finds (``hub``), or text files.

    Raises:
        ValueError: as :class:`TextFiles`, :class:`~unbroken.data.hf_dataset.DatasetTextColumn` and
            :func:`~unbroken.data.hf_dataset.load_saved_dataset` say.
    """
    if hub:
        return DatasetTextColumn(load_hub_dataset(spec, split), text_field, f"{spec} (split {split})")
    if is_saved_dataset(spec):
        return DatasetTextColumn(load_saved_dataset(spec, split), text_field, spec)
    return TextFiles(spec, text_field=text_field)
