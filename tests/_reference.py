"""Plain single-process training on the global batch: the oracle for every runtime.

Deliberately independent of unbroken.mecefo and unbroken.runtime's step code:
one forward over the concatenated global batch, mean cross-entropy, backward,
clip, AdamW. Only the data sampler, the model and the optimizer/schedule
builders are shared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from unbroken.config import Config
from unbroken.data import BatchSampler, prepare_data
from unbroken.models import build_model
from unbroken.models.optim import build_optimizer, lr_at, set_lr


def reference_train(cfg: Config, steps: int | None = None, *, moments: bool = False):
    """Parameters by name after ``steps`` (default ``train.steps``); with ``moments``, also
    ``{name: (exp_avg, exp_avg_sq)}``."""
    d, t = cfg.data, cfg.train
    data = prepare_data(source=d.source, vocab_size=d.vocab_size, val_fraction=d.val_fraction,
                        cache_dir=d.cache_dir, max_bytes=d.max_bytes)
    sampler = BatchSampler(data.train, seed=t.seed, n_slots=cfg.n_slots, micro_batch=d.micro_batch, seq_len=d.seq_len)
    model = build_model(cfg.model.preset, vocab_size=data.vocab_size, seq_len=d.seq_len, seed=t.seed)
    o = cfg.optim
    opt = build_optimizer(model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    for step in range(steps if steps is not None else t.steps):
        xs, ys = zip(*(sampler.batch(step, slot) for slot in range(cfg.n_slots)))
        x, y = torch.cat(xs), torch.cat(ys)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, foreach=False)
        set_lr(opt, lr_at(step, lr=o.lr, warmup_steps=o.warmup_steps, min_lr_ratio=o.min_lr_ratio,
                          total_steps=t.steps))
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if not moments:
        return params
    return params, {n: (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                    for n, p in model.named_parameters()}


def checkpoint_params(ckpt_dir) -> dict[str, torch.Tensor]:
    """Model parameters of a committed checkpoint, read with safetensors (no pickle); an HSDP checkpoint's
    from its shard indices' parts, concatenated on the dimension each names."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    def read(d: Path) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        for f in sorted(d.glob("*.safetensors")):
            got.update({k[len("model."):]: v for k, v in load_file(str(f)).items() if k.startswith("model.")})
        return got

    ckpt_dir = Path(ckpt_dir)
    k = json.loads((ckpt_dir / "commit.json").read_text()).get("hsdp_parts")
    if not k:
        return read(ckpt_dir)
    parts = [ckpt_dir / "shards" / f"i{i}" for i in range(k)]
    dims = json.loads((parts[0] / "part.json").read_text())["dims"]
    tensors = [read(d) for d in parts]
    return {name: torch.cat([t[name] for t in tensors], dim=dims["model." + name]) for name in tensors[0]}
