"""The loop a user writes without unbroken, on the same model and batch shape: the throughput reference.

:func:`plain_loop` trains our LLaMA (``unbroken.models.build_model``, the
config's preset, vocabulary and micro-batch) in one process with plain
PyTorch: forward under the config's precision, cross-entropy, backward,
gradient clipping, AdamW (fused on CUDA, ``foreach=False`` on CPU, as
unbroken's), optionally with ``torch.compile(model)`` (the whole model, as a
torchtitan user would). :func:`flops_per_token` and :func:`peak_flops` give
MFU the way torchtitan counts it (``6 N + 12 L D T``, embeddings excluded, bf16
dense peak of the card).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from unbroken.config import Config
from unbroken.job.parallelize import parallelize
from unbroken.models import build_model
from unbroken.models.llama import count_parameters, model_args
from unbroken.models.precision import autocast

__all__ = ["flops_per_token", "peak_flops", "plain_loop"]

_PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "H800": 989.4e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 tensor-core peak FLOP/s by card (the vendors' figures, without sparsity)."""


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token: ``6 N`` (N without the embeddings) plus attention's ``12 L D T``."""
    args = model_args(cfg.model.preset, vocab_size=cfg.data.vocab_size,
                      **({"max_seq_len": cfg.model.max_seq_len} if cfg.model.max_seq_len else {}))
    n = count_parameters(args) - args.vocab_size * args.dim
    return 6.0 * n + 12.0 * args.n_layers * args.dim * cfg.data.seq_len


def peak_flops(device: torch.device) -> float | None:
    """The card's dense bf16 peak, None off CUDA or for a card not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_BF16.items() if k in name), None)


def plain_loop(cfg: Config, device: torch.device, *, compile: bool, steps: int,
               activation_checkpointing: str = "none") -> dict[str, Any]:
    """Train ``steps`` steps of ``cfg``'s model on random tokens; median steady-state tokens/s and peak memory.

    The first fifth of the steps (compilation included) is warm-up and dropped, as in unbroken's summary.
    """
    torch.manual_seed(cfg.train.seed)
    v, b, t = cfg.data.vocab_size, cfg.data.micro_batch, cfg.data.seq_len
    model = build_model(cfg.model.preset, vocab_size=v, seq_len=t, max_seq_len=cfg.model.max_seq_len,
                        seed=cfg.train.seed, device=device)
    if activation_checkpointing != "none":
        parallelize(model, compile=False, activation_checkpointing=activation_checkpointing)
    o, cuda = cfg.optim, device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, **({"fused": True} if cuda else {"foreach": False}))
    run = torch.compile(model) if compile else model
    tokens = torch.randint(0, v, (b, t + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with autocast(device, cfg.train.precision):
            logits = run(x)
            loss = F.cross_entropy(logits.float().reshape(-1, v), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip, foreach=cuda)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # the loss a user logs: waits for the step, as unbroken's metrics do
        times.append(time.perf_counter() - t0)
    steady = times[len(times) // 5:]
    step_s = statistics.median(steady)
    out = {"tokens_per_s": b * t / step_s, "step_s": step_s, "first_step_s": times[0],
           "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}
    del model, opt, run
    if cuda:
        torch.cuda.empty_cache()
    return out
