"""Named presets: functions returning a :class:`Config`; a variant calls its base and changes a few fields."""

from __future__ import annotations

from typing import Callable

from unbroken.config.sections import Config

def _debug() -> Config:
    cfg = Config()
    cfg.model.preset = "debug"
    cfg.data.seq_len = 64
    cfg.data.micro_batch = 8
    return cfg


def _tiny() -> Config:
    cfg = Config()
    cfg.model.preset = "tiny"
    cfg.data.seq_len = 128
    cfg.data.micro_batch = 16
    cfg.optim.lr = 2e-3
    return cfg


def _tiny_depth(model: str, rank: int) -> Callable[[], Config]:
    """``tiny`` with another depth at about its block parameter count; the low-rank FFN gradient keeps
    ``tiny``'s rank / width (32 / 128), so only the depth changes what MeCeFO approximates."""

    def preset() -> Config:
        cfg = _tiny()
        cfg.model.preset = model
        cfg.mecefo.rank = rank
        return cfg

    return preset


def _paper_shape(model: str) -> Callable[[], Config]:
    def preset() -> Config:
        cfg = Config()
        cfg.model.preset = model
        cfg.data.vocab_size = 32000
        cfg.data.seq_len = 256
        cfg.data.micro_batch = 8
        cfg.optim.lr = 1e-3
        cfg.optim.warmup_steps = 100
        return cfg

    return preset


PRESETS: dict[str, Callable[[], Config]] = {
    "debug": _debug,
    "tiny": _tiny,
    "tiny-2l": _tiny_depth("tiny-2l", rank=46),
    "tiny-8l": _tiny_depth("tiny-8l", rank=24),
    "llama-60m": _paper_shape("llama-60m"),
    "llama-350m": _paper_shape("llama-350m"),
    "llama-1b": _paper_shape("llama-1b"),
    "llama-7b": _paper_shape("llama-7b"),
}


def preset(name: str) -> Config:
    """Return a fresh config of the named preset."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name]()
