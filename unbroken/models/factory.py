"""Build a model from a preset name with the run's vocabulary and sequence length."""

from __future__ import annotations

import torch

from unbroken.models.llama import Transformer, model_args


def build_model(
    preset: str,
    *,
    vocab_size: int,
    seq_len: int,
    max_seq_len: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Transformer:
    """A freshly initialised model; the same arguments give the same weights anywhere.

    Raises:
        ValueError: unknown preset, or ``seq_len`` longer than the model's
            ``max_seq_len`` (names both).
    """
    overrides: dict[str, object] = {"vocab_size": vocab_size}
    if max_seq_len is not None:
        overrides["max_seq_len"] = max_seq_len
    args = model_args(preset, **overrides)
    if seq_len > args.max_seq_len:
        raise ValueError(
            f"data.seq_len={seq_len} is longer than model {preset!r} allows "
            f"(max_seq_len={args.max_seq_len}); lower data.seq_len or raise model.max_seq_len"
        )
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    return model
