"""``unbroken export RUN --hf OUT``: a committed checkpoint of a run as a Hugging Face Llama directory.

The directory holds ``config.json`` (a ``LlamaConfig`` of the run's shapes,
:func:`unbroken.models.hf_llama.hf_config`), ``model.safetensors`` (the model's
weights under Hugging Face's names, no optimizer state),
``generation_config.json`` and the run's ``tokenizer.json`` when it has one, so
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads it.

Invariants:
    - only a committed checkpoint whose files match their checksums is read
      (:func:`unbroken.checkpoint.checkpointer.verify_checkpoint`); a damaged one is
      named and nothing is written;
    - the weights are read as raw safetensors bytes (no pickle), the sharded
      ones of an HSDP run from its parts (:func:`unbroken.checkpoint.sharded.load_hsdp_parts`);
    - ``OUT`` appears whole or not at all: everything is written into a
      temporary sibling directory renamed to ``OUT`` at the end; an existing
      ``OUT`` is never replaced.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Literal

import torch

from unbroken.config import config_from_dict
from unbroken.config import Config
from unbroken.job.run_dir import saved_config
from unbroken.models.hf_llama import hf_config, hf_state_dict_from_ours, require_transformers
from unbroken.models.llama import ModelArgs, model_args
from unbroken.checkpoint.checkpointer import latest_checkpoint, verify_checkpoint
from unbroken.checkpoint.files import checkpoint_dir, committed_checkpoints

__all__ = ["DTYPES", "export_hf", "read_model_weights"]

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtypes ``--dtype`` accepts, by name."""
_PREFIX = "model."


def _run_config(run_dir: Path) -> Config:
    data = saved_config(run_dir)
    if data is None:
        raise ValueError(f"{str(run_dir)!r} holds no unbroken run (no readable config.json); give a run directory")
    cfg = config_from_dict(data)
    if cfg.model.family != "llama":
        raise ValueError(f"{str(run_dir)!r} trained model.family={cfg.model.family!r}; unbroken export --hf "
                         "exports the built-in llama (model.family='llama') only")
    return cfg


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint to export, verified: step ``step``, or the newest intact one."""
    root = run_dir / "checkpoints"
    if step is None:
        path = latest_checkpoint(run_dir)
        if path is None:
            raise ValueError(f"{str(run_dir)!r} has no committed checkpoint; train with checkpoints first")
        return path
    steps = [int(p.name.split("_")[-1]) for p in committed_checkpoints(root)]
    if step not in steps:
        raise ValueError(f"--step {step}: {str(run_dir)!r} has no committed checkpoint at that step; "
                         f"committed steps: {sorted(steps) or 'none'}")
    path = checkpoint_dir(run_dir, step)
    verify_checkpoint(path)
    return path


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model's parameters of a verified checkpoint under our names (``layers.0.attention.wq.weight``...)."""
    from safetensors import safe_open

    commit = json.loads((path / "commit.json").read_text())
    names = [e[0] for e in commit.get("state", []) if e[0].startswith(_PREFIX)]
    out: dict[str, torch.Tensor] = {}
    if "hsdp_parts" in commit:  # an HSDP run: the sharded parameters from its parts, whole
        from unbroken.checkpoint.sharded import hsdp_part_keys, load_hsdp_parts

        held = hsdp_part_keys(path)
        layout = {e[0]: e for e in commit["state"]}
        wanted = {n: torch.empty(layout[n][2], dtype=getattr(torch, layout[n][1])) for n in names if n in held}
        out.update(load_hsdp_parts(path, int(commit["hsdp_parts"]), wanted)[0])
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys() if k.startswith(_PREFIX) and k not in out})
    if not out:
        raise ValueError(f"{path} holds no model parameters (model.*)")
    return {k.removeprefix(_PREFIX): v for k, v in out.items()}


def _args_of(cfg: Config, ours: dict[str, torch.Tensor], path: Path) -> ModelArgs:
    vocab = ours["tok_embeddings.weight"].shape[0]
    overrides: dict[str, object] = {"vocab_size": vocab}
    if cfg.model.max_seq_len is not None:
        overrides["max_seq_len"] = cfg.model.max_seq_len
    args = model_args(cfg.model.preset, **overrides)
    dim = ours["tok_embeddings.weight"].shape[1]
    if dim != args.dim or f"layers.{args.n_layers - 1}.attention.wq.weight" not in ours:
        raise ValueError(f"{path} does not hold a model.preset={cfg.model.preset!r} model (width {dim}); "
                         "the run's config.json and its checkpoints disagree")
    return args


def export_hf(run_dir: str | Path, out: str | Path, *, dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
              step: int | None = None) -> Path:
    """Write checkpoint ``step`` (default: the newest intact one) of run ``run_dir`` as a Hugging Face
    directory ``out``; returns the checkpoint exported.

    Raises:
        ValueError: ``out`` exists, ``dtype`` is unknown, the run is not a built-in llama run, or ``step``
            has no committed checkpoint (names the steps that have one).
        CheckpointError: the checkpoint is incomplete or damaged (names the file); nothing is written.
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    run_dir, out = Path(run_dir), Path(out)
    if out.exists():
        raise ValueError(f"--hf {str(out)!r} exists; give a new directory (it is never replaced)")
    cfg = _run_config(run_dir)
    path = _checkpoint(run_dir, step)
    ours = read_model_weights(path)
    args = _args_of(cfg, ours, path)
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in hf_state_dict_from_ours(ours, args).items()}
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(tmp, tensors, args, dtype, cfg)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported %s to %s (%s)", path, out, dtype)
    return path


def _write(tmp: Path, tensors: dict[str, torch.Tensor], args: ModelArgs, dtype: str, cfg: Config) -> None:
    from safetensors.torch import save_file

    t = require_transformers()
    config = hf_config(args)
    config.use_cache = True  # for generation by whoever loads it; training set it off
    config.dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    config.save_pretrained(str(tmp))
    t.GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = _tokenizer_file(cfg.data.tokenizer)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")


def _tokenizer_file(spec: str) -> Path | None:
    """The run's ``tokenizer.json``: the file itself, or the one in the directory named (None: no tokenizer)."""
    if not spec:
        return None
    p = Path(spec).expanduser()
    p = p / "tokenizer.json" if p.is_dir() else p
    return p if p.is_file() else None
