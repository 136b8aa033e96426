"""A finished run's final parameters evaluated on the whole validation split.

The runs' own validation (``train.val_batches`` micro-batches drawn with the
run's seed) is the curve and the figure the studies compare by default; it is
small (8192 tokens in the MeCeFO studies) and differs between seeds. This
evaluates the final parameters a run saved on every window of the validation
split, in order, the same windows for every run, and caches the result in the
run directory (``final_val_full.json``), so a study read back with
``--reuse`` does not evaluate twice.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["FULL_VAL_FILE", "full_split_validation"]

FULL_VAL_FILE = "final_val_full.json"
BATCH_ROWS = 64
"""Windows per forward pass (the result does not depend on it beyond float summation order)."""


def full_split_validation(run_dir: Path, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """``{"windows", "tokens", "val_loss", "val_ppl"}`` of the run's final parameters on the whole split.

    Raises:
        FileNotFoundError: the run saved no final parameters (``final_params.safetensors``).
        ValueError: the run's data has no validation split.
    """
    cached = run_dir / FULL_VAL_FILE
    if cached.is_file():
        return json.loads(cached.read_text())
    import torch
    from safetensors.torch import load_file

    from unbroken.config import config_from_dict
    from unbroken.data.blend import Blend
    from unbroken.data.sampler import ValidationSampler
    from unbroken.job.builder import prepare
    from unbroken.job.simulator import FINAL_PARAMS
    from unbroken.models import resolve_device
    from unbroken.models.factory import validation_loss

    params = run_dir / FINAL_PARAMS
    if not params.is_file():
        raise FileNotFoundError(f"{params}: the run saved no final parameters to evaluate")
    cfg = config_from_dict(cfg_dict)
    device = resolve_device(cfg.train.device)
    prepared = prepare(cfg, device)  # the data and the model only: nothing here trains
    if not hasattr(prepared.data, "val"):
        raise ValueError(f"{run_dir}: the run's data has no validation split to evaluate on")
    prepared.model.load_state_dict({k: v.to(device) for k, v in load_file(str(params)).items()})
    val = prepared.data.val
    if isinstance(val, Blend):
        raise ValueError(f"{run_dir}: the run trained on a blend of sources; its final evaluation takes one "
                         "token stream (evaluate a run of one source)")
    sampler = ValidationSampler(val, seq_len=cfg.data.seq_len, batch_size=BATCH_ROWS)
    with torch.no_grad():
        loss = validation_loss(prepared.model, lambda i, _slot: sampler.batch(i), len(sampler), device,
                               cfg.train.precision)
    windows = len(sampler) * BATCH_ROWS
    out = {"windows": windows, "tokens": windows * cfg.data.seq_len, "val_loss": loss, "val_ppl": math.exp(loss)}
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, cached)
    return out
