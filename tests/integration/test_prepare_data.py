"""A real corpus in: ``unbroken prepare-data`` killed by SIGKILL half-way and run again ends with the bytes of an
uninterrupted run, and the debug model trains on the shards it wrote with two workers; once the tokenizer file
changes, ``--resume`` of that run is refused."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from _faults import failover_config, run_job
from unbroken import cli
from unbroken.data.corpus import stdlib_root
from unbroken.runtime.ledger import check_ledger

pytestmark = pytest.mark.timeout(300)

LINES = 30_000
SHARD_TOKENS = 4000
PIPE_BYTES = 4096
"""The smallest pipe: a prepare-data that nobody reads any more blocks once this much progress is unread."""


def _corpus(root: Path) -> Path:
    """Standard-library lines as documents: three .jsonl files and a few .txt files, and a BPE trained on them."""
    lines: list[str] = []
    for path in sorted(stdlib_root().glob("*.py")):
        lines += [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        if len(lines) >= LINES:
            break
    lines = lines[:LINES]
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    third = len(lines) // 3
    for i in range(3):
        with (corpus / f"part{i}.jsonl").open("w") as f:
            f.writelines(json.dumps({"text": ln, "n": j}) + "\n" for j, ln in enumerate(lines[i * third:(i + 1) * third]))
    for i in range(3):  # after the .jsonl files in name order
        (corpus / f"z-notes{i}.txt").write_text("\n".join(lines[i:i + 20]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    return corpus


def _prepare(corpus: Path, tokenizer: Path, out: Path, **popen: object) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "unbroken.cli", "prepare-data", str(corpus), "--out", str(out),
           "--tokenizer", str(tokenizer), "--shard-tokens", str(SHARD_TOKENS)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, **popen)  # type: ignore[call-overload]


def _killed_half_way(corpus: Path, tokenizer: Path, out: Path) -> dict:
    """Run prepare-data until its progress reports a shard written, then SIGKILL it; returns the progress it left.

    Its progress lines go to a pipe of :data:`PIPE_BYTES` that is not read after that report: the run blocks
    there long before its end, so the kill lands half-way whatever the machine's speed.
    """
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    proc = _prepare(corpus, tokenizer, out, stderr=w)
    os.close(w)
    seen = b""
    try:
        while not re.search(rb" [1-9][0-9]* shards\n", seen):
            chunk = os.read(r, 256)
            assert chunk, f"prepare-data ended before writing a shard: {seen.decode()!r}"
            seen += chunk
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        os.close(r)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    return json.loads((out / "prepare.json").read_text())


def test_killed_prepare_data_continues_to_the_same_bytes_and_trains(tmp_path: Path, capsys) -> None:
    corpus = _corpus(tmp_path)
    tokenizer = tmp_path / "tokenizer.json"
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    done = _prepare(corpus, tokenizer, whole, stderr=subprocess.PIPE)
    _, err = done.communicate(timeout=240)
    assert done.returncode == 0, err.decode()

    progress = _killed_half_way(corpus, tokenizer, resumed)
    total = len(list(whole.glob("part-*.npy")))
    assert not progress["done"] and 1 <= progress["shards"] < total and not (resumed / "vocab.json").exists()
    again = _prepare(corpus, tokenizer, resumed, stderr=subprocess.PIPE)
    _, err = again.communicate(timeout=240)
    assert again.returncode == 0, err.decode()
    names = sorted(p.name for p in whole.iterdir())
    assert names == sorted(p.name for p in resumed.iterdir()) and len(names) == total + 2
    for name in names:
        assert (resumed / name).read_bytes() == (whole / name).read_bytes(), name
    shards = [np.load(whole / f"part-{i:05d}.npy") for i in range(total)]
    assert all(len(s) == SHARD_TOKENS for s in shards[:-1]) and shards[0].dtype == np.uint16

    cfg = failover_config([], 4, f"data.source={whole}", f"data.tokenizer={tokenizer}", "train.workers=2",
                          "train.val_every=4")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=2)
    assert job.summary["steps"] == 4
    assert check_ledger(job.run_dir, n_slots=2, micro_batch=cfg.data.micro_batch, steps=4).ok
    vocab = json.loads((whole / "vocab.json").read_text())["vocab_size"]
    assert vocab == Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
    assert job.summary.get("vocab_size", vocab) == vocab

    # The tokenizer file changes under the finished run: --resume refuses before anything starts, with the fix.
    grown = Tokenizer.from_file(str(tokenizer))
    grown.add_tokens(["<|pad|>"])
    grown.save(str(tokenizer))
    assert cli.main(["train", "--resume", str(job.run_dir), "--train.steps=6"]) == 2
    err = capsys.readouterr().err
    assert f"unbroken train: error: --resume {job.run_dir}: the run was trained on a vocabulary of {vocab} tokens " \
           f"(step_0000004: model.tok_embeddings.weight has {vocab} rows), but data.tokenizer='{tokenizer}' now " \
           f"holds {vocab + 1} ids; put back the tokenizer file the run was trained with, or train on the new one " \
           "as a new run (--out)" in err, err
